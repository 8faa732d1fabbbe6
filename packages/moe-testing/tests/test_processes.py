"""run_process_tree: subprocess.run's contract, except that a command past its time limit is
killed with every process it started, also one detached with setsid (as torchrun starts
its ranks, out of reach of subprocess.run's kill and of a process-group kill)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from moe_testing import run_process_tree


def test_a_finished_command_returns_its_status_and_output():
    done = run_process_tree([sys.executable, "-c", "import sys; print('out'); sys.exit(3)"],
                            timeout=60, capture_output=True, text=True)
    assert done.returncode == 3 and done.stdout == "out\n" and done.stderr == ""


@pytest.mark.multiprocess
@pytest.mark.parametrize("setsid", [False, True], ids=["same-group", "setsid"])
def test_past_its_timeout_every_process_it_started_is_killed(tmp_path, setsid):
    marker = tmp_path / "survived"
    child = f"import time, pathlib; time.sleep(3); pathlib.Path({str(marker)!r}).touch()"
    parent = (f"import subprocess, sys; print('started', flush=True); "
              f"subprocess.run([sys.executable, '-c', {child!r}], start_new_session={setsid})")
    with pytest.raises(subprocess.TimeoutExpired) as e:
        run_process_tree([sys.executable, "-c", parent], timeout=1.0, capture_output=True, text=True)
    assert e.value.output == "started\n"  # what it printed before the kill
    time.sleep(4)
    assert not marker.exists()
