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

from moe_model._triton_support import fused_kernels_enabled
from moe_model.config import MoEConfig
from moe_model.document_attention import DocumentMask
from moe_model.kv_cache import LayerKV
from moe_model.linear import Linear, shared_input_linears


class RMSNorm(nn.Module):
    """``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` over the last dimension.

    CUDA inputs go through the fused Triton kernels of ``moe_model._rms_norm_kernels``
    (same rounding, imported at first use); anything else, or where Triton does not
    import, through ``forward_reference``.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused_kernels_take(x):
            from moe_model import _rms_norm_kernels as k

            return k.rms_norm(x, self.weight, self.eps)
        return self.forward_reference(x)

    def add_and_norm(self, x: torch.Tensor, branch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h, self(h))`` for ``h = x + branch``: a residual connection and the norm
        that reads it. On CUDA one kernel each way (the add inside the norm's forward, and
        h's two gradients summed inside the norm's backward: two passes over ``[T, D]``
        and two launches fewer per call), with the same roundings as apart."""
        if (branch.shape, branch.dtype, branch.device) == (x.shape, x.dtype, x.device) and self._fused_kernels_take(x):
            from moe_model import _rms_norm_kernels as k

            return k.add_rms_norm(x, branch, self.weight, self.eps)
        h = x + branch
        return h, self(h)

    def _fused_kernels_take(self, x: torch.Tensor) -> bool:
        if not fused_kernels_enabled(x.device):
            return False
        from moe_model import _rms_norm_kernels as k

        w = self.weight
        return (x.dtype in k.FLOAT_DTYPES and w.dtype in k.FLOAT_DTYPES and w.device == x.device
                and 0 < x.shape[-1] <= k.MAX_D)

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in FP32 whatever the compute dtype, as the HF reference does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


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


def apply_rope(x_BHSDh: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in FP32, rounded once to x's dtype.

    CUDA inputs take the one-kernel path of ``moe_model._rope_kernels`` (same
    arithmetic); anything else, or without Triton, ``apply_rope_reference``.
    """
    if x_BHSDh.shape[-1] % 2 == 0 and fused_kernels_enabled(x_BHSDh.device):
        from moe_model._rope_kernels import FusedRope

        return FusedRope.apply(x_BHSDh, cos, sin)
    return apply_rope_reference(x_BHSDh, cos, sin)


def norm_and_rope(x_BSHDh: torch.Tensor, norm: RMSNorm | None, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """QK-norm (when ``norm`` is given) and RoPE of query or key heads ``[B, S, H, Dh]``,
    returned as ``[B, H, S, Dh]`` (a transposed view of ``[B, S, H, Dh]`` memory).

    CUDA inputs with a norm take one kernel each way (``moe_model._qk_norm_rope_kernels``:
    the two kernels' arithmetic, each head vector read and written once; 215 us of the
    two apart per attention block and microbatch at bench-1gpu's shapes on an H200);
    anything else runs ``norm`` then ``apply_rope``.
    """
    if norm is not None and fused_kernels_enabled(x_BSHDh.device):
        from moe_model import _qk_norm_rope_kernels as k

        if k.applies(x_BSHDh, norm.weight):
            return k.QKNormRope.apply(x_BSHDh, norm.weight, norm.eps, cos, sin).transpose(1, 2)
    if norm is not None:
        x_BSHDh = norm(x_BSHDh)
    return apply_rope(x_BSHDh.transpose(1, 2), cos, sin)


def apply_rope_reference(x_BHSDh: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x_BHSDh.shape[-1] // 2
    x1, x2 = x_BHSDh[..., :half], x_BHSDh[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x_BHSDh.float() * cos + rotated.float() * sin).to(x_BHSDh.dtype)


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


def swiglu_reference(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u`` in eager PyTorch (two roundings to the inputs' dtype)."""
    return F.silu(g) * u


def swiglu(g: torch.Tensor, u: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU's gating ``silu(g) * u``.

    CUDA inputs of one shape and dtype take the one-kernel-each-way path of
    ``moe_model._swiglu_kernels`` (FP32 inside, one rounding, g and u kept for the
    backward instead of three tensors); anything else, or without Triton,
    ``swiglu_reference``. ``rows`` (a one-element integer device tensor, optional):
    rows of ``g`` at or past it are padding, which the kernel path skips (their output
    and gradient are unspecified); the reference computes them anyway.
    """
    if g.shape == u.shape and g.dtype == u.dtype and fused_kernels_enabled(g.device):
        from moe_model._swiglu_kernels import FusedSwiGLU

        return FusedSwiGLU.apply(g, u, rows)
    return swiglu_reference(g, u)


class SwiGLU(nn.Module):
    """A dense SwiGLU MLP (used for dense layers and shared experts)."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w1 = Linear(d_model, hidden, bias=False)  # gate
        self.w3 = Linear(d_model, hidden, bias=False)  # up
        self.w2 = Linear(hidden, d_model, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(*shared_input_linears(x, (self.w1, self.w3))))
