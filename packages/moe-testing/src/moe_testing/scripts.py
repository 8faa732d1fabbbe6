"""Import a script that is not part of a package (a benchmark under ``tools/``) by path, so
its functions can be tested on the CPU."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(path: Path) -> ModuleType:
    """The module the Python file at ``path`` defines, named after the file.

    Its directory goes first on ``sys.path``, as ``python path`` puts it: a script imports
    the modules beside it (the tools' shared ``_bench``) the same way in a test. Like an
    import, it registers the module in ``sys.modules`` under that name (loading the file
    again replaces it)."""
    folder = str(Path(path).resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import does: dataclasses look their module up
    spec.loader.exec_module(module)
    return module
