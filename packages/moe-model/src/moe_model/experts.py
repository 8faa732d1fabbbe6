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
- ``triton``: this package's Triton kernels (``moe_model._grouped_mm_launch``).
- ``loop``: one matmul per expert, ``grouped_mm_reference``. It reads the offsets on the host
  (a synchronisation), so on a GPU ``auto`` falls back to it only without Triton.
- ``auto``: the fastest safe one for the device and dtype (see ``resolve_backend``).

Gate and up projections (``auto``/``triton`` on CUDA): one paired Triton GEMM writes
both, and their input gradient is one GEMM over the joint reduction
``dg @ w1 + du @ w3`` instead of two GEMMs with a short reduction and an add of two
``[R, D]`` results (``_GateUp``); other backends run them as two grouped GEMMs.

Weight gradients into a sink: a data-parallel wrapper that keeps FP32 main grads may
be installed as the module's ``grad_sink`` (a ``GradientSink``, e.g. through
``moe_model.wire_model``). On CUDA with Triton the weight-gradient GEMMs then
add their result to the main grad in the kernel's epilogue (FP32, no rounding to the
compute dtype) instead of returning a BF16 gradient for the wrapper's hook to add:
that accumulation pass re-read and re-wrote every expert weight's gradient once per
microbatch at copy speed. The sink is told when the gradient is in; ``param.grad``
stays ``None``. What the sink gets is an ``ExpertWeightGradient``: it may hold it and
merge it with the next microbatch's (one launch over both microbatches' rows). A weight
gradient is only computed in a backward pass that runs the weight's ``AccumulateGrad`` node (a pipeline's input-gradient pass does not; its
weight pass does), so it lands exactly once whatever way the backward is split; likewise
the input gradient only in a pass that runs the input's node (``backward_needs``), so a
split backward runs each GEMM once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moe_model._grouped_mm_launch import MAX_WGRAD_SOURCES
from moe_model._triton_support import (
    cuda_capability,
    fused_kernels_enabled,
    reference_kernels_enabled,
    require_triton,
)
from moe_model.backward_needs import grads_needed
from moe_model.layers import swiglu
from moe_model.sink import GradientSink, SinkRoute, sink_route, will_run

BACKENDS = ("auto", "grouped_mm", "triton", "loop")


