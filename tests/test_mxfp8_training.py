"""A small MoE model trained 200 steps with MXFP8 experts tracks the unquantized run.

The baseline is FP32, not BF16: this runs on CPU, where the trainer computes in FP32
(BF16 GEMMs on CPU are slow and BF16 rounding is far below MXFP8's, so FP32 is the
stricter reference). The MXFP8 run quantizes the expert GEMM operands (forward and
input-gradient) exactly as on a GPU; its weight caches are refreshed after every
optimizer step by the hook a training loop registers. Same seed, same data.
"""

import torch
from moe_model import MoEConfig, MoETransformer, init_weights, lm_loss_sum, set_aux_loss_scale
from moe_mxfp8 import MXFP8Config, MXFP8GroupedExperts, apply_mxfp8, refresh_weight_caches

CFG = dict(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
           n_experts=4, top_k=2, expert_hidden=64,
           grouped_mm_backend="loop")  # CPU: the per-expert loop is far faster than _grouped_mm
STEPS, BATCH, SEQ = 200, 8, 32


def markov_batches(seed: int) -> torch.Tensor:
    """[STEPS, BATCH, SEQ+1] tokens from a fixed sparse Markov chain (learnable, not trivial)."""
    g = torch.Generator().manual_seed(seed)
    V = CFG["vocab_size"]
    successors = torch.randint(0, V, (V, 3), generator=g)
    tokens = torch.empty(STEPS * BATCH, SEQ + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, V, (STEPS * BATCH,), generator=g)
    for t in range(SEQ):
        pick = torch.randint(0, 3, (STEPS * BATCH,), generator=g)
        tokens[:, t + 1] = successors[tokens[:, t], pick]
    return tokens.view(STEPS, BATCH, SEQ + 1)


def train(mxfp8: bool, data: torch.Tensor) -> list[float]:
    torch.manual_seed(0)
    cfg = MoEConfig(**CFG)
    model = MoETransformer(cfg)
    init_weights(model, cfg, seed=0)
    if mxfp8:
        assert len(apply_mxfp8(model, MXFP8Config(targets=("experts",)))) == cfg.n_layers
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    if mxfp8:
        opt.register_step_post_hook(lambda *_: refresh_weight_caches(model))
    losses = []
    for step in range(STEPS):
        inputs, targets = data[step, :, :-1], data[step, :, 1:]
        set_aux_loss_scale(model, 1.0 / targets.numel())
        loss = lm_loss_sum(model(inputs), targets) / targets.numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    if mxfp8:
        assert sum(isinstance(m, MXFP8GroupedExperts) for m in model.modules()) == cfg.n_layers
    return losses


def test_mxfp8_experts_train_within_2_percent_of_fp32():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: more threads only add contention
    try:
        data = markov_batches(seed=1)
        base = train(False, data)
        mx = train(True, data)
    finally:
        torch.set_num_threads(threads)
    assert base[-1] < 0.6 * base[0], "the baseline did not learn; the comparison would be empty"
    final_base = sum(base[-10:]) / 10  # mean over the last 10 batches (same batches in both runs)
    final_mx = sum(mx[-10:]) / 10
    assert abs(final_mx - final_base) <= 0.02 * final_base, (final_base, final_mx)
    assert abs(mx[-1] - base[-1]) <= 0.02 * base[-1], (base[-1], mx[-1])
