"""A machine's calibration: the kernel rates and link parameters the step-time model reads.

A ``Profile`` is JSON (``load_profile`` / ``Profile.to_json``). Kernel rates come from
``pretrain calibrate`` on the machine (``source`` says so) or, for the bundled
profiles, from figures recorded on that GPU (``profiles/h200.json``) or derived from
published specifications (``profiles/b200.json``); ``source`` then says which.

Links are an alpha-beta pair per link class: ``nvlink`` inside a node, ``network``
between nodes. ``gb_per_s`` is the bus bandwidth one GPU achieves per direction in
NCCL's ring collectives (what ``nccl-tests`` reports as busbw), not the datasheet
figure. ``LINK_TABLE`` holds our reading of published figures per system; a profile
or the command line (``--link nvlink=ALPHA_US,GBPS``) overrides them.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

PROFILES_DIR = Path(__file__).with_name("profiles")
LINK_CLASSES = ("nvlink", "network")
# Where a profile gives none, an assumption: the share of the SMs the EP communication
# stream takes while it overlaps the expert GEMMs when nothing bounds it
# (parallel.ep_comm_sms unset; its grids are sized by their rows and run at the highest
# priority). About what a put-based transport needs to keep NVLink at its rate:
# DeepSeek-V3 runs its dispatch and combine on 20 of an H800's 132 SMs. Our own puts take
# more: the bundled h200 profile holds 0.65, fitted to two H200s' replayed steps
# (profiles/h200.json). tools/bench_ep_overlap.py measures the pipelined layer;
# ``step_time.fit_comm_sm_share`` turns its row into this share.
EP_COMM_SM_SHARE = 20 / 132


@dataclass(frozen=True)
class Link:
    """Alpha-beta parameters of one link class: a message of ``n`` bytes per step of a
    collective costs ``alpha_us * 1e-6 + n / (gb_per_s * 1e9)`` seconds."""

    alpha_us: float
    gb_per_s: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.alpha_us) and self.alpha_us >= 0):
            raise ValueError(f"Link.alpha_us must be finite and >= 0, got {self.alpha_us}")
        if not (math.isfinite(self.gb_per_s) and self.gb_per_s > 0):
            raise ValueError(f"Link.gb_per_s must be finite and > 0, got {self.gb_per_s}")

    def seconds(self, nbytes: float, messages: int = 1) -> float:
        return messages * self.alpha_us * 1e-6 + nbytes / (self.gb_per_s * 1e9)


# Published per-GPU figures, one direction, times the share NCCL's ring collectives
# reach (nccl-tests busbw over the datasheet rate: ~80% on NVLink, ~90% on InfiniBand
# with one NIC per GPU). Latencies: NCCL's per-step latency inside a node (~5 us)
# and across an InfiniBand fabric (~10 us).
#   H100/H200 NVLink 4: 900 GB/s bidirectional = 450 per direction -> 360 busbw
#   B200 NVLink 5: 1,800 GB/s bidirectional = 900 per direction -> 720 busbw
#   InfiniBand NDR (400 Gb/s ConnectX-7, one per GPU): 50 GB/s -> 45
#   InfiniBand XDR (800 Gb/s ConnectX-8, one per GPU): 100 GB/s -> 90
LINK_TABLE: dict[str, Link] = {
    "h100-nvlink4": Link(alpha_us=5.0, gb_per_s=360.0),
    "h200-nvlink4": Link(alpha_us=5.0, gb_per_s=360.0),
    "b200-nvlink5": Link(alpha_us=5.0, gb_per_s=720.0),
    "ib-ndr-400": Link(alpha_us=10.0, gb_per_s=45.0),
    "ib-xdr-800": Link(alpha_us=10.0, gb_per_s=90.0),
    "roce-400": Link(alpha_us=15.0, gb_per_s=40.0),
}


@dataclass(frozen=True)
class Profile:
    """Rates of one GPU model and its links.

    Kernel classes (TFLOP/s and GB/s as the training step runs them, not peaks):
    dense GEMMs; the routed experts' grouped GEMMs forward and backward, whose rate
    is ``expert_gemm_tflops * m / (m + expert_gemm_half_rows)`` at ``m`` rows per
    expert (a tile-quantised GEMM loses to short groups); causal attention forward
    and backward (FLOPs: ``4 B H S^2 Dh / 2`` forward, 2.5x that backward);
    memory-bound kernels (norms, RoPE, SwiGLU, dispatch, combine, cross-entropy,
    the optimizer, the weight rebuild) at ``memory_gb_per_s``. Launches: the device
    sits ``kernel_gap_us_*`` idle between two kernels (replayed from CUDA graphs or
    launched eagerly), and an eager step cannot run faster than the host issues
    its launches (``host_launch_us`` each).

    EP overlap (``parallel.ep_overlap_chunks`` > 1): ``sm_count`` SMs per GPU; while the
    communication stream runs beside the expert GEMMs it takes ``ep_comm_sm_share`` of
    them (``parallel.ep_comm_sms`` = s bounds it: s / ``sm_count``), and the GEMMs run at
    the rest's rate.
    """

    name: str
    source: str  # how the figures were obtained
    device: str
    peak_tflops: float  # the MFU denominator (dense BF16 peak of the datasheet)
    dense_gemm_tflops: float
    expert_gemm_tflops: float
    expert_gemm_half_rows: float
    attention_fwd_tflops: float
    attention_bwd_tflops: float
    memory_gb_per_s: float
    kernel_gap_us_graphs: float
    kernel_gap_us_eager: float
    host_launch_us: float
    gpu_gib: float  # memory of one GPU (what plans must fit in)
    links: dict[str, Link] = field(default_factory=dict)
    # the EP token transport's achieved share of its link's bandwidth (NVSHMEM puts
    # inside a node, NCCL all-to-all across nodes)
    ep_transport_efficiency: float = 1.0
    sm_count: int = 132  # an H200's, where the profile does not say
    ep_comm_sm_share: float = EP_COMM_SM_SHARE
    notes: str = ""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "float" and not (isinstance(value, (int, float)) and math.isfinite(value)
                                          and value >= 0):
                raise ValueError(f"Profile.{f.name} must be a finite number >= 0, got {value!r}")
        for name in ("peak_tflops", "dense_gemm_tflops", "expert_gemm_tflops",
                     "attention_fwd_tflops", "attention_bwd_tflops", "memory_gb_per_s",
                     "gpu_gib", "ep_transport_efficiency"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Profile.{name} must be > 0, got {getattr(self, name)}")
        if not (isinstance(self.sm_count, int) and self.sm_count >= 1):
            raise ValueError(f"Profile.sm_count must be an integer >= 1, got {self.sm_count!r}")
        if self.ep_comm_sm_share > 1:
            raise ValueError(f"Profile.ep_comm_sm_share must be in [0, 1], "
                             f"got {self.ep_comm_sm_share}")
        missing = [c for c in LINK_CLASSES if c not in self.links]
        if missing:
            raise ValueError(f"Profile.links lacks {', '.join(missing)} "
                             f"(link classes: {', '.join(LINK_CLASSES)})")

    def with_links(self, **links: Link) -> Profile:
        return replace(self, links={**self.links, **links})

    def to_json(self) -> dict:
        out = asdict(self)
        out["links"] = {k: asdict(v) for k, v in self.links.items()}
        return out

    @classmethod
    def from_json(cls, data: dict, where: str = "profile") -> Profile:
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{where}: unknown key {unknown[0]!r}")
        missing = sorted(f.name for f in fields(cls)
                         if f.name not in data and f.name not in (
                             "links", "notes", "ep_transport_efficiency", "sm_count",
                             "ep_comm_sm_share"))
        if missing:
            raise ValueError(f"{where}: missing key {missing[0]!r}")
        links = {}
        for name, link in (data.get("links") or {}).items():
            if not isinstance(link, dict) or set(link) != {"alpha_us", "gb_per_s"}:
                raise ValueError(f"{where}: links.{name} must be "
                                 "{'alpha_us': ..., 'gb_per_s': ...}")
            try:
                links[name] = Link(**link)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{where}: links.{name}: {e}") from None
        try:
            return cls(**{**data, "links": links})
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None


def bundled_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def load_profile(path_or_name: str | Path) -> Profile:
    """A profile from a JSON file, or a bundled one by name (``h200``, ``b200``).

    Raises ``ValueError`` naming the file and the bad key."""
    text = str(path_or_name)
    path = Path(text)
    if not path.suffix and not path.exists():
        path = PROFILES_DIR / f"{text}.json"
        if not path.exists():
            raise ValueError(f"no profile {text!r}: neither a file nor one of the bundled "
                             f"profiles ({', '.join(bundled_profiles())})")
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"profile file {path} does not exist") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"profile file {path}: {e}") from None
    return Profile.from_json(data, where=f"profile file {path}")


def parse_link(text: str) -> tuple[str, Link]:
    """``CLASS=ALPHA_US,GBPS`` or ``CLASS=TABLE_NAME`` (a ``LINK_TABLE`` entry)."""
    name, sep, value = text.partition("=")
    if not sep or name not in LINK_CLASSES:
        raise ValueError(f"--link {text!r}: expected CLASS=ALPHA_US,GBPS or CLASS=NAME with CLASS "
                         f"one of {', '.join(LINK_CLASSES)}")
    if value in LINK_TABLE:
        return name, LINK_TABLE[value]
    parts = value.split(",")
    try:
        alpha, gbps = (float(p) for p in parts)
        return name, Link(alpha, gbps)
    except ValueError as e:
        detail = str(e) if len(parts) == 2 else "two numbers"
        raise ValueError(f"--link {text!r}: {detail} (or one of {', '.join(LINK_TABLE)})") from None
