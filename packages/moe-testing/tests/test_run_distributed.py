"""The multi-process runner: real collectives, exact results, failures and hangs."""

import time

import pytest
import torch
import torch.distributed as dist
from moe_testing import DistributedTestError, run_distributed


def _all_reduce_rank_values(n: int) -> list[float]:
    rank = dist.get_rank()
    t = torch.arange(n, dtype=torch.float64) * (rank + 1) + rank
    dist.all_reduce(t)
    return t.tolist()


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce_of_rank_dependent_tensors(world_size):
    results = run_distributed(_all_reduce_rank_values, world_size, 5, timeout=60)
    # sum over r of (i*(r+1) + r) = i * W(W+1)/2 + W(W-1)/2
    w = world_size
    expected = [i * w * (w + 1) / 2 + w * (w - 1) / 2 for i in range(5)]
    assert results == [expected] * world_size


def _raise_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank one refuses")
    dist.barrier()


@pytest.mark.multiprocess
def test_exception_carries_failing_rank_traceback():
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_raise_on_rank_one, 2, timeout=60)
    message = str(info.value)
    assert "rank 1 of 2 failed" in message
    assert "ValueError: rank one refuses" in message
    assert "_raise_on_rank_one" in message
    assert time.monotonic() - start < 30


def _rank_zero_hangs() -> None:
    if dist.get_rank() == 0:
        time.sleep(3600)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_hung_rank_fails_within_timeout():
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"ranks \[0\] of 2 did not finish within 8 s"):
        run_distributed(_rank_zero_hangs, 2, timeout=8)
    assert time.monotonic() - start < 25


def _exit_hard() -> None:
    import os

    if dist.get_rank() == 1:
        os._exit(3)
    time.sleep(3600)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_dead_rank_is_reported():
    with pytest.raises(DistributedTestError, match="rank 1 died with exit code 3"):
        run_distributed(_exit_hard, 2, timeout=60)


def _return_tensors() -> dict:
    rank = dist.get_rank()
    return {"rank": rank, "t": torch.full((3,), float(rank)), "bf16": torch.ones(2, dtype=torch.bfloat16)}


@pytest.mark.multiprocess
def test_ranks_can_return_tensors():
    out = run_distributed(_return_tensors, 2, timeout=60)
    for r, value in enumerate(out):
        assert value["rank"] == r
        assert torch.equal(value["t"], torch.full((3,), float(r)))
        assert value["bf16"].dtype == torch.bfloat16


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_port_taken_before_rank_zero_binds_it_is_replaced(monkeypatch):
    """free_port's answer can be taken by another process before rank 0 listens on it
    (seen on a busy GPU machine): the run starts again on a fresh port."""
    import socket

    from moe_testing import distributed

    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    fresh = distributed.free_port
    monkeypatch.setattr(distributed, "free_port", lambda: next(ports, None) or fresh())
    try:
        results = run_distributed(_all_reduce_rank_values, 2, 3, timeout=60)
    finally:
        taken.close()
    assert results == [[1.0, 4.0, 7.0]] * 2
