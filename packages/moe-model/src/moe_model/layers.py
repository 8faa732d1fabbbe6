"""Dense building blocks: RMSNorm, rotary embeddings, causal GQA attention, SwiGLU.

Shape legend: B batch, S sequence, D d_model, H query heads, K kv heads,
Dh head dim, F hidden width.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from moe_model._triton_support import Backend, use_fused
from moe_model.config import MoEConfig
from moe_model.document_attention import DocumentMask
from moe_model.kv_cache import LayerKV
from moe_model.linear import Linear, shared_input_linears


def _rms_norm_unfit(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    from moe_model import _rms_norm_kernels as k

    if x.dtype not in k.FLOAT_DTYPES or weight.dtype not in k.FLOAT_DTYPES:
        return f"x ({x.dtype}) and weight ({weight.dtype}) must be one of {k.FLOAT_DTYPES}"
    if weight.device != x.device:
        return f"weight is on {weight.device}, x on {x.device}"
    if not 0 < x.shape[-1] <= k.MAX_D:
        return f"the normalised width {x.shape[-1]} is outside 1..{k.MAX_D}"
    return None


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` over the last dimension, in
    eager PyTorch: normalised in FP32 whatever the compute dtype, as the HF reference does."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: Backend = "auto") -> torch.Tensor:
    """``rms_norm_reference``'s result, through the fused kernels of
    ``moe_model._rms_norm_kernels`` (same rounding; float rows up to ``MAX_D`` wide) where
    ``backend`` picks them (``_triton_support.use_fused``)."""
    if use_fused("rms_norm", backend, x.device, lambda: _rms_norm_unfit(x, weight)):
        from moe_model import _rms_norm_kernels as k

        return k.rms_norm(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def add_rms_norm_reference(x: torch.Tensor, branch: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, rms_norm_reference(h))`` for ``h = x + branch``."""
    h = x + branch
    return h, rms_norm_reference(h, weight, eps)


def add_rms_norm(x: torch.Tensor, branch: torch.Tensor, weight: torch.Tensor, eps: float,
                 backend: Backend = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, rms_norm(h))`` for ``h = x + branch``: a residual connection and the norm that
    reads it. The fused path is one kernel each way (the add inside the norm's forward, and
    h's two gradients summed inside the norm's backward: two passes over ``[T, D]`` and two
    launches fewer per call), with the same roundings as apart; where ``x`` and ``branch``
    differ in shape, dtype or device the add runs apart and ``rms_norm`` decides alone."""

    def unfit() -> str | None:
        if (branch.shape, branch.dtype, branch.device) != (x.shape, x.dtype, x.device):
            return f"branch {tuple(branch.shape)} {branch.dtype} differs from x {tuple(x.shape)} {x.dtype}"
        return _rms_norm_unfit(x, weight)

    if use_fused("add_rms_norm", backend, x.device, unfit):
        from moe_model import _rms_norm_kernels as k

        return k.add_rms_norm(x, branch, weight, eps)
    h = x + branch
    return h, rms_norm(h, weight, eps, backend)


class RMSNorm(nn.Module):
    """``rms_norm`` with a learned weight (ones at init) over the last dimension."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, branch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h, self(h))`` for ``h = x + branch`` (``add_rms_norm``)."""
        return add_rms_norm(x, branch, self.weight, self.eps)


