"""The training loop (single process).

One optimizer step: for each microbatch, forward and backward of the token-loss
*sum* divided by the global batch's target-token count (so the gradient is the
same however the batch is split), then clip, step, and log.
"""

from __future__ import annotations

import math
import time
from datetime import datetime
from pathlib import Path

import tomli_w
import torch

from moe_model import (
    MoETransformer,
    flops_per_token,
    init_weights,
    lm_loss_sum,
    set_aux_loss_scale,
)
from pretrain.config import PretrainConfig, to_dict
from pretrain.data import TokenStream, load_stdlib_bytes
from pretrain.metrics import MetricsWriter, progress_line

H200_BF16_PEAK = 989e12


def resolve_device(cfg: PretrainConfig) -> torch.device:
    if cfg.train.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.train.device)


def resolve_dtype(cfg: PretrainConfig, device: torch.device) -> torch.dtype:
    if cfg.train.compute_dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.train.compute_dtype)


def make_run_dir(cfg: PretrainConfig) -> Path:
    if cfg.run_dir is None:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        cfg.run_dir = str(Path("runs") / stamp)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def lr_at(step: int, cfg: PretrainConfig) -> float:
    """Linear warmup then cosine decay to ``min_lr_ratio * lr`` (``step`` counts from 1)."""
    o, total = cfg.optim, cfg.train.steps
    if step <= o.warmup_steps:
        return o.lr * step / max(1, o.warmup_steps)
    progress = (step - o.warmup_steps) / max(1, total - o.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * cosine)


def train(cfg: PretrainConfig) -> list[dict]:
    device = resolve_device(cfg)
    dtype = resolve_dtype(cfg, device)
    run_dir = make_run_dir(cfg)
    (run_dir / "config.toml").write_text(tomli_w.dumps(to_dict(cfg)))

    torch.manual_seed(cfg.seed)
    model = MoETransformer(cfg.model).to(device)
    init_weights(model, cfg.model, cfg.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
        eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay,
    )
    stream = TokenStream(load_stdlib_bytes(), cfg.train.seq_len, cfg.seed)
    metrics = MetricsWriter(run_dir)
    t = cfg.train
    n_micro = t.global_batch // t.micro_batch
    tokens_per_step = t.global_batch * t.seq_len
    flops_per_step = flops_per_token(cfg.model, t.seq_len) * tokens_per_step
    print(f"run_dir {run_dir}  device {device}  dtype {str(dtype).removeprefix('torch.')}  "
          f"params {sum(p.numel() for p in model.parameters()):,}", flush=True)

    history = []
    for step in range(1, t.steps + 1):
        start = time.perf_counter()
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = stream.global_batch(step, t.global_batch).to(device)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        n_target_tokens = targets.numel()
        set_aux_loss_scale(model, 1.0 / n_target_tokens)
        loss_sum = torch.zeros((), device=device)
        for mb in range(n_micro):
            sl = slice(mb * t.micro_batch, (mb + 1) * t.micro_batch)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                logits = model(inputs[sl])
            loss = lm_loss_sum(logits, targets[sl]) / n_target_tokens
            loss.backward()
            loss_sum += loss.detach()
        clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        lb, imbalance = _moe_stats(model)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        record = {
            "step": step,
            "loss": loss_sum.item(),
            "lr": lr,
            "grad_norm": grad_norm.item(),
            "tokens_per_s": tokens_per_step / elapsed,
            "step_time_s": elapsed,
            "lb_loss": lb,
            "expert_imbalance": imbalance,
        }
        if device.type == "cuda":
            record["mfu"] = flops_per_step / elapsed / H200_BF16_PEAK
            record["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        metrics.write(record)
        print(progress_line(record, t.steps), flush=True)
        history.append(record)
    metrics.close()
    return history


def _moe_stats(model: MoETransformer) -> tuple[float, float]:
    """Mean load-balancing loss per layer and the worst layer's max/mean expert load."""
    lbs, imbalances = [], []
    for _, layer in model.moe_layers():
        stats = layer.pop_step_stats()
        if stats:
            counts = stats["tokens_per_expert"].float()
            lbs.append(stats["lb_loss_sum"])
            imbalances.append(counts.max() / counts.mean().clamp_min(1e-9))
    if not lbs:
        return 0.0, 1.0
    return torch.stack(lbs).mean().item(), torch.stack(imbalances).max().item()
