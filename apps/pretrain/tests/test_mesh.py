"""Mesh group memberships on 4 CPU ranks: DP2 x PP2 and EP2 x DP2."""

import pytest
import torch
import torch.distributed as dist
from moe_testing import run_distributed
from pretrain.config import load_config, validate_layout
from pretrain.mesh import build_mesh


def _memberships(overrides: list[str]) -> dict:
    cfg = load_config("tiny", overrides)
    mesh = build_mesh(validate_layout(cfg, dist.get_world_size()), "cpu")
    groups = {name: getattr(mesh, f"{name}_group")
              for name in ("pp", "dp", "ep_mp", "ep_dp")}
    out = {name: dist.get_process_group_ranks(g) for name, g in groups.items()}
    # The groups must carry traffic, not only exist: sum the global ranks in each.
    for name, g in groups.items():
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t, group=g)
        out[f"{name}_sum"] = t.item()
    out["logging"] = mesh.is_logging_rank
    out["coords"] = (mesh.pp_rank, mesh.dp_rank, mesh.ep_mp_rank, mesh.ep_dp_rank)
    out["experts"] = list(mesh.expert_range(cfg.model.n_experts))
    return out


def _both_layouts() -> tuple[dict, dict]:
    return (_memberships(["parallel.pp=2"]),
            _memberships(["parallel.ep=2", "train.global_batch=8"]))


@pytest.mark.multiprocess
def test_dp2_pp2_and_ep2_dp2_group_memberships():
    results = run_distributed(_both_layouts, 4, timeout=90)
    dp2pp2 = [r[0] for r in results]
    ep2dp2 = [r[1] for r in results]

    # DP2 x PP2: rank = pp_rank * 2 + dp_rank.
    assert [r["pp"] for r in dp2pp2] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["dp"] for r in dp2pp2] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["ep_mp"] for r in dp2pp2] == [[0], [1], [2], [3]]
    assert [r["ep_dp"] for r in dp2pp2] == [r["dp"] for r in dp2pp2]  # ep=1: experts replicate over DP
    assert [r["logging"] for r in dp2pp2] == [False, False, True, False]  # last stage, DP rank 0
    assert [r["coords"][:2] for r in dp2pp2] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["experts"] == [0, 1, 2, 3] for r in dp2pp2)

    # EP2 x DP2 (pp=1, dp=4 = ep 2 x ep_dp 2): EP-MP innermost.
    assert [r["pp"] for r in ep2dp2] == [[0], [1], [2], [3]]
    assert all(r["dp"] == [0, 1, 2, 3] for r in ep2dp2)
    assert [r["ep_mp"] for r in ep2dp2] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["ep_dp"] for r in ep2dp2] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["logging"] for r in ep2dp2] == [True, False, False, False]
    assert [r["experts"] for r in ep2dp2] == [[0, 1], [2, 3], [0, 1], [2, 3]]

    for r in dp2pp2 + ep2dp2:
        for name in ("pp", "dp", "ep_mp", "ep_dp"):
            assert r[f"{name}_sum"] == sum(r[name])
