"""Configuration and layout errors name what is wrong; rules compose."""

import pytest
import torch
from moe_optim import DistributedOptimizer, OptimConfig, ParamRule, Placement
from moe_optim.config import resolve_rule
from torch import nn


def _source(**shapes):
    params = {n: nn.Parameter(torch.randn(s)) for n, s in shapes.items()}
    return [(n, p, torch.zeros(p.shape), None) for n, p in params.items()]


def test_rules_compose_in_order():
    cfg = OptimConfig()
    rules = [ParamRule(lambda n, p: p.ndim >= 2, algorithm="muon"),
             ParamRule(lambda n, p: "experts" in n, lr_scale=0.25),
             ParamRule(lambda n, p: "norm" in n or "embed" in n, weight_decay=0.0)]
    expert = resolve_rule("experts.w1", nn.Parameter(torch.zeros(2, 3, 4)), rules, cfg)
    assert (expert.algorithm, expert.lr_scale, expert.weight_decay) == ("muon", 0.25, cfg.muon.weight_decay)
    norm = resolve_rule("norm.weight", nn.Parameter(torch.zeros(4)), rules, cfg)
    assert (norm.algorithm, norm.lr_scale, norm.weight_decay) == ("adamw", 1.0, 0.0)


def test_muon_on_a_vector_is_refused():
    with pytest.raises(ValueError, match="'bias'.*Muon needs a matrix"):
        DistributedOptimizer(_source(bias=(4,)), norm_group=None,
                             rules=[ParamRule(lambda n, p: True, algorithm="muon")])


def test_bad_placement_is_refused():
    with pytest.raises(ValueError, match="placement of 'w'"):
        DistributedOptimizer(_source(w=(2, 3)), norm_group=None,
                             placement_of=lambda n, p: Placement((4, 5), 0))
    with pytest.raises(ValueError, match="placement of 'w'"):
        DistributedOptimizer(_source(w=(2, 3)), norm_group=None,
                             placement_of=lambda n, p: Placement((4, 3), 3))


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="OptimConfig.max_grad_norm"):
        DistributedOptimizer(_source(w=(2, 3)), OptimConfig(max_grad_norm=0.0), norm_group=None)
    cfg = OptimConfig()
    cfg.muon.ns_dtype = "bf16"
    with pytest.raises(ValueError, match="MuonConfig.ns_dtype"):
        DistributedOptimizer(_source(w=(2, 3)), cfg, norm_group=None)


def test_gradient_source_mismatch_is_reported():
    source = _source(w=(2, 3), v=(4,))
    opt = DistributedOptimizer(source, norm_group=None)
    source.pop()
    with pytest.raises(ValueError, match="yielded 1 items, expected 2"):
        opt.step()
    source.append(("v", source[0][1], torch.zeros(4), None))
    with pytest.raises(ValueError, match="item 1 .'v'. is another parameter object"):
        opt.step()


def test_rank_without_parameters_needs_a_device():
    with pytest.raises(ValueError, match="device="):
        DistributedOptimizer([], norm_group=None)
    opt = DistributedOptimizer([], norm_group=None, device=torch.device("cpu"))
    stats = opt.step()
    assert float(stats.grad_norm) == 0.0 and not bool(stats.skipped)


def test_hooks_run_after_rebuild_and_can_be_removed():
    source = _source(w=(2, 3))
    opt = DistributedOptimizer(source, norm_group=None)
    param, seen = source[0][1], []
    handle = opt.register_weights_updated_hook(lambda: seen.append(param.detach().clone()))
    source[0][2].fill_(1.0)
    opt.step()
    assert len(seen) == 1
    assert torch.equal(seen[0], opt.sharded_state()["main/w"].local.view(2, 3))  # already rebuilt
    handle.remove()
    opt.step()
    assert len(seen) == 1 and not torch.equal(seen[0], param.detach())
