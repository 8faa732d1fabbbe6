"""Every ``python`` code block of every package's and the app's README runs as printed.

A block that says ``torchrun sets the rank and the world size (N)`` runs under
``torch.distributed.run`` with N processes on CPU (gloo); any other block runs as a plain
script. Each runs in a fresh directory (examples may write files) with a timeout.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from moe_testing import run_process_tree

ROOT = Path(__file__).resolve().parents[1]
READMES = sorted(ROOT.glob("packages/*/README.md")) + [ROOT / "apps/pretrain/README.md", ROOT / "README.md"]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
WORLD = re.compile(r"world size \((\d+)\)")


def examples() -> list:
    found = []
    for readme in READMES:
        for i, code in enumerate(BLOCK.findall(readme.read_text())):
            found.append(pytest.param(code, id=f"{readme.relative_to(ROOT).parent}#{i}"))
    return found


def test_every_package_readme_has_an_example():
    ids = {p.id.split("#")[0] for p in examples()}
    assert {f"packages/{p.name}" for p in ROOT.glob("packages/*") if (p / "README.md").is_file()} <= ids


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("code", examples())
def test_readme_example_runs_as_printed(code: str, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(code)
    world = WORLD.search(code)
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc-per-node={world.group(1)}"] if world else [sys.executable])
    done = run_process_tree([*launcher, str(script)], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300)
    assert done.returncode == 0, f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
