"""A step's microbatches replayed from CUDA graphs (``train.cuda_graphs``).

Why: a bench-1gpu step launches ~28k kernels; the host issues them at about the rate the
device runs them, and wherever it falls behind (Python, Triton's launcher, the
allocator) the device idles. A replayed graph launches the same kernels with no host
work between them (bench-1gpu on one H200: the device idle 26 ms per step instead of
~60, +0.9 to +2.4% tokens/s).

What is captured: a *unit* of microbatches, forward and backward, ending where nothing
is held across the unit's end: ``parallel.merge_expert_grad_microbatches`` microbatches,
the window in which the data-parallel wrapper holds expert weight gradients to merge
them. A step replays the *middle* unit's graph (``no_sync``) as often as whole units fit
before its last microbatch, then the *last* unit's graph once: the rest of the
microbatches (1 to ``unit``), the last one synchronised, and ``finish_grad_sync``. Both
graphs share one memory pool (they never run at once), so the activations cost what they
cost eagerly.

Everything a graph reads or writes from outside stays at a fixed address: the token
inputs (static buffers the host batches are copied into before each replay), the
parameters and main gradients (updated in place by the optimizer), the loss and the
routing statistics (the graphs add them into the running sums ``loss_sum`` and
``stats_sum``, zeroed at the start of each replay and read by the step after it), the MoE layers'
running balancing counts (one buffer each, zeroed in place at the step's end).

Capture needs a warmed-up model (Triton autotuning, cuDNN plans and library handles
exist before it, and the graphs' stream has run the work once), so the trainer runs
its first step eagerly on ``stream`` and captures after it (``GraphedForwardBackward``). Graphs replay what they
recorded, so a model that changed since (a hook added or removed, a parameter or buffer
replaced by another tensor, train/eval switched: ``launch_fingerprint``) must not be
replayed: the trainer then runs the step eagerly and captures again. What the
fingerprint cannot see (a Python attribute a forward reads) needs
``Trainer.reset_graphs()``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

# runs one unit's microbatches from its token buffers; ``last``: the step's final unit
RunUnit = Callable[[Sequence[torch.Tensor], bool], None]


def launch_fingerprint(model: nn.Module) -> tuple:
    """What decides which kernels ``model``'s forward and backward launch on which memory,
    beyond tensor values: each module's hooks and train/eval flag, and which tensors its
    parameters (with their gradient hooks) and buffers are. Equal before and after a
    change means a graph captured before it still replays the same work."""
    modules = tuple(
        (name, m.training, *(tuple(d) for d in (m._forward_pre_hooks, m._forward_hooks,
                                                m._backward_pre_hooks, m._backward_hooks)))
        for name, m in model.named_modules())
    tensors = tuple(
        (name, t.data_ptr(), tuple(getattr(t, "_post_accumulate_grad_hooks", None) or ()),
         tuple(t._backward_hooks or ()))
        for name, t in (*model.named_parameters(), *model.named_buffers()))
    return modules, tensors


def split_into_units(n_microbatches: int, unit: int) -> tuple[int, int]:
    """``(middle units, microbatches of the last unit)`` of a step: the last unit holds 1 to
    ``unit`` microbatches, the middle ones ``unit`` each, in order."""
    if n_microbatches < 1 or unit < 1:
        raise ValueError(f"need at least one microbatch and a unit of at least one, got "
                         f"{n_microbatches} microbatches and unit {unit}")
    last = n_microbatches - unit * ((n_microbatches - 1) // unit)
    return (n_microbatches - last) // unit, last


@dataclass
class _Unit:
    graph: torch.cuda.CUDAGraph
    tokens: list[torch.Tensor]  # static inputs: [micro_batch, seq_len + 1] token ids each

    def replay(self, batches: Sequence[torch.Tensor]) -> None:
        for index, (buffer, batch) in enumerate(zip(self.tokens, batches, strict=True)):
            # copy_ would broadcast a smaller batch (a [1, S] batch into [2, S] repeats its
            # tokens) and cast floats: the graph's input must be exactly what it captured
            if batch.shape != buffer.shape or batch.dtype.is_floating_point or batch.is_complex():
                raise ValueError(
                    f"microbatch {index} of a graph unit has shape {tuple(batch.shape)} and dtype "
                    f"{batch.dtype}; the graph was captured for integer token ids of shape "
                    f"{tuple(buffer.shape)}")
        for buffer, batch in zip(self.tokens, batches, strict=True):
            buffer.copy_(batch, non_blocking=True)
        self.graph.replay()


class MicrobatchGraphs:
    """The middle and last units of a step, captured once and replayed every step.

    ``model``: what the units run (its ``launch_fingerprint`` is taken at the capture);
    ``n_microbatches`` per step, ``unit`` microbatches per middle unit; ``n_stats``: the
    length of the routing statistics the units add into ``stats_sum``.
    """

    def __init__(self, model: nn.Module, n_microbatches: int, unit: int, n_stats: int,
                 device: torch.device) -> None:
        self.model = model
        self._fingerprint: tuple | None = None
        self.unit = unit
        self.n_middle, self.last_size = split_into_units(n_microbatches, unit)
        self.stream = torch.cuda.Stream(device)
        self.loss_sum = torch.zeros((), device=device)
        self.stats_sum = torch.zeros(n_stats, dtype=torch.float64, device=device)
        self._middle: _Unit | None = None
        self._last: _Unit | None = None

    @property
    def captured(self) -> bool:
        return self._last is not None

    def match_model(self) -> bool:
        """Whether the model launches what it did at the capture (``launch_fingerprint``)."""
        return self._fingerprint == launch_fingerprint(self.model)

    def capture(self, run_unit: RunUnit, token_shape: Sequence[int]) -> None:
        """Record the units (no kernel runs); ``run_unit`` must leave nothing held."""
        device = self.loss_sum.device
        pool = None
        units = []
        for last, size in ((False, self.unit), (True, self.last_size)):
            if not last and self.n_middle == 0:
                units.append(None)
                continue
            tokens = [torch.zeros(token_shape, dtype=torch.int64, device=device)
                      for _ in range(size)]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=self.stream):
                run_unit(tokens, last)
            pool = graph.pool()
            units.append(_Unit(graph, tokens))
        self._middle, self._last = units
        self._fingerprint = launch_fingerprint(self.model)

    def replay(self, batches: Sequence[torch.Tensor]) -> None:
        """Run the step's microbatches (``batches``: token ids on the device, or pinned on
        the host so the copies do not wait) on the current stream; the running sums are
        zeroed first and then hold the step's loss and statistics."""
        if self._last is None:
            raise RuntimeError("MicrobatchGraphs.replay before capture")
        expected = self.n_middle * self.unit + self.last_size
        if len(batches) != expected:
            raise ValueError(f"the graphs run {expected} microbatches per step, got {len(batches)}")
        self.loss_sum.zero_()  # the previous step's sums were read (queued) before this replay
        self.stats_sum.zero_()
        for index in range(self.n_middle):
            self._middle.replay(batches[index * self.unit:(index + 1) * self.unit])
        self._last.replay(batches[self.n_middle * self.unit:])



