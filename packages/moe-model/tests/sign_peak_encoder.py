"""A ``RowEncoder`` for tests of the kernels that serve one (the fused
cross-entropy, the combine backward): its scale is the row's amax itself and its codes
mark signs and the positions of the row's largest magnitude, so both are checked
exactly against the gradient the kernel wrote (``expected_codes``)."""

import torch
import triton
import triton.language as tl


@triton.jit
def _amax_as_scale(amax):
    return amax


@triton.jit
def _sign_or_peak(values, scale):
    """3 where ``|value|`` is the row's nonzero scale (its amax here), else the sign as
    1 / 2 / 0."""
    code = tl.where(values > 0, 1, tl.where(values < 0, 2, 0))
    peak = (tl.abs(values) == scale) & (tl.abs(values) > 0)
    return tl.where(peak, 3, code).to(tl.uint8)


class SignPeakEncoder:
    """Records what it receives; see the module notes."""

    row_scale, row_encode = _amax_as_scale, _sign_or_peak

    def __init__(self):
        self.received = []

    def receive(self, grad, codes, scales):
        self.received.append((grad, codes, scales))


def expected_codes(grad):
    """``(amax [N, 1], codes [N, C])`` the encoder gives for the stored ``grad`` (rows
    without a NaN)."""
    grad = grad.float()
    amax = grad.abs().amax(1, keepdim=True)
    code = torch.where(grad > 0, 1, torch.where(grad < 0, 2, 0))
    code = torch.where((grad.abs() == amax) & (amax > 0), 3, code)
    return amax, code.to(torch.uint8)
