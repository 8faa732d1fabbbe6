"""Runs that cannot lose or corrupt work (tiny preset, one CPU process through the command
line): divergence restarts, one run per run directory, and faults reported in one line."""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from pretrain.cli import main
from pretrain.divergence import SkipGuard, TrainingAborted

DIVERGING = ["--config", "tiny", "train.steps=40", "optim.lr=1e4", "checkpoint.every=2"]


def _committed(run_dir: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_*")
                  if (p / "manifest.json").is_file())


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_divergence_restarts_end_non_zero_with_the_good_checkpoint_kept(tmp_path, capsys):
    """A run with good checkpoints, then the documented "same command again" six times at a
    learning rate that diverges: no skipped step is saved, retention keeps the last good
    checkpoint, and the restarts are refused naming the step they would return to."""
    assert main(["--config", "tiny", f"run_dir={tmp_path}", "train.steps=40", "checkpoint.every=2",
                 "train.stop_after=4"]) == 0
    assert _committed(tmp_path) == [2, 4]
    statuses = [main([*DIVERGING, f"run_dir={tmp_path}"]) for _ in range(6)]
    assert statuses == [1] * 6
    err = capsys.readouterr().err
    first_skip = min(r["step"] for r in _records(tmp_path) if r["skipped"])
    kept = _committed(tmp_path)
    assert kept and max(kept) < first_skip  # nothing saved from the trouble on
    assert err.count("consecutive steps") == 1  # the first restart diverged; five were refused
    assert err.count(f"would return to the checkpoint of step {max(kept)} and repeat them") == 5


def test_a_diverged_run_continues_with_a_changed_lr_or_when_allowed(tmp_path, capsys):
    assert main([*DIVERGING, f"run_dir={tmp_path}", "train.steps=8"]) == 1
    marker = json.loads((tmp_path / "diverged.json").read_text())
    assert marker["return_step"] == max(_committed(tmp_path))
    args = ["--config", "tiny", f"run_dir={tmp_path}", "train.steps=8", "checkpoint.every=2"]
    assert main([*args, "optim.lr=1e4", "train.allow_resume_after_divergence=true"]) == 1
    assert "on the same settings (train.allow_resume_after_divergence=true)" in capsys.readouterr().out
    assert main([*args, "optim.lr=1e-3"]) == 0
    assert "optim.lr=0.001 (was 10000)" in capsys.readouterr().out
    assert not (tmp_path / "diverged.json").exists()  # a checkpoint beyond the divergence
    assert _committed(tmp_path)[-1] == 8


def test_a_stop_on_a_skipped_step_saves_nothing():
    guard = SkipGuard(limit=3)
    assert not guard.checkpointable({"skipped": True}) and guard.checkpointable({"skipped": False})


def test_the_skip_count_and_the_clean_checkpoint_survive_a_resume():
    guard = SkipGuard(limit=3)
    guard.observe({"step": 1, "skipped": False})
    assert guard.saved(1) == {"consecutive_skips": 0, "clean_step": 1}
    guard.observe({"step": 2, "skipped": True, "loss": 1.0, "grad_norm": float("nan")})
    guard.observe({"step": 3, "skipped": False})
    # a checkpoint after a skip is not clean: retention keeps step 1's
    assert guard.saved(3) == {"consecutive_skips": 0, "clean_step": 1}
    resumed = SkipGuard(limit=3)
    resumed.resumed(3, {"consecutive_skips": 2, "clean_step": 1})
    assert resumed.clean_step == 1
    with pytest.raises(TrainingAborted, match="3 consecutive steps \\(to step 4\\)"):
        resumed.observe({"step": 4, "skipped": True, "loss": 1.0, "grad_norm": float("nan")})
    assert resumed.saved(5)["clean_step"] == 1
    assert resumed.saved(7)["clean_step"] == 7


def test_a_second_run_on_a_held_run_dir_is_refused_and_the_first_completes(tmp_path, capsys):
    first = subprocess.Popen(
        [sys.executable, "-m", "pretrain", "--config", "tiny", f"run_dir={tmp_path}",
         "train.steps=40"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "metrics.jsonl").is_file():  # training, the lock held
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.1)
        assert main(["--config", "tiny", f"run_dir={tmp_path}", "train.steps=40"]) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"pretrain: error: run_dir='{tmp_path}' is in use by another run: "
                              f"pid {first.pid} on host {socket.gethostname()}") and "\n" not in err
    finally:
        out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-2000:]
    assert [r["step"] for r in _records(tmp_path)] == list(range(1, 41))
    assert (tmp_path / "run.lock").read_text() == ""  # released cleanly


