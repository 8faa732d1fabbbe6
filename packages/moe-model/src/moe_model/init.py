"""Layout-independent initialisation.

Each logical tensor is drawn from a generator seeded by (run seed, parameter
name), and routed-expert tensors expert by expert from (run seed, name, global
expert id). A rank holding experts 4..7 of layers 2..3 therefore gets exactly the
values the full model has under the same names, and runs on different DP/EP/PP
layouts start from identical weights. Values are drawn on the parameter's device
(CPU and CUDA generators differ, so compare layouts on one device type).

A tied LM head is seeded under its logical name ``embed.weight``, so a pipeline
stage holding only the head gets the embedding's values. Buffers are reset too
(the router's selection bias starts at zero), so a model built on the ``meta``
device, partitioned, and materialised with ``to_empty`` is fully defined here.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from moe_model.config import MoEConfig
from moe_model.experts import GroupedExperts
from moe_model.layers import RMSNorm
from moe_model.router import TopKRouter

_OUTPUT_PROJECTIONS = ("attn.wo.weight", "mlp.experts.w2", "w2.weight")


def name_seed(seed: int, *parts: object) -> int:
    """A 63-bit generator seed derived from the run seed and a parameter's identity."""
    key = ":".join(str(p) for p in (seed, *parts)).encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1


def _normal_(t: torch.Tensor, std: float, seed: int) -> None:
    g = torch.Generator(device=t.device)
    g.manual_seed(seed)
    with torch.no_grad():
        t.copy_(torch.randn(t.shape, generator=g, device=t.device, dtype=torch.float32) * std)


def param_std(name: str, cfg: MoEConfig) -> float:
    """Init std of a parameter: output projections are scaled down with depth (GPT-2 style)."""
    if name.endswith(_OUTPUT_PROJECTIONS):
        return cfg.init_std / math.sqrt(2 * cfg.n_layers)
    return cfg.init_std


@torch.no_grad()
def init_weights(model: nn.Module, cfg: MoEConfig, seed: int) -> None:
    """Initialise every parameter of ``model`` (a full model or any partition of it)."""
    tie = getattr(model, "tie_weights", None)
    if tie is not None:
        tie()
    done: set[str] = set()
    for mod_name, module in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        if isinstance(module, GroupedExperts):
            for pname, p in module.named_parameters(recurse=False):
                fqn = prefix + pname
                for local, global_e in enumerate(module.expert_range):
                    _normal_(p[local], param_std(fqn, cfg), name_seed(seed, fqn, global_e))
                done.add(fqn)
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
            done.add(prefix + "weight")
        elif isinstance(module, TopKRouter) and module.expert_bias is not None:
            module.expert_bias.zero_()
    for fqn, p in model.named_parameters():
        if fqn not in done:
            name = logical_name(fqn, cfg)
            _normal_(p, param_std(name, cfg), name_seed(seed, name))


def logical_name(fqn: str, cfg: MoEConfig) -> str:
    """The name a parameter is identified by across layouts (a tied head is the embedding)."""
    return "embed.weight" if cfg.tie_embeddings and fqn == "head.weight" else fqn
