"""MoEConfig validation: every bad value raises ValueError naming its field."""

import pytest
from moe_model import MoEConfig

BAD = [
    ("n_kv_heads", 3), ("top_k", 9), ("head_dim", 7), ("d_model", 0), ("vocab_size", -1),
    ("n_shared_experts", -1), ("shared_expert_hidden", 0), ("n_dense_layers", 5),
    ("dense_hidden", 0), ("router_score", "relu"), ("lb_loss_coef", -0.1),
    ("lb_loss_granularity", "sequence"), ("z_loss_coef", -1.0), ("bias_update_rate", -1e-3),
    ("capacity_factor", 0.0), ("rope_theta", 0.0), ("recompute", "full"),
    ("grouped_mm_backend", "cutlass"), ("attention_backend", "xformers"), ("n_experts", 2.5), ("qk_norm", 1), ("norm_topk_weights", "yes"),
]
# +inf passes the sign and range checks (only the finiteness check refuses it); nan fails
# those too, but the finiteness check is the one that names it
NON_FINITE = [(f, float("inf")) for f in ("rope_theta", "init_std", "lb_loss_coef", "capacity_factor",
                                           "norm_eps", "z_loss_coef", "bias_update_rate")]
NON_FINITE += [("norm_eps", float("nan")), ("z_loss_coef", float("-inf"))]


@pytest.mark.parametrize(("field", "value"), BAD)
def test_bad_value_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"MoEConfig.{field} "):
        MoEConfig(**{**dict(n_layers=4, n_experts=8, top_k=2), field: value})


@pytest.mark.parametrize(("field", "value"), NON_FINITE)
def test_non_finite_value_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"MoEConfig.{field} must be finite"):
        MoEConfig(**{**dict(n_layers=4, n_experts=8, top_k=2), field: value})


def test_resolved_widths():
    cfg = MoEConfig(n_experts=8, top_k=2, expert_hidden=64, n_shared_experts=2, n_dense_layers=1)
    assert cfg.shared_hidden_width == 2 * 64
    assert cfg.dense_hidden_width == 2 * 64 + 2 * 64  # active width of an MoE layer
    assert MoEConfig(shared_expert_hidden=32, n_shared_experts=3).shared_hidden_width == 96
    assert MoEConfig(dense_hidden=100, n_dense_layers=1).dense_hidden_width == 100
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, True, True]


def test_validate_catches_fields_set_after_construction():
    cfg = MoEConfig()
    cfg.capacity_factor = -2.0  # the app sets fields one by one, then validates
    with pytest.raises(ValueError, match="capacity_factor"):
        cfg.validate()
