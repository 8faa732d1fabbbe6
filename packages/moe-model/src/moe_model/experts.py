"""Routed experts: SwiGLU weights stacked per expert, run as grouped GEMMs.

Shape legend: E local experts, D d_model, F expert hidden, R dispatched rows,
K/N a GEMM's reduction/output width.
Weights follow ``nn.Linear``'s [out, in] convention per expert:
``w1_EFD`` (gate), ``w3_EFD`` (up), ``w2_EDF`` (down).

The module may hold a contiguous range of the model's experts
(``expert_start``, ``n_local``): expert parallelism narrows it, and the
initialiser uses ``expert_start`` so every expert gets the same values whatever
range a rank holds.

Grouped GEMM backends (``grouped_mm(..., backend=)``), all reading device-side offsets:
- ``grouped_mm``: ``torch._grouped_mm`` (CUTLASS on sm_90+; needs 16-byte aligned strides).
- ``triton``: this package's Triton kernels (``moe_model.triton_grouped_mm``).
- ``loop``: one matmul per expert; the reference. It reads the offsets on the host
  (a synchronisation), so on a GPU ``auto`` falls back to it only without Triton.
- ``auto``: the fastest safe one for the device and dtype (see ``resolve_backend``).
"""

from __future__ import annotations

import torch
from torch import nn

from moe_model._triton_support import triton_available
from moe_model.layers import swiglu

BACKENDS = ("auto", "grouped_mm", "triton", "loop")


def grouped_mm_loop(x_RK: torch.Tensor, w_EKN: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Reference: one matmul per expert; rows past ``offsets[-1]`` come out zero."""
    ends = offsets.tolist()
    sizes = [end - start for start, end in zip([0, *ends[:-1]], ends, strict=True)]
    pieces = torch.split(x_RK, [*sizes, x_RK.shape[0] - ends[-1]])  # one backward copy, not one per expert
    parts = [piece @ w_KN for piece, w_KN in zip(pieces[:-1], w_EKN.unbind(0), strict=True)]
    parts.append(x_RK.new_zeros(pieces[-1].shape[0], w_EKN.shape[-1]))
    return torch.cat(parts)


def _fits_grouped_mm(x_RK: torch.Tensor, w_EKN: torch.Tensor) -> bool:
    """``torch._grouped_mm`` needs every row stride a multiple of 16 bytes, and on CUDA bf16 on sm_90+."""
    size = x_RK.element_size()
    aligned = (x_RK.shape[-1] * size) % 16 == 0 and (w_EKN.shape[-1] * size) % 16 == 0
    if x_RK.device.type == "cuda":
        return aligned and x_RK.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x_RK.device) >= (9, 0)
    return aligned


def resolve_backend(backend: str, x_RK: torch.Tensor, w_EKN: torch.Tensor) -> str:
    """The concrete backend ``auto`` stands for on these tensors.

    On a GPU: ``torch._grouped_mm`` where it applies (bf16 on sm_90+, 16-byte
    aligned widths): on H200 at the bench-1gpu MoE shapes it and the Triton kernels
    ran the layer's GEMMs (forward + backward) within 3% of each other, and it costs
    ~20 us of host time per call against Triton's ~100 us (tools/moe_model_notes.md).
    Elsewhere Triton (fp16, pre-Hopper GPUs, odd widths) if installed, else the loop.
    On a CPU: ``torch._grouped_mm`` where its stride rule holds, else the loop.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown grouped GEMM backend {backend!r}; expected one of {BACKENDS}")
    if backend != "auto":
        return backend
    if _fits_grouped_mm(x_RK, w_EKN):
        return "grouped_mm"
    if x_RK.device.type == "cuda" and triton_available():
        return "triton"
    return "loop"


def grouped_mm(
    x_RK: torch.Tensor, w_EKN: torch.Tensor, offsets: torch.Tensor, backend: str = "auto"
) -> torch.Tensor:
    """``out[r] = x[r] @ w[e(r)]`` with expert segments given by cumulative int32 ``offsets``.

    Differentiable in ``x`` and ``w``. Rows past ``offsets[-1]`` (padding) are
    unspecified in the output and in the gradient of ``x``; callers ignore them.
    """
    backend = resolve_backend(backend, x_RK, w_EKN)
    if backend == "grouped_mm":
        return torch._grouped_mm(x_RK, w_EKN, offs=offsets)
    if backend == "triton":
        from moe_model.triton_grouped_mm import triton_grouped_mm

        return triton_grouped_mm(x_RK, w_EKN, offsets)
    return grouped_mm_loop(x_RK, w_EKN, offsets)


class GroupedExperts(nn.Module):
    def __init__(self, n_experts: int, d_model: int, hidden: int, backend: str = "auto") -> None:
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"unknown grouped GEMM backend {backend!r}; expected one of {BACKENDS}")
        self.n_experts_total = n_experts
        self.expert_start = 0
        self.n_local = n_experts
        self.backend = backend
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        self.w2 = nn.Parameter(torch.empty(n_experts, d_model, hidden))

    @property
    def expert_range(self) -> range:
        return range(self.expert_start, self.expert_start + self.n_local)

    def narrow_(self, start: int, count: int) -> None:
        """Keep only experts ``[start, start+count)`` of those currently held."""
        if start < 0 or count <= 0 or start + count > self.n_local:
            raise ValueError(
                f"expert range [{start}, {start + count}) is outside the {self.n_local} held experts"
            )
        for name in ("w1", "w3", "w2"):
            old = getattr(self, name)
            setattr(self, name, nn.Parameter(old.detach()[start : start + count].clone()))
        self.expert_start += start
        self.n_local = count

    def forward(self, rows_RD: torch.Tensor, group_offsets: torch.Tensor) -> torch.Tensor:
        """SwiGLU of each row with its expert's weights; computed in ``rows_RD.dtype``."""
        dtype = rows_RD.dtype
        w1, w3, w2 = (w.to(dtype).transpose(-2, -1) for w in (self.w1, self.w3, self.w2))
        h_RF = swiglu(grouped_mm(rows_RD, w1, group_offsets, self.backend),
                      grouped_mm(rows_RD, w3, group_offsets, self.backend))
        return grouped_mm(h_RF, w2, group_offsets, self.backend)