def test_a_lock_left_by_a_killed_run_is_reported_and_taken_over(tmp_path, capsys):
    (tmp_path / "run.lock").write_text(json.dumps(
        {"pid": 2**22 + 1, "host": socket.gethostname(), "since": "2026-01-01 00:00:00"}))
    assert main(["--config", "tiny", f"run_dir={tmp_path}", "train.steps=4"]) == 0
    assert (f"warning: run_dir {tmp_path}: taking over the lock of a run that did not end cleanly: "
            f"pid {2**22 + 1} on host {socket.gethostname()}") in capsys.readouterr().err


def _saved_run(run_dir: Path, *extra: str) -> list[str]:
    """A run of 8 steps stopped after step 6, checkpoints at 2, 4 and 6; its command."""
    cmd = ["--config", "tiny", f"run_dir={run_dir}", "train.steps=8", "checkpoint.every=2",
           "checkpoint.keep_last=0", *extra]
    assert main([*cmd, "train.stop_after=6"]) == 0
    return cmd


def test_a_step_directory_without_its_manifest_is_set_aside_and_the_run_goes_on(tmp_path, capsys):
    cmd = _saved_run(tmp_path)
    (tmp_path / "checkpoints" / "step_0000000006" / "manifest.json").unlink()
    capsys.readouterr()
    assert main(cmd) == 0
    captured = capsys.readouterr()
    assert "step_0000000006 has no manifest.json (an unfinished or damaged checkpoint): moved to " \
        "step_0000000006.uncommitted-" in captured.err
    assert "resumed after step 4" in captured.out
    assert _committed(tmp_path) == [2, 4, 6, 8]
    assert main(cmd) == 0 and "nothing to train" in capsys.readouterr().out  # no crash loop


def _rewrite_manifest(step_dir: Path, change) -> None:
    from moe_ckpt.manifest import read_manifest, write_manifest

    manifest = read_manifest(step_dir)
    change(manifest)
    write_manifest(step_dir, manifest)


def _one_line_error(capsys, status: int, argv: list[str]) -> str:
    assert main(argv) == status
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("pretrain: error: "), err
    return err.strip().splitlines()[-1]


def test_an_edited_manifest_step_is_one_line(tmp_path, capsys):
    cmd = _saved_run(tmp_path)
    manifest = tmp_path / "checkpoints" / "step_0000000006" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"step":6', '"step":7'))
    assert "manifest.json: the manifest does not match its sha256" in _one_line_error(capsys, 1, cmd)


@pytest.mark.parametrize("change, message", [
    (lambda m: m.metadata.update(step=7), "the checkpoint's metadata says step 7, its manifest step 6"),
    (lambda m: m.metadata.pop("data"), "lacks data.global_batch"),
    (lambda m: m.metadata["config"].pop("model"), "lacks config.model"),
    (lambda m: m.rank_metadata[0]["rng"].update(cpu="not base64!"), "no usable RNG state for rank 0"),
    (lambda m: m.rank_metadata[0]["rng"].update(cpu="AAAA"), "3 bytes, a CPU generator state has"),
    (lambda m: m.rank_metadata[0].pop("rng"), "no usable RNG state for rank 0"),
])
def test_malformed_checkpoint_metadata_is_one_line(tmp_path, capsys, change, message):
    cmd = _saved_run(tmp_path)
    _rewrite_manifest(tmp_path / "checkpoints" / "step_0000000006", change)
    assert message in _one_line_error(capsys, 1, cmd)