def grouped_mm_reference(x_RK: torch.Tensor, w_EKN: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
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
        return aligned and x_RK.dtype == torch.bfloat16 and cuda_capability(x_RK.device) >= (9, 0)
    return aligned


def resolve_backend(backend: str, x_RK: torch.Tensor, w_EKN: torch.Tensor) -> str:
    """The concrete backend ``auto`` stands for on these tensors.

    On a GPU: ``torch._grouped_mm`` where it applies (bf16 on sm_90+, 16-byte
    aligned widths): on H200 at the bench-1gpu MoE shapes it and the Triton kernels
    ran the layer's GEMMs (forward + backward) within 3% of each other, and it costs
    ~20 us of host time per call against Triton's ~100 us (tools/bench_expert_gemms.py layer).
    Elsewhere Triton (fp16, pre-Hopper GPUs, odd widths) if installed, else the loop.
    On a CPU: ``torch._grouped_mm`` where its stride rule holds, else the loop.
    Under ``use_reference_kernels`` the loop, whatever ``backend`` asks for.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown grouped GEMM backend {backend!r}; expected one of {BACKENDS}")
    if reference_kernels_enabled():
        return "loop"
    if backend != "auto":
        return backend
    if _fits_grouped_mm(x_RK, w_EKN):
        return "grouped_mm"
    if fused_kernels_enabled(x_RK.device):
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
        from moe_model._grouped_mm_launch import triton_grouped_mm

        require_triton("grouped_mm", x_RK.device)
        return triton_grouped_mm(x_RK, w_EKN, offsets)
    return grouped_mm_reference(x_RK, w_EKN, offsets)


def sink_adds_in_kernel(rows: torch.Tensor) -> bool:
    """Whether the weight gradient of rows on this device can go into a sink (Triton epilogue)."""
    return fused_kernels_enabled(rows.device)


WgradSource = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (x, dy, offsets) of one backward


class ExpertWeightGradient:
    """A grouped weight gradient not computed yet: the operands of ``x_g^T @ dy_g``.

    Calling it adds the gradient to an FP32 target in the weight-gradient kernel's
    epilogue (``wgrad_accumulate_``). ``merged(other)`` joins the same weight's
    gradient from another backward (the next microbatch) so that one launch reduces
    the rows of both: one read-modify-write of the target instead of two, and a
    longer reduction per expert. A holder keeps the operands alive until then;
    they must not change meanwhile (checked through their version counters).
    """

    def __init__(self, sources: tuple[WgradSource, ...], like: torch.Tensor,
                 versions: tuple[int, ...] | None = None) -> None:
        self.sources = sources
        # only the weight's shape and strides are needed: a meta tensor holds no memory
        self.like = like if like.is_meta else torch.empty_strided(
            like.shape, like.stride(), dtype=like.dtype, device="meta")
        self.versions = versions or tuple(t._version for src in sources for t in src[:2])

    @classmethod
    def from_rows(cls, x_RK: torch.Tensor, dy_RN: torch.Tensor, offsets: torch.Tensor,
                  like_EKN: torch.Tensor) -> ExpertWeightGradient:
        """The gradient ``x_g^T @ dy_g`` of the weight ``like_EKN`` (``[E, K, N]``, a view of
        the parameter in its storage order) from one backward's rows: the form other
        grouped-experts layers (moe_mxfp8's FP8 experts) hand a sink to get this kernel."""
        return cls(((x_RK, dy_RN, offsets),), like_EKN)

    def merged(self, other: object) -> ExpertWeightGradient | None:
        """One gradient adding both, or ``None`` where one launch cannot take them."""
        if (not isinstance(other, ExpertWeightGradient)
                or len(self.sources) + len(other.sources) > MAX_WGRAD_SOURCES
                or other.like.shape != self.like.shape or other.like.stride() != self.like.stride()):
            return None
        return ExpertWeightGradient(self.sources + other.sources, self.like, self.versions + other.versions)

    def __call__(self, target: torch.Tensor) -> None:
        from moe_model._grouped_mm_launch import wgrad_accumulate_

        now = tuple(t._version for src in self.sources for t in src[:2])
        if now != self.versions:
            raise RuntimeError(
                "an expert weight gradient's operands (the GEMM input or output gradient rows) "
                "were modified in place while it was held for merging"
            )
        (x, dy, offsets), *more = self.sources
        wgrad_accumulate_(target, x, dy, offsets, self.like, more=more)


def _wgrad_into_sink(route: SinkRoute, param: nn.Parameter, x_RK: torch.Tensor, dy_RN: torch.Tensor,
                     offsets: torch.Tensor, like: torch.Tensor) -> None:
    """Add ``param``'s gradient to the sink's target in the wgrad kernel's epilogue, in a
    backward that runs the weight's ``AccumulateGrad`` node (not a pipeline's input pass)."""
    if will_run(route):
        route[0].add_gradient(param, ExpertWeightGradient.from_rows(x_RK, dy_RN, offsets, like))


class _GroupedMMIntoSink(torch.autograd.Function):
    """``y = x @ w[g]^T`` per group (``w`` the ``[E, N, K]`` parameter); the weight gradient
    is added to the sink's FP32 target by the Triton weight-gradient kernel."""

    @staticmethod
    def forward(ctx: Any, x_RK: torch.Tensor, w_ENK: torch.Tensor, offsets: torch.Tensor, backend: str,
                route: SinkRoute) -> torch.Tensor:
        w_c = w_ENK.to(x_RK.dtype)
        ctx.save_for_backward(x_RK, w_c, offsets)
        ctx.backend, ctx.route, ctx.param = backend, route, w_ENK
        return grouped_mm(x_RK, w_c.transpose(1, 2), offsets, backend)

    @staticmethod
    def backward(ctx: Any, dy_RN: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        x_RK, w_c, offsets = ctx.saved_tensors
        need = grads_needed(ctx)
        dy_RN = dy_RN.contiguous()
        dx = grouped_mm(dy_RN, w_c, offsets, ctx.backend) if need[0] else None
        if need[1]:
            _wgrad_into_sink(ctx.route, ctx.param, x_RK, dy_RN, offsets, w_c.transpose(1, 2))
        return dx, None, None, None, None


class _GateUp(torch.autograd.Function):
    """``(x @ w1[g]^T, x @ w3[g]^T)``, the gate and up projections, in one Triton launch;
    the input gradient ``dg @ w1[g] + du @ w3[g]`` in one GEMM over the joint reduction
    (no second ``[R, D]`` output and no add of the two); each weight gradient into its
    sink (``routes[i]`` not ``None``) or returned through autograd."""

    @staticmethod
    def forward(ctx: Any, x_RD: torch.Tensor, w1_EFD: torch.Tensor, w3_EFD: torch.Tensor,
                offsets: torch.Tensor, routes: tuple[SinkRoute | None, SinkRoute | None],
                ) -> tuple[torch.Tensor, torch.Tensor]:
        from moe_model._grouped_mm_launch import triton_grouped_mm_split2

        w1c, w3c = w1_EFD.to(x_RD.dtype), w3_EFD.to(x_RD.dtype)
        ctx.save_for_backward(x_RD, w1c, w3c, offsets)
        ctx.routes, ctx.params = routes, (w1_EFD, w3_EFD)
        return triton_grouped_mm_split2(x_RD, w1c.transpose(1, 2), w3c.transpose(1, 2), offsets)

    @staticmethod
    def backward(ctx: Any, dg_RF: torch.Tensor, du_RF: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        from moe_model._grouped_mm_launch import rows_mm_sum2, wgrad_mm

        x_RD, w1c, w3c, offsets = ctx.saved_tensors
        need = grads_needed(ctx)
        dg_RF, du_RF = dg_RF.contiguous(), du_RF.contiguous()
        dx = rows_mm_sum2(dg_RF, w1c, du_RF, w3c, offsets) if need[0] else None
        grads: list[torch.Tensor | None] = []
        for i, (param, w_c, dy) in enumerate(zip(ctx.params, (w1c, w3c), (dg_RF, du_RF), strict=True)):
            like, route = w_c.transpose(1, 2), ctx.routes[i]
            if need[1 + i] and route is None:
                grads.append(wgrad_mm(x_RD, dy, offsets, like).transpose(1, 2).to(param.dtype))
                continue
            if need[1 + i]:
                _wgrad_into_sink(route, param, x_RD, dy, offsets, like)
            grads.append(None)
        return dx, grads[0], grads[1], None, None


def gate_up_pairs(rows: torch.Tensor, backend: str) -> bool:
    """Whether the gate and up projections run as one paired Triton GEMM (``_GateUp``):
    on CUDA with Triton, for the ``auto`` and ``triton`` backends. Measured on H200 at the
    bench MoE shapes against two ``torch._grouped_mm`` calls and the add of their input
    gradients: ``tools/bench_expert_gemms.py gate-up``, docs/performance.md."""
    return backend in ("auto", "triton") and fused_kernels_enabled(rows.device)


def gate_up(
    x_RD: torch.Tensor, w1_EFD: nn.Parameter, w3_EFD: nn.Parameter, offsets: torch.Tensor,
    sink: GradientSink | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x @ w1[g]^T, x @ w3[g]^T)`` through ``_GateUp`` (CUDA with Triton); each weight's
    gradient goes into ``sink`` when the sink accepts it and a backward will run."""
    routes = (sink_route(sink, w1_EFD), sink_route(sink, w3_EFD))
    return _GateUp.apply(x_RD, w1_EFD, w3_EFD, offsets, routes)


def grouped_mm_into_sink(
    x_RK: torch.Tensor, w_ENK: nn.Parameter, offsets: torch.Tensor, backend: str, sink: GradientSink | None
) -> torch.Tensor:
    """``x @ w[g]^T`` per group for the ``[E, N, K]`` weight ``w``; its gradient goes into
    ``sink`` when the sink accepts it and a backward will run, else through autograd."""
    route = sink_route(sink, w_ENK)
    if route is None:
        return grouped_mm(x_RK, w_ENK.to(x_RK.dtype).transpose(-2, -1), offsets, backend)
    return _GroupedMMIntoSink.apply(x_RK, w_ENK, offsets, backend, route)


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
        self.grad_sink: GradientSink | None = None  # see the module docstring

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
        sink = self.grad_sink if sink_adds_in_kernel(rows_RD) else None

        def mm(x: torch.Tensor, w: nn.Parameter) -> torch.Tensor:
            return grouped_mm_into_sink(x, w, group_offsets, self.backend, sink)

        if gate_up_pairs(rows_RD, self.backend):
            g, u = gate_up(rows_RD, self.w1, self.w3, group_offsets, sink)
        else:
            g, u = mm(rows_RD, self.w1), mm(rows_RD, self.w3)
        # rows past the last expert's end are padding (an EP receive buffer sized for the
        # worst case): the fused SwiGLU skips them
        return mm(swiglu(g, u, rows=group_offsets[-1:]), self.w2)
