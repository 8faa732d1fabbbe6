"""Run ``python -m pretrain ARGS`` with every thread's Python stack dumped every ``EVERY``
seconds into ``DIR/rank{RANK}.txt`` (``faulthandler``): where each host waited when a run
stalls. ``tools/probe_ep_overlap.py`` starts the ranks through it.

    python3 tools/_stack_dumps.py EVERY DIR ARGS...
"""

from __future__ import annotations

import faulthandler
import os
import runpy
import sys

if __name__ == "__main__":
    every, folder = float(sys.argv[1]), sys.argv[2]
    os.makedirs(folder, exist_ok=True)
    dumps = open(os.path.join(folder, f"rank{os.environ.get('RANK', '0')}.txt"), "w")  # noqa: SIM115 (open for the run)
    faulthandler.dump_traceback_later(every, repeat=True, file=dumps)
    sys.argv = ["pretrain", *sys.argv[3:]]
    runpy.run_module("pretrain", run_name="__main__", alter_sys=True)