@pytest.fixture(scope="module")
def token_dir(tmp_path_factory) -> Path:
    """A small token directory (bytes tokenizer) made by prepare-data."""
    root = tmp_path_factory.mktemp("corpus")
    words = ["alpha", "beta", "gamma", "delta"]
    (root / "text.txt").write_text(" ".join(words[(i * 7) % 5 % 4] for i in range(12000)))
    assert main(["prepare-data", "--out", str(root / "tokens"), str(root / "text.txt")]) == 0
    return root / "tokens"


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_setup_errors_are_one_line_and_create_no_run_dir(tmp_path, token_dir, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    base = ["--config", "tiny", f"run_dir={run_dir}", "train.steps=4"]
    capsys.readouterr()
    binary = _copy(token_dir, tmp_path / "binary")
    (binary / "tokens.json").write_bytes(bytes(range(256)) * 2)
    assert "tokens.json: not valid JSON" in _one_line_error(capsys, 1, [*base, f"data.path={binary}"])
    outside = _copy(token_dir, tmp_path / "outside")
    (outside / "tokens.json").write_text((outside / "tokens.json").read_text().replace(
        '"part-00000.bin"', '"../binary/part-00000.bin"'))
    assert "must name a file in" in _one_line_error(capsys, 1, [*base, f"data.path={outside}"])
    real_memmap = np.memmap

    def unreadable(file, *args, **kwargs):
        if str(file).endswith(".bin"):
            raise PermissionError(13, "Permission denied", str(file))
        return real_memmap(file, *args, **kwargs)

    monkeypatch.setattr(np, "memmap", unreadable)
    assert f"{token_dir / 'part-00000.bin'}: cannot read: Permission denied" in _one_line_error(
        capsys, 1, [*base, f"data.path={token_dir}", "data.verify=false"])
    monkeypatch.undo()
    assert "train.global_batch" in _one_line_error(capsys, 2, [*base, "train.global_batch=0"])
    assert not run_dir.exists()  # nothing checked so far created it


def test_an_unwritable_run_dir_is_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    run_dir = tmp_path / "file" / "run"
    assert _one_line_error(capsys, 1, ["--config", "tiny", f"run_dir={run_dir}"]) == \
        f"pretrain: error: run_dir='{run_dir}' cannot be written: Not a directory ({run_dir})"


def test_a_full_disk_under_the_metrics_ends_the_run_in_one_line(tmp_path, capsys, monkeypatch):
    import pretrain.metrics as metrics

    class FullAfterStep2:
        def __init__(self, file) -> None:
            self.file = file

        def write(self, text: str) -> int:
            if json.loads(text)["step"] > 2:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.file.write(text)

        def close(self) -> None:
            self.file.close()

    opened = metrics.JsonlTracker.__init__

    def full_disk(self, *args, **kwargs):
        opened(self, *args, **kwargs)
        self._file = FullAfterStep2(self._file)

    monkeypatch.setattr(metrics.JsonlTracker, "__init__", full_disk)
    err = _one_line_error(capsys, 1, ["--config", "tiny", f"run_dir={tmp_path}", "train.steps=6",
                                      "checkpoint.every=2"])
    assert err == (f"pretrain: error: {tmp_path / 'metrics.jsonl'}: writing step 3 failed: No space "
                   "left on device; make room and run the same command again (it resumes from the "
                   "last checkpoint)")
    assert _committed(tmp_path) == [2] and [r["step"] for r in _records(tmp_path)] == [1, 2]


def test_export_to_an_unwritable_path_and_plot_of_a_binary_file_are_one_line(tmp_path, capsys):
    assert main(["--config", "tiny", f"run_dir={tmp_path}", "train.steps=4",
                 "checkpoint.every=4"]) == 0
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "hf"
    err = _one_line_error(capsys, 1, ["export-hf", str(tmp_path / "checkpoints" / "step_0000000004"),
                                      str(out)])
    assert ": Not a directory (exporting " in err
    (tmp_path / "metrics.jsonl").write_bytes(b"\xff\xfe" + bytes(range(256)))
    assert _one_line_error(capsys, 1, ["plot", str(tmp_path)]) == \
        f"pretrain: error: {tmp_path / 'metrics.jsonl'}: not a metrics file (not UTF-8 text: byte 0)"
    (tmp_path / "metrics.jsonl").write_text('[1, 2]\n{"step": 2}\n')
    assert "metrics.jsonl:1: not a metrics record" in _one_line_error(capsys, 1, ["plot", str(tmp_path)])


@pytest.mark.parametrize("when", ["trainer.close", "on the way out"])
def test_a_sigterm_during_teardown_leaves_a_finished_run_exit_0(tmp_path, when):
    script = textwrap.dedent(f"""
        import os, signal, sys
        import pretrain.trainer, pretrain.train
        if {when!r} == "trainer.close":
            close = pretrain.trainer.Trainer.close
            def close_after_sigterm(self):
                os.kill(os.getpid(), signal.SIGTERM)  # preempted while tearing down
                close(self)
            pretrain.trainer.Trainer.close = close_after_sigterm
        from pretrain.cli import main
        status = main(["--config", "tiny", "run_dir={tmp_path}", "train.steps=4"])
        if {when!r} == "on the way out":  # the interpreter's own teardown
            os.kill(os.getpid(), signal.SIGTERM)
        sys.exit(status)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert [r["step"] for r in _records(tmp_path)] == [1, 2, 3, 4]


def test_the_collective_timeout_is_the_process_groups(monkeypatch):
    import torch.distributed as dist
    from pretrain.runtime import distributed

    seen = {}
    init = dist.init_process_group

    def spy(*args, **kwargs):
        seen["timeout"] = kwargs["timeout"]
        return init(*args, **kwargs)

    monkeypatch.setattr(dist, "init_process_group", spy)
    with distributed("cpu", 42.0):
        pass
    assert seen["timeout"].total_seconds() == 42.0
    from pretrain.config import load_config
    assert load_config("tiny", []).train.collective_timeout_s == 600.0
    with pytest.raises(ValueError, match="train.collective_timeout_s"):
        load_config("tiny", ["train.collective_timeout_s=0"])


# Rank 1 of two, at step 3: dies as the out-of-memory killer would end it, or stops answering
# for longer than rank 0's collective timeout (8 s: it also bounds the ranks' first connect,
# which a loaded machine has taken over 2 s to make).
_RANK_1_FAILS = {
    "dies": ("os._exit(3)", 60),
    "hangs": ("time.sleep(20)", 8),
}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("failure, message", [
    ("dies", r"pretrain: error: rank 0 of 2: another rank failed or was stopped during a "
             r"collective \([^()]*Connection (closed|reset) by peer[^()]*\); that rank's output says why"),
    ("hangs", r"pretrain: error: rank 0 of 2: a collective waited longer than "
              r"train.collective_timeout_s=8 s for another rank, which failed, hung or is far "
              r"behind \((Timed out waiting 8000ms for recv operation to complete|"
              r"Application timeout caused pair closure)\)"),
])
def test_a_rank_that_dies_or_hangs_ends_its_peer_in_one_line(tmp_path, failure, message):
    """torchrun, two ranks on CPU (gloo): the surviving rank's collective fails with gloo's
    error, a source location and a socket; it says in one line, without a traceback, that
    another rank failed, or that it waited out ``train.collective_timeout_s``."""
    action, timeout_s = _RANK_1_FAILS[failure]
    script = tmp_path / "rank_1_fails.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys, time
        import pretrain.trainer
        train_step = pretrain.trainer.Trainer.train_step
        def failing(self, step, *args, **kwargs):
            if step == 3 and os.environ["RANK"] == "1":
                {action}
            return train_step(self, step, *args, **kwargs)
        pretrain.trainer.Trainer.train_step = failing
        from pretrain.cli import main
        sys.exit(main())
    """))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script), "--config", "tiny", "train.steps=8", f"train.collective_timeout_s={timeout_s}",
         f"run_dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=200, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("pretrain: error: rank 0")]
    assert len(errors) == 1 and re.fullmatch(message, errors[0]), proc.stderr[-3000:]
    # the launcher's own report has a traceback; the ranks' frames must not appear
    assert not re.search(r'File ".*/(pretrain|moe_\w+)/', proc.stderr), proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_whose_peers_never_join_says_so_in_one_line(tmp_path, rank):
    """Rank 0 of 2 waits at the rendezvous for a rank 1 that never starts; rank 1 of 2
    finds no rank 0 at MASTER_ADDR:MASTER_PORT. Each fails after
    ``train.collective_timeout_s`` with one line naming the address and the key, and no
    Python traceback (exit 1)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "WORLD_SIZE": "2",
           "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    proc = subprocess.run(
        [sys.executable, "-m", "pretrain.cli", "--config", "tiny", "train.steps=4",
         "train.collective_timeout_s=3", f"run_dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=100, env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"pretrain: error: rank {rank} of 2: the ranks did not all join the process "
                        rf"group at 127\.0\.0\.1:{port} within train\.collective_timeout_s=3 s "
                        r"\(.*(clients joined|timed out).*\); start every rank, with the same "
                        r"MASTER_ADDR and MASTER_PORT", last), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("line, message", [
    ('[train]\nsteps = "40"', "train.steps expects an integer, got '40' (a quoted string in TOML"),
    ('[optim]\nlr = "1e-3"', "optim.lr expects a number, got '1e-3' (a quoted string in TOML"),
    ('[checkpoint]\nasync_save = "false"', "checkpoint.async_save expects true or false, got 'false'"),
    ('[train]\nstop_after = "10"', "train.stop_after expects an integer or none, got '10'"),
])
def test_a_toml_string_where_a_number_is_expected_is_refused(tmp_path, line, message):
    from pretrain.config import ConfigError, load_config

    path = tmp_path / "run.toml"
    path.write_text(line + "\n")
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(str(path), [])
    key, value = line.split("\n")[1].split(" = ")
    section = line.split("]")[0][1:]
    cfg = load_config("tiny", [f"{section}.{key}={value.strip(chr(34))}"])  # the command line's text
    assert str(getattr(getattr(cfg, section), key)).lower() in (value.strip('"').lower(), "0.001")


def test_retention_keeps_the_last_checkpoint_from_before_intermittent_skips(tmp_path, monkeypatch):
    """Steps 3 and 5 non-finite (never the limit in a row): with keep_last=1 the newest
    checkpoint with no skip since the one before it (step 2) outlives the later ones."""
    from pretrain.trainer import Trainer

    forward_backward = Trainer.eager_forward_backward

    def poisoned(self, step: int):
        result = forward_backward(self, step)
        if step in (3, 5):
            self.ddp.grad_buffers()[0][1][0] = float("nan")
        return result

    monkeypatch.setattr(Trainer, "eager_forward_backward", poisoned)
    assert main(["--config", "tiny", f"run_dir={tmp_path}", "train.steps=6", "optim.warmup_steps=2",
                 "checkpoint.every=1", "checkpoint.keep_last=1"]) == 0
    assert [r["skipped"] for r in _records(tmp_path)] == [False, False, True, False, True, False]
    assert _committed(tmp_path) == [2, 6]


TORCH_OOM = ("CUDA out of memory. Tried to allocate 3.06 GiB. GPU 0 has a total capacity of 79.19 GiB\n"
             "Of the allocated memory 71.20 GiB is allocated by PyTorch")


def _explained(overrides: list[str], gpu_gib: float, monkeypatch) -> str:
    """The error a run of bench-1gpu with the overrides reports when torch runs out of
    memory on a CUDA device of ``gpu_gib`` (the device's properties stand in for a GPU)."""
    import torch
    from pretrain.config import load_config
    from pretrain.out_of_memory import OutOfMemory, out_of_memory_explained

    class Properties:
        total_memory = int(gpu_gib * 2**30)

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties())
    cfg = load_config("bench-1gpu", overrides)
    with pytest.raises(OutOfMemory) as caught, out_of_memory_explained(cfg, 1, torch.device("cuda", 0)):
        raise torch.OutOfMemoryError(TORCH_OOM)
    assert isinstance(caught.value.__cause__, torch.OutOfMemoryError)
    return str(caught.value)


