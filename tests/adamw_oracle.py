"""The single-process training oracle the root tests compare the app's training against.

One process, the whole global batch, plain ``torch.optim.AdamW``: the app's model
(``moe_model``), data (``pretrain.data``), loss normalisation, clipping, LR schedule
and router bias step, with the optimizer policy stated here literally (not taken from
the app's ``param_rules``), as ``apps/pretrain/README.md`` documents it:

- no weight decay on vectors (norm gains, biases) and on the token embedding;
  ``optim.weight_decay`` on every other matrix;
- routed experts' weights (``*.experts.w1/w2/w3``) at ``optim.lr * optim.expert_lr_mult``,
  everything else at ``optim.lr``; both times the schedule's factor of the step.

Not a test module (no ``test_`` prefix): load it with ``moe_testing.load_script``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from moe_model import ModelWiring, MoETransformer, init_weights, lm_loss_sum, wire_model
from pretrain.config import PretrainConfig, load_config
from pretrain.data import BatchReader, open_source
from pretrain.schedule import build_schedule
from torch import nn

ROUTED_EXPERT_SUFFIXES = (".experts.w1", ".experts.w2", ".experts.w3")


def literal_param_groups(model: nn.Module, cfg: PretrainConfig) -> list[dict[str, Any]]:
    """AdamW groups by the documented policy, one per (LR scale, weight decay)."""
    o = cfg.optim
    groups: dict[tuple[float, float], list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        no_decay = p.ndim < 2 or name == "embed.weight"
        lr_scale = o.expert_lr_mult if name.endswith(ROUTED_EXPERT_SUFFIXES) else 1.0
        groups.setdefault((lr_scale, 0.0 if no_decay else o.weight_decay), []).append(p)
    return [{"params": ps, "lr_scale": scale, "weight_decay": decay}
            for (scale, decay), ps in groups.items()]


def single_process_steps(preset: str, overrides: list[str]) -> dict:
    """Train ``cfg.train.steps`` steps; losses per step, final weights and router biases."""
    cfg = load_config(preset, overrides)
    t, o = cfg.train, cfg.optim
    assert o.name == "adamw", "the oracle is AdamW only"
    model = MoETransformer(cfg.model)
    init_weights(model, cfg.model, cfg.seed)
    optimizer = torch.optim.AdamW(literal_param_groups(model, cfg), lr=o.lr,
                                  betas=(o.beta1, o.beta2), eps=o.eps, fused=True)
    data = BatchReader(open_source(cfg.data.path, t.seq_len, cfg.model.vocab_size, cfg.seed),
                       cfg.seed, t.global_batch, t.micro_batch)
    schedule = build_schedule(o, t.steps)
    n_tokens = t.global_batch * t.seq_len
    wire_model(model, ModelWiring(aux_loss_scale=1 / n_tokens))
    losses, lrs = [], []
    for step in range(1, t.steps + 1):
        total = 0.0
        for index in range(data.n_microbatches):
            tokens = data.microbatch(step, index)
            loss = lm_loss_sum(model(tokens[:, :-1]), tokens[:, 1:]) / n_tokens
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip or math.inf)
        for group in optimizer.param_groups:
            group["lr"] = o.lr * schedule(step) * group["lr_scale"]
        lrs.append(o.lr * schedule(step))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for _, layer in model.moe_layers():
            layer.update_bias(layer.pop_step_stats()["tokens_per_expert"])
        losses.append(total)
    return {"losses": losses, "lrs": lrs,
            "weights": {n: p.detach() for n, p in model.named_parameters()},
            "biases": [layer.router.expert_bias for _, layer in model.moe_layers()]}
