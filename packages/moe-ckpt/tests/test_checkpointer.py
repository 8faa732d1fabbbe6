"""Checkpointer: latest and retention, asynchronous saves, crashes (SIGKILL), errors."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import moe_ckpt as mc
import pytest
import torch
import torch.distributed as dist
from moe_ckpt import directory
from moe_testing import run_distributed

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import _crash_child  # noqa: E402  (the crash test's saving process)
from _crash_child import state  # noqa: E402


def _load_state(ckpt: mc.Checkpointer, step: int | None = None) -> tuple[mc.Manifest, dict]:
    out = {k: torch.empty_like(v) for k, v in state(0).items()}
    return ckpt.load(out, step=step), out


def test_latest_and_retention_keep_the_newest(tmp_path: Path):
    config = mc.CheckpointerConfig(keep_last=2, async_save=False)
    with mc.Checkpointer(tmp_path, config) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.save(step, state(step))
        assert ckpt.steps() == [3, 4] and ckpt.latest_step() == 4
        (tmp_path / ".step_0000000009.partial-abc123").mkdir()  # crash leftovers
        (tmp_path / ".step_0000000001.deleting-abc123").mkdir()
        (tmp_path / "step_0000000099").mkdir()  # no manifest: not a checkpoint
        assert ckpt.steps() == [3, 4] and ckpt.latest_step() == 4
        manifest, out = _load_state(ckpt)
        assert manifest.step == 4 and all(torch.equal(out[k], v) for k, v in state(4).items())
        ckpt.save(5, state(5))
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "latest",
            "step_0000000004",
            "step_0000000005",
            "step_0000000099",
            "writer.lock",
        ]
        assert (tmp_path / "latest").read_text() == "step_0000000005\n"  # for other readers
        # The pointer is never trusted for resumption: stale (a crash between the
        # commit and its update), missing or dangling, the newest step is resumed.
        for pointer in ("step_0000000004\n", None, "step_0000000077\n"):
            (tmp_path / "latest").unlink(missing_ok=True)
            if pointer is not None:
                (tmp_path / "latest").write_text(pointer)
            assert ckpt.latest_step() == 5 and _load_state(ckpt)[0].step == 5
        with pytest.raises(FileExistsError):
            ckpt.save(5, state(5))


def test_retention_keeps_the_highest_steps_and_the_new_checkpoint(tmp_path: Path):
    for step in (10, 20, 30):
        mc.save(tmp_path / directory.step_dir_name(step), state(step), step=step)
    directory.write_latest(tmp_path, tmp_path / directory.step_dir_name(10))  # not protected
    new = tmp_path / directory.step_dir_name(15)  # saved below the highest step
    mc.save(new, state(15), step=15)
    directory.retain(tmp_path, keep_last=1, protect=new)
    assert sorted(directory.committed_steps(tmp_path)) == [15, 30]


def test_retention_leaves_the_steps_a_save_names_in_keep(tmp_path: Path):
    """The last good checkpoint stays while later ones come and go (``keep``)."""
    config = mc.CheckpointerConfig(keep_last=1, async_save=False)
    with mc.Checkpointer(tmp_path, config) as ckpt:
        ckpt.save(1, state(1))
        for step in (2, 3, 4):
            ckpt.save(step, state(step), keep=[1])
        assert ckpt.steps() == [1, 4]
        ckpt.save(5, state(5))  # no longer named: retention applies to it again
        assert ckpt.steps() == [5]


def test_async_save_snapshots_before_returning(tmp_path: Path):
    phases: list[str] = []
    with mc.Checkpointer(tmp_path, on_phase=phases.append) as ckpt:
        live = state(1)
        ckpt.save(1, live, {"note": "async"})
        for t in live.values():  # training goes on and changes the tensors
            t.fill_(float("nan"))
        ckpt.wait()
        manifest, out = _load_state(ckpt)
    assert manifest.metadata == {"note": "async"}
    assert all(torch.equal(out[k], v) for k, v in state(1).items())
    assert phases[0] == "planned" and phases[-3:] == ["committed", "latest_updated", "retained"]


def test_async_save_records_metadata_as_of_the_save_call(tmp_path: Path):
    """Nested metadata the loop keeps changing (a data position) is recorded as it was."""
    release = threading.Event()

    def hold(phase: str) -> None:
        if phase == "written":  # the background write waits until the loop moved on
            assert release.wait(30)

    position = {"samples_seen": 1000, "shards": [0, 1]}
    rng = {"seed": 7}
    with mc.Checkpointer(tmp_path, on_phase=hold) as ckpt:
        ckpt.save(1, state(1), {"data": position, "steps": (1, 2)}, rank_metadata=rng)
        position["samples_seen"] = 2000
        position["shards"].append(2)
        rng["seed"] = 8
        release.set()
        manifest, _ = _load_state(ckpt)
    assert manifest.metadata == {"data": {"samples_seen": 1000, "shards": [0, 1]}, "steps": [1, 2]}
    assert manifest.rank_metadata == [{"seed": 7}]


@pytest.mark.parametrize(
    ("metadata", "rank_metadata", "where"),
    [
        ({"data": {"position": torch.tensor(3)}}, None, r"metadata\['data'\]\['position'\]"),
        ({"ok": 1}, [{"rng": {1, 2}}], r"rank_metadata\[0\]\['rng'\]"),
        ({"data": {(1, 2): "tuple key"}}, None, r"metadata\['data'\] key \(1, 2\)"),
    ],
)
def test_unserialisable_metadata_fails_at_the_save_call_naming_it(
    tmp_path: Path, metadata: dict, rank_metadata: object, where: str
):
    with mc.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(TypeError, match=where + " is not JSON-serialisable"):
            ckpt.save(1, state(1), metadata, rank_metadata=rank_metadata)
        assert ckpt.steps() == []
        ckpt.save(1, state(1), {"ok": 1})  # nothing was left behind
        ckpt.wait()
        assert ckpt.steps() == [1]


@pytest.mark.parametrize("async_save", [False, True])
@pytest.mark.parametrize("phase", ["committed", "latest_updated", "retained"])
def test_failure_after_the_commit_keeps_the_checkpoint_and_says_so(
    tmp_path: Path, phase: str, async_save: bool
):
    """The save is committed: it raises PostCommitError, resumes, and the next step saves."""

    def fail_at_step_2(reached: str) -> None:
        if reached == phase and (tmp_path / "arm").exists():
            (tmp_path / "arm").unlink()
            raise OSError(f"disk trouble at {reached}")

    root = tmp_path / "ck"
    config = mc.CheckpointerConfig(keep_last=1, async_save=async_save)
    with mc.Checkpointer(root, config, on_phase=fail_at_step_2) as ckpt:
        ckpt.save(1, state(1))
        ckpt.wait()
        (tmp_path / "arm").touch()
        committed = f"step_0000000002 is committed.*disk trouble at {phase}"
        with pytest.raises(mc.PostCommitError, match=committed):
            ckpt.save(2, state(2))  # raises here when blocking
            ckpt.wait()  # and here when asynchronous
        # Retention had not run yet unless it was what finished: step 1 is still there.
        assert ckpt.steps() == ([2] if phase == "retained" else [1, 2])
        pointer = "step_0000000001" if phase == "committed" else "step_0000000002"
        assert (root / "latest").read_text() == pointer + "\n"
        assert ckpt.latest_step() == 2
    with mc.Checkpointer(root, config) as ckpt:  # the resumed run
        manifest, out = _load_state(ckpt)
        assert manifest.step == 2 and all(torch.equal(out[k], v) for k, v in state(2).items())
        ckpt.save(3, state(3))
        ckpt.wait()
        assert ckpt.steps() == [3] and (root / "latest").read_text() == "step_0000000003\n"


def test_a_failed_directory_fsync_after_the_rename_is_a_post_commit_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The rename made the checkpoint visible: the save must not report it as lost."""
    from moe_ckpt import directory

    def failing_fsync(path: Path) -> None:
        raise OSError(f"fsync of {path} failed")

    root = tmp_path / "ck"
    with mc.Checkpointer(root) as ckpt:
        monkeypatch.setattr(directory, "fsync_dir", failing_fsync)
        with pytest.raises(mc.PostCommitError, match="step_0000000001 is committed.*fsync of .* failed"):
            ckpt.save(1, state(1))  # raises here when blocking
            ckpt.wait()  # and here when asynchronous
        monkeypatch.undo()
        assert ckpt.steps() == [1] and ckpt.latest_step() == 1
        ckpt.save(2, state(2))  # no collision with a step the save had called lost
        ckpt.wait()
        assert ckpt.steps() == [1, 2]