def test_a_gpu_out_of_memory_names_the_plan_and_the_least_change_that_fits(monkeypatch):
    """bench-1gpu on an 80 GiB GPU: the plan's need (as `pretrain plan --gpu-gib 80` prints
    it) and the first of its offers; torch's first line kept, the rest dropped."""
    from pretrain.config import load_config
    from pretrain.planner import PlanRequest, plan_memory
    from pretrain.planner.remedies import fitting_changes

    message = _explained([], 80.0, monkeypatch)
    cfg = load_config("bench-1gpu")
    need = plan_memory(PlanRequest.from_config(cfg, 1, gpu_gib=80.0)).worst.device_total / 2**30
    first = " ".join(fitting_changes(cfg, 1, gpu_gib=80.0)[0].overrides)
    assert first == "parallel.merge_expert_grad_microbatches=1 model.recompute=block"
    assert message == (
        "the GPU ran out of memory (CUDA out of memory. Tried to allocate 3.06 GiB. GPU 0 has a "
        f"total capacity of 79.19 GiB); the memory plan of this run needs {need:.1f} GiB per GPU "
        f"(pp rank 0) of this GPU's 80.0, it fits with {first}; `pretrain plan` with this config "
        "and world size lists the options")
    assert "\n" not in message


def test_a_gpu_out_of_memory_the_plan_did_not_expect_or_cannot_avoid(monkeypatch):
    """Within the plan (an H200): something outside it holds memory. FP8 on 64 GiB: no
    change fits, the persistent state is named with the fewest GPUs that fit (none on 20
    GiB). On a CPU torch's error is left alone."""
    import torch
    from pretrain.config import load_config
    from pretrain.out_of_memory import out_of_memory_explained

    assert "which the plan expected to fit: something outside the plan" in _explained([], 140.0, monkeypatch)
    fp8 = ["mxfp8.targets=[experts,attn.w?,head]", "mxfp8.recipe=fp8_rowwise_gw_hp", "mxfp8.gemm=triton"]
    assert ("no change of expert-gradient merging, recompute or micro batch fits (62.9 GiB of "
            "persistent state): on 2 GPUs (--gpus 2) it fits with "
            "parallel.merge_expert_grad_microbatches=1 model.recompute=selective (57.5 GiB)"
            ) in _explained(fp8, 64.0, monkeypatch)
    assert ("(62.9 GiB of persistent state): use more GPUs or pipeline stages"
            ) in _explained(fp8, 20.0, monkeypatch)  # not even on 8 GPUs
    with pytest.raises(torch.OutOfMemoryError), \
            out_of_memory_explained(load_config("tiny"), 1, torch.device("cpu")):
        raise torch.OutOfMemoryError(TORCH_OOM)