@functools.lru_cache(maxsize=16)
def rope_tables(
    seq_len: int, head_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [S, Dh] in FP32 for the rotate-half RoPE convention.

    Built once per shape and device and shared by every layer and call (read-only):
    building them is nine small launches, which every layer paid on every forward.
    Never inference tensors, so a first call under ``torch.inference_mode`` cannot
    keep a later training step from saving them for the backward.
    """
    with torch.inference_mode(False), torch.no_grad():
        steps = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)
        inv_freq = 1.0 / (theta ** (steps / head_dim))
        pos = torch.arange(seq_len, device=device, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def apply_rope_reference(x_BHSDh: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in FP32, rounded once to x's dtype, in eager PyTorch."""
    half = x_BHSDh.shape[-1] // 2
    x1, x2 = x_BHSDh[..., :half], x_BHSDh[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x_BHSDh.float() * cos + rotated.float() * sin).to(x_BHSDh.dtype)


def apply_rope(x_BHSDh: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               backend: Backend = "auto") -> torch.Tensor:
    """``apply_rope_reference``'s result; the fused path (an even head dim) is the one
    kernel each way of ``moe_model._rope_kernels`` (same arithmetic)."""

    def unfit() -> str | None:
        return None if x_BHSDh.shape[-1] % 2 == 0 else f"head dim {x_BHSDh.shape[-1]} is odd"

    if use_fused("apply_rope", backend, x_BHSDh.device, unfit):
        from moe_model._rope_kernels import FusedRope

        return FusedRope.apply(x_BHSDh, cos, sin)
    return apply_rope_reference(x_BHSDh, cos, sin)


def qk_norm_rope_reference(x_BSHDh: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                           sin: torch.Tensor) -> torch.Tensor:
    """RMSNorm of each head vector of ``[B, S, H, Dh]`` then RoPE, returned as ``[B, H, S, Dh]``
    (a transposed view of ``[B, S, H, Dh]`` memory), in eager PyTorch."""
    return apply_rope_reference(rms_norm_reference(x_BSHDh, weight, eps).transpose(1, 2), cos, sin)


def qk_norm_rope(x_BSHDh: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                 sin: torch.Tensor, backend: Backend = "auto") -> torch.Tensor:
    """``qk_norm_rope_reference``'s result. The fused path is one kernel each way
    (``moe_model._qk_norm_rope_kernels``: the two kernels' arithmetic, each head vector read
    and written once; 215 us of the two apart per attention block and microbatch at
    bench-1gpu's shapes on an H200); where it does not apply, ``rms_norm`` then ``apply_rope``
    (each deciding for itself)."""

    def unfit() -> str | None:
        from moe_model import _qk_norm_rope_kernels as k

        if k.applies(x_BSHDh, weight):
            return None
        return f"x {tuple(x_BSHDh.shape)} {x_BSHDh.dtype} with weight {weight.dtype} does not suit the kernel"

    if use_fused("qk_norm_rope", backend, x_BSHDh.device, unfit):
        from moe_model import _qk_norm_rope_kernels as k

        return k.QKNormRope.apply(x_BSHDh, weight, eps, cos, sin).transpose(1, 2)
    return apply_rope(rms_norm(x_BSHDh, weight, eps, backend).transpose(1, 2), cos, sin, backend)


def norm_and_rope(x_BSHDh: torch.Tensor, norm: RMSNorm | None, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """QK-norm (when ``norm`` is given, ``qk_norm_rope``) and RoPE of query or key heads
    ``[B, S, H, Dh]``, returned as ``[B, H, S, Dh]``."""
    if norm is not None:
        return qk_norm_rope(x_BSHDh, norm.weight, norm.eps, cos, sin)
    return apply_rope(x_BSHDh.transpose(1, 2), cos, sin)


# Every SDPA backend; the chosen one moves to the front. The priority list names all of
# them, so an input the first one cannot take falls through instead of failing.
_SDPA_BACKENDS = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                  SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
_SDPA_FIRST = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


@functools.cache
def sdpa_priority(backend: str, device: torch.device) -> tuple[SDPBackend, ...] | None:
    """The SDPA backends to try on ``device``, first choice first; ``None``: PyTorch's order.

    ``auto`` leaves the choice to PyTorch, which costs no host time per call: torch
    2.11 picks cuDNN on an H200 at the bench shape (causal, 4096 tokens, 16 query / 4
    KV heads of 128), where the attention block's forward and backward take 2.01 ms
    against flash attention's 2.85 ms at the same error against an FP32 reference
    (``tools/bench_attention.py``; both keep the same tensors for the backward).
    ``cudnn`` or ``flash`` pin one first, should a PyTorch release order them otherwise.
    """
    if device.type != "cuda" or backend == "auto":
        return None
    first = _SDPA_FIRST[backend]
    return (first, *(b for b in _SDPA_BACKENDS if b != first))


class Attention(nn.Module):
    """Causal grouped-query attention through ``scaled_dot_product_attention``.

    ``cfg.attention_backend`` can pin the kernel PyTorch tries first (``sdpa_priority``).
    """

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self.backend = cfg.attention_backend
        self.wq = Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x_BSD: torch.Tensor, documents: DocumentMask | None = None,
                cache: LayerKV | None = None, start: int = 0) -> torch.Tensor:
        """``documents``: attend within documents only (training on packed windows).
        ``cache``: decoding; ``x`` holds positions ``[start, start + S)``, whose keys and
        values join the cache's (see ``moe_model.kv_cache``)."""
        B, S, _ = x_BSD.shape
        q, k, v = shared_input_linears(x_BSD, (self.wq, self.wk, self.wv))
        q = q.view(B, S, self.n_heads, self.head_dim)
        k = k.view(B, S, self.n_kv_heads, self.head_dim)
        v = v.view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        # a cache's tables span its capacity: one shape for every decoding step
        table = S if cache is None else cache.keys.shape[2]
        cos, sin = rope_tables(table, self.head_dim, self.rope_theta, x_BSD.device)
        if table != S or start:
            cos, sin = cos[start:start + S], sin[start:start + S]
        q, k = norm_and_rope(q, self.q_norm, cos, sin), norm_and_rope(k, self.k_norm, cos, sin)
        if documents is not None:
            out = documents.attend(q, k, v)
        elif cache is not None:
            out = self._attend_cached(q, *cache.append(start, k, v), start)
        else:
            out = self._sdpa(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(B, S, self.n_heads * self.head_dim))

    def _attend_cached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        """New queries at ``[start, start + S)`` over keys ``[0, start + S)``: causal with the
        diagonal shifted by ``start`` (SDPA's ``is_causal`` aligns it to the top left)."""
        S = q.shape[2]
        if S == 1:
            return self._sdpa(q, k, v)
        if start == 0:
            return self._sdpa(q, k, v, is_causal=True)
        positions = torch.arange(start + S, device=q.device)
        mask = positions[None, :] <= positions[start:, None]
        return self._sdpa(q, k, v, attn_mask=mask)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **mask: object) -> torch.Tensor:
        priority = sdpa_priority(self.backend, q.device)
        with nullcontext() if priority is None else sdpa_kernel(list(priority), set_priority=True):
            return F.scaled_dot_product_attention(
                q, k, v, enable_gqa=self.n_kv_heads != self.n_heads, **mask)