def test_background_error_surfaces_on_the_next_call(tmp_path: Path):
    def fail_once(phase: str) -> None:
        if phase == "written" and not (tmp_path / "failed").exists():
            (tmp_path / "failed").touch()
            raise OSError("disk on fire")

    with mc.Checkpointer(tmp_path / "ck", on_phase=fail_once) as ckpt:
        ckpt.save(1, state(1))  # returns: the failure happens in the background
        with pytest.raises(mc.CheckpointError, match="step 1.*disk on fire"):
            ckpt.save(2, state(2))
        ckpt.save(2, state(2))
        ckpt.wait()
        assert ckpt.steps() == [2]
    assert not any(directory.is_partial_name(p.name) for p in (tmp_path / "ck").iterdir())


CRASH_PHASES = [
    "planned",
    "created",
    "wrote:a",
    "written",
    "manifest_written",
    "committed",
    "latest_updated",
]


@pytest.mark.slow
def test_sigkill_at_any_phase_resumes_from_the_newest_committed_step(tmp_path: Path):
    """Kill a saving process at each phase; check what resumption and retention see."""
    base = tmp_path / "base"
    config = mc.CheckpointerConfig(keep_last=1, async_save=False)
    with mc.Checkpointer(base, config) as ckpt:
        ckpt.save(1, state(1))
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch"])  # no effect if the forkserver already runs
    children = {}
    for phase in CRASH_PHASES:
        root = tmp_path / phase.replace(":", "_")
        shutil.copytree(base, root)
        marker = tmp_path / f"{root.name}.reached"
        proc = ctx.Process(target=_crash_child.run, args=(str(root), 2, phase, str(marker)))
        proc.start()
        children[phase] = (root, marker, proc)
    try:
        deadline = time.monotonic() + 120
        for phase, (_, marker, proc) in children.items():
            while not marker.exists():
                assert proc.is_alive(), f"child for {phase} exited with {proc.exitcode}"
                assert time.monotonic() < deadline, f"child never reached {phase}"
                time.sleep(0.05)
            proc.kill()  # SIGKILL
            proc.join(timeout=30)
            assert proc.exitcode == -9, phase
    finally:
        for _, _, proc in children.values():
            if proc.is_alive():
                proc.kill()

    for phase, (root, _, proc) in children.items():
        # Once renamed into place step 2 is resumed from, whether ``latest`` was updated or not.
        committed = CRASH_PHASES.index(phase) >= CRASH_PHASES.index("committed")
        resumed = 2 if committed else 1
        with mc.Checkpointer(root, config) as ckpt:
            # the killed writer's lock is taken over and reported; every manifest verifies
            assert ckpt.stale_lock is not None and ckpt.stale_lock.startswith(
                f"pid {proc.pid} on host ") and ckpt.stale_lock.endswith("no longer running"), phase
            for step in ckpt.steps():
                mc.open_checkpoint(root / directory.step_dir_name(step))
            assert ckpt.steps() == ([1, 2] if committed else [1]), phase
            assert ckpt.latest_step() == resumed, phase
            manifest, out = _load_state(ckpt)
            assert manifest.step == resumed, phase
            assert all(torch.equal(out[k], v) for k, v in state(resumed).items()), phase
            ckpt.save(resumed + 1, state(resumed + 1))  # the resumed loop's next checkpoint
            assert ckpt.steps() == [resumed + 1] and ckpt.latest_step() == resumed + 1, phase
        expected = ["latest", directory.step_dir_name(resumed + 1), "writer.lock"]  # retention, cleanup
        assert sorted(p.name for p in root.iterdir()) == expected, phase
        assert (root / "latest").read_text() == expected[1] + "\n", phase