class UnitGraphs(Protocol):
    """What ``GraphedForwardBackward`` needs of the captured units (``MicrobatchGraphs``;
    a CPU test substitutes a stand-in that reruns the units' Python instead)."""

    stream: torch.cuda.Stream | None  # where the eager warm-up runs (None: the current one)
    loss_sum: torch.Tensor
    stats_sum: torch.Tensor

    @property
    def captured(self) -> bool: ...

    def match_model(self) -> bool: ...

    def capture(self, run_unit: RunUnit, token_shape: Sequence[int]) -> None: ...

    def replay(self, batches: Sequence[torch.Tensor]) -> None: ...


# the trainer's eager forward and backward of a step: (loss sum or None, statistics or None)
ForwardBackward = Callable[[int], tuple[torch.Tensor | None, torch.Tensor | None]]
# runs ``tokens`` (one unit) adding loss and statistics into the given running sums
UnitWork = Callable[[Sequence[torch.Tensor], bool, torch.Tensor, torch.Tensor], None]


class GraphedForwardBackward:
    """A step's forward and backward that replays CUDA graphs once they are captured.

    Wraps the eager ``forward_backward`` callable and stands in for it (the way
    torchtitan wraps a compiled or graphed callable), so the train step has one line for
    it whichever runs. Until ``capture`` it runs the eager callable on the graphs' stream
    (the warm-up a capture needs); after, it replays the units, unless the model no longer
    matches the capture (``launch_fingerprint``): then it drops the graphs, runs eagerly
    and can capture again. The caller decides when to capture (``Trainer.fit``: after a
    step that does not end the run).

    ``unit_work``: one unit's microbatches into running sums; ``host_batches(step)``: the
    step's token ids on the host; ``new_graphs()``: empty units (``MicrobatchGraphs``);
    ``after_capture``: what must be undone of the capture's Python (the data-parallel
    wrapper counts the units' gradients as reduced: a following eager step needs a clean
    slate, as a replay has); ``mark``: the phase timer's mark (a replay is phase ``graph``).
    """

    def __init__(self, eager: ForwardBackward, unit_work: UnitWork,
                 host_batches: Callable[[int], list[torch.Tensor]],
                 new_graphs: Callable[[], UnitGraphs], token_shape: Sequence[int],
                 after_capture: Callable[[], None],
                 mark: Callable[[str], None] = lambda phase: None) -> None:
        self.eager, self.unit_work, self.host_batches = eager, unit_work, host_batches
        self.new_graphs, self.token_shape, self.after_capture = new_graphs, token_shape, after_capture
        self.mark = mark
        self.graphs = new_graphs()

    @property
    def captured(self) -> bool:
        return self.graphs.captured

    def reset(self) -> None:
        """Drop the captured graphs: the next step runs eagerly and may capture again."""
        self.graphs = self.new_graphs()

    def __call__(self, step: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.graphs.captured and not self.graphs.match_model():
            self.reset()  # the model changed since the capture: eager now, capture after
        graphs = self.graphs
        if graphs.captured:
            self.mark("graph")
            graphs.replay(self.host_batches(step))
            return graphs.loss_sum, graphs.stats_sum
        if graphs.stream is None:
            return self.eager(step)
        # the warm-up for a capture: the same work on the stream the graphs are captured on
        current = torch.cuda.current_stream(graphs.stream.device)
        graphs.stream.wait_stream(current)
        with torch.cuda.stream(graphs.stream):
            result = self.eager(step)
        current.wait_stream(graphs.stream)
        return result

    def capture(self) -> None:
        """Record the units (after an eager step; no kernel runs). No-op once captured."""
        graphs = self.graphs
        if graphs.captured:
            return
        graphs.capture(lambda tokens, last: self.unit_work(tokens, last, graphs.loss_sum,
                                                           graphs.stats_sum), self.token_shape)
        self.after_capture()
