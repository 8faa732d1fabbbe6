"""moe_ep_transport: expert-parallel token dispatch and combine.

Two transports behind one dispatcher: an all-to-all reference (gloo and NCCL) and a
rowwise one-sided transport over NVSHMEM symmetric memory (GPU fast path, no host
synchronisation). Inputs are plain tensors and a process group; nothing here
imports the model. Optional GPU dependencies (triton, nvshmem4py) are imported only
where they are used.
"""

from moe_ep_transport._triton_support import (
    reference_kernels_enabled,
    triton_available,
    use_reference_kernels,
)
from moe_ep_transport.codec import RowCodec, bytes_per_row
from moe_ep_transport.config import EPConfig, OverflowPolicy
from moe_ep_transport.dispatcher import EPDispatcher, EPHandle, EPOverflowError, make_transport
from moe_ep_transport.interleave import MicrobatchInterleave
from moe_ep_transport.peer_memory import EmulatedPeerMemory, PeerMemory
from moe_ep_transport.pipeline import PipelinedHandle
from moe_ep_transport.plan import RoutePlan
from moe_ep_transport.rowwise import RowwiseTransport
from moe_ep_transport.telemetry import EPTelemetry
from moe_ep_transport.transport import AllToAllTransport, Transport

__all__ = [
    "AllToAllTransport",
    "EPConfig",
    "EPDispatcher",
    "EPHandle",
    "EPOverflowError",
    "EPTelemetry",
    "EmulatedPeerMemory",
    "MicrobatchInterleave",
    "OverflowPolicy",
    "PeerMemory",
    "PipelinedHandle",
    "RoutePlan",
    "RowCodec",
    "RowwiseTransport",
    "Transport",
    "bytes_per_row",
    "make_transport",
    "reference_kernels_enabled",
    "triton_available",
    "use_reference_kernels",
]