def rank_async_with_training_collectives(root: str) -> list[float]:
    """Async saves while the default group runs all-reduces; rank 1 fails twice."""
    rank = dist.get_rank()
    failed = Path(root) / "failed"

    def fail_on_rank_1(phase: str) -> None:
        if rank == 1 and phase in ("planned", "written") and not (failed / phase).exists():
            (failed / phase).touch()
            raise OSError(f"rank 1 fails when {phase}")

    g = torch.Generator().manual_seed(0)
    full = torch.randn(6, 4, generator=g)
    local = full[rank * 3 : rank * 3 + 3].clone()
    config = mc.CheckpointerConfig(keep_last=2)
    sums = []
    with mc.Checkpointer(root, config, on_phase=fail_on_rank_1) as ckpt:
        if rank == 0:
            failed.mkdir()
        dist.barrier()
        # A blocking save failing on rank 1 after planning: both ranks raise, nothing commits.
        expected = OSError if rank == 1 else mc.CheckpointError
        with pytest.raises(expected, match="rank 1 fails when planned"):
            ckpt.save(7, {"w": mc.Shard(local, (6, 4), (rank * 3, 0))}, blocking=True)
        assert ckpt.steps() == []
        for step in range(3):
            ckpt.save(step, {"w": mc.Shard(local, (6, 4), (rank * 3, 0))}, {"step": step})
            for _ in range(20):  # the training loop's own collectives, concurrent with the write
                x = torch.ones(1000)
                dist.all_reduce(x)
                sums.append(float(x[0]))
            if step == 0:
                with pytest.raises(mc.CheckpointError, match="step 0"):
                    ckpt.wait()
        ckpt.wait()
        assert ckpt.steps() == [1, 2] and ckpt.latest_step() == 2
        whole = torch.zeros(6, 4)
        manifest = ckpt.load({"w": whole})
    assert torch.equal(whole, full) and manifest.step == 2 and manifest.world_size == 2
    return sums