def test_a_run_the_plan_cannot_fit_is_warned_about_before_it_builds(monkeypatch):
    """Against the GPU's whole memory (no headroom): bench-1gpu on 80 GiB is warned about
    with the least change that fits (planned with the usual 10% headroom); on a 110 GiB GPU
    (the plan: 100.9 GiB, over 99 usable, under 110) and on a CPU nothing is said."""
    import torch
    from pretrain.config import load_config
    from pretrain.out_of_memory import memory_warning

    def warning(gib: float, device: str = "cuda") -> str | None:
        class Properties:
            total_memory = int(gib * 2**30)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties())
        return memory_warning(load_config("bench-1gpu"), 1, torch.device(device))

    line = warning(80.0)
    assert line is not None and line.startswith("warning: the memory plan of this run needs ")
    assert ("more than this GPU's 80.0: expect it to run out of memory; it fits with "
            "parallel.merge_expert_grad_microbatches=1 model.recompute=block") in line
    assert warning(110.0) is None and warning(80.0, "cpu") is None


def test_only_a_lost_peer_or_a_timeout_on_several_ranks_is_a_peer_failure():
    """NCCL's wording too; a one-rank world, another RuntimeError or another kind of error
    is not one (a bug keeps its traceback)."""
    from pretrain.runtime import peer_failure

    nccl = RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1971, remote process exited or "
                        "there was a network error, NCCL version 2.27.3\nncclRemoteError: ...")
    assert str(peer_failure(nccl, 3, 8, 600.0)) == (
        "rank 3 of 8: another rank failed or was stopped during a collective (NCCL error in: "
        "ProcessGroupNCCL.cpp:1971, remote process exited or there was a network error, NCCL "
        "version 2.27.3); that rank's output says why")
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error "
                        "[10.0.0.2]:4711: Connection reset by peer. This is typically caused by a "
                        "remote worker hanging")
    assert "(Read error [10.0.0.2]:4711: Connection reset by peer);" in str(peer_failure(gloo, 0, 2, 60.0))
    assert peer_failure(gloo, 0, 1, 60.0) is None
    # gloo's wording for an asynchronous collective (a gradient bucket) whose pair timed out
    closed = RuntimeError("Application timeout caused pair closure")
    assert str(peer_failure(closed, 0, 2, 8.0)) == (
        "rank 0 of 2: a collective waited longer than train.collective_timeout_s=8 s for another "
        "rank, which failed, hung or is far behind (Application timeout caused pair closure)")
    assert peer_failure(RuntimeError("expected scalar type Float but found Half"), 0, 2, 60.0) is None
    assert peer_failure(ValueError("Connection reset by peer"), 0, 2, 60.0) is None
