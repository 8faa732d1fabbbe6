"""Bucket planning: order, caps, owner-major regions, alignment."""

import pytest
from moe_ddp import ALIGN_NUMEL, ParamEntry, is_sharded, plan_buckets


def test_sharding_rule():
    assert is_sharded(4096, 4, 4096)
    assert not is_sharded(4095 * 4, 8, 4096)  # does not divide
    assert not is_sharded(4092, 4, 4096)  # too small
    assert not is_sharded(8192, 1, 4096)  # nothing to shard over


def test_reverse_order_cap_and_single_oversized_tensor():
    entries = [ParamEntry(100, "g", 2, "all_reduce") for _ in range(5)] + [
        ParamEntry(1000, "g", 2, "all_reduce")
    ]
    buckets = plan_buckets(entries, cap_numel=250)
    # Visited last-registered first; the oversized tensor gets a bucket of its own.
    assert [b.params for b in buckets] == [[5], [4, 3], [2, 1], [0]]
    assert buckets[1].offsets == [0, 112]  # 100 rounded up to the alignment
    assert all(off % ALIGN_NUMEL == 0 for b in buckets for off in b.offsets)
    assert all(b.numel % ALIGN_NUMEL == 0 for b in buckets)


def test_groups_never_share_a_bucket_and_order_follows_completion():
    # dense, expert, dense, expert, dense (registration order)
    entries = [
        ParamEntry(10, "dense", 4, "all_reduce"),
        ParamEntry(10, "expert", 2, "all_reduce"),
        ParamEntry(10, "dense", 4, "all_reduce"),
        ParamEntry(10, "expert", 2, "all_reduce"),
        ParamEntry(10, "dense", 4, "all_reduce"),
    ]
    buckets = plan_buckets(entries, cap_numel=10**6)
    assert [(b.group_key, b.params) for b in buckets] == [("expert", [3, 1]), ("dense", [4, 2, 0])]


def test_owner_major_regions():
    entries = [ParamEntry(64, "g", 4, "reduce_scatter"), ParamEntry(32, "g", 4, "reduce_scatter")]
    (bucket,) = plan_buckets(entries, cap_numel=10**6)
    assert bucket.params == [1, 0]
    assert bucket.offsets == [0, 16]  # shard of 32/4=8 elements, aligned to 16
    assert bucket.region_numel == 32  # 16 + 16 for the 64/4 shard
    assert bucket.numel == 4 * 32


def test_cap_counts_whole_owner_major_buffer():
    entries = [ParamEntry(64, "g", 4, "reduce_scatter") for _ in range(3)]
    buckets = plan_buckets(entries, cap_numel=128)
    assert [len(b.params) for b in buckets] == [2, 1]


def test_rejects_nonpositive_cap():
    with pytest.raises(ValueError, match="bucket cap"):
        plan_buckets([ParamEntry(1, "g", 1, "none")], 0)