@pytest.mark.multiprocess
def test_async_saves_do_not_block_training_collectives(tmp_path: Path):
    sums = run_distributed(rank_async_with_training_collectives, 2, str(tmp_path), timeout=120)
    assert sums[0] == sums[1] == [2.0] * 60


def rank_failure_after_the_commit(root: str) -> list[float]:
    """Rank 0 fails to update ``latest``: every rank hears the checkpoint is committed."""
    rank = dist.get_rank()

    def fail_pointer(phase: str) -> None:
        if phase == "latest_updated":
            raise OSError("pointer write failed")

    with mc.Checkpointer(root, on_phase=fail_pointer) as ckpt:
        ckpt.save(4, {"w": mc.Shard(torch.full((2,), float(rank)), (4,), (2 * rank,))})
        committed = r"step_0000000004 is committed.*rank 0: OSError\('pointer write failed'\)"
        with pytest.raises(mc.PostCommitError, match=committed):
            ckpt.wait()
        whole = torch.zeros(4)
        assert ckpt.load({"w": whole}).step == 4
    return whole.tolist()


@pytest.mark.multiprocess
def test_failure_after_the_commit_is_reported_on_every_rank(tmp_path: Path):
    loaded = run_distributed(rank_failure_after_the_commit, 2, str(tmp_path), timeout=120)
    assert loaded == [[0.0, 0.0, 1.0, 1.0]] * 2


def test_a_second_writer_on_a_root_is_refused_naming_the_first(tmp_path: Path):
    with mc.Checkpointer(tmp_path) as ckpt:
        assert ckpt.stale_lock is None
        with pytest.raises(mc.DirectoryLockedError, match=f"in use by pid {os.getpid()} on host"):
            mc.Checkpointer(tmp_path)
    with mc.Checkpointer(tmp_path) as ckpt:  # released by close
        assert ckpt.stale_lock is None


def test_a_step_directory_without_its_manifest_is_set_aside(tmp_path: Path):
    config = mc.CheckpointerConfig(keep_last=None, async_save=False)
    with mc.Checkpointer(tmp_path, config) as ckpt:
        for step in (1, 2):
            ckpt.save(step, state(step))
    (tmp_path / directory.step_dir_name(2) / "manifest.json").unlink()
    with mc.Checkpointer(tmp_path, config) as ckpt:
        [(old, aside)] = ckpt.set_aside
        assert old.name == "step_0000000002" and aside.name.startswith("step_0000000002.uncommitted-")
        assert aside.is_dir() and ckpt.steps() == [1]
        ckpt.save(2, state(2))  # the resumed run saves the step again: no collision
        assert ckpt.steps() == [1, 2] and aside.is_dir()  # kept for a look


def test_an_edited_manifest_is_refused(tmp_path: Path):
    path = tmp_path / directory.step_dir_name(12)
    mc.save(path, state(12), step=12)
    text = (path / "manifest.json").read_text()
    (path / "manifest.json").write_text(text.replace('"step":12', '"step":13'))
    with pytest.raises(mc.CheckpointError, match="does not match its sha256"):
        mc.open_checkpoint(path)


def test_a_manifest_step_unlike_its_directory_or_a_key_outside_it_is_refused(tmp_path: Path):
    from moe_ckpt.manifest import read_manifest, write_manifest

    path = tmp_path / directory.step_dir_name(12)
    mc.save(path, state(12), step=12)
    good = read_manifest(path)
    write_manifest(path, dataclasses.replace(good, step=13))  # a consistent checksum
    with pytest.raises(mc.CheckpointError, match="step 13 disagrees with its directory step_0000000012"):
        mc.open_checkpoint(path)
    for key in ("/etc", "..", "a/../../b"):
        record = dataclasses.replace(good.tensors["a"], key=key)
        write_manifest(path, dataclasses.replace(good, tensors={**good.tensors, "a": record}))
        with pytest.raises(mc.CheckpointError, match="storage key .* is not a name inside"):
            mc.load(path, {"a": torch.empty(64, 16)})