def swiglu_reference(g: torch.Tensor, u: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(g) * u`` in eager PyTorch (two roundings to the inputs' dtype); computes
    every row, ``rows`` or not."""
    return F.silu(g) * u


def swiglu(g: torch.Tensor, u: torch.Tensor, rows: torch.Tensor | None = None,
           backend: Backend = "auto") -> torch.Tensor:
    """SwiGLU's gating ``silu(g) * u``.

    The fused path (``g`` and ``u`` of one shape and dtype) is one kernel each way of
    ``moe_model._swiglu_kernels`` (FP32 inside, one rounding, g and u kept for the
    backward instead of three tensors). ``rows`` (a one-element integer device tensor,
    optional): rows of ``g`` at or past it are padding, which the kernel path skips (their
    output and gradient are unspecified); the reference computes them anyway.
    """

    def unfit() -> str | None:
        if g.shape == u.shape and g.dtype == u.dtype:
            return None
        return f"g {tuple(g.shape)} {g.dtype} and u {tuple(u.shape)} {u.dtype} differ"

    if use_fused("swiglu", backend, g.device, unfit):
        from moe_model._swiglu_kernels import FusedSwiGLU

        return FusedSwiGLU.apply(g, u, rows)
    return swiglu_reference(g, u, rows)


class SwiGLU(nn.Module):
    """A dense SwiGLU MLP (used for dense layers and shared experts)."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w1 = Linear(d_model, hidden, bias=False)  # gate
        self.w3 = Linear(d_model, hidden, bias=False)  # up
        self.w2 = Linear(hidden, d_model, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(*shared_input_linears(x, (self.w1, self.w3))))
