"""The training run through its entry points: outputs, optimizers, skips, SIGTERM, errors.

Multi-process layouts, checkpoints and resume through torchrun: ``test_layouts.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from moe_model import layers as layers_module
from moe_model import linear as linear_module
from moe_model import wire_model
from moe_model.linear import DenseWeightGradient, Linear
from moe_mxfp8 import FP8Linear, MXFP8GroupedExperts, MXFP8Linear, dequantize, quantize
from pretrain.cli import main
from pretrain.config import ConfigError, OptimConfig, load_config, validate_layout
from pretrain.data import prepare_data
from pretrain.divergence import TrainingAborted
from pretrain.graphs import split_into_units
from pretrain.mesh import build_mesh
from pretrain.metrics import MetricsLog
from pretrain.runtime import distributed
from pretrain.schedule import build_schedule
from pretrain.signals import StopRequest
from pretrain.train import train
from pretrain.trainer import Trainer
from torch import nn

RECORD_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "skipped",
               "lb_loss", "z_loss", "expert_load_imbalance", "dropped_token_rate", "expert_load"}


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_tiny_run_writes_config_and_metrics(tmp_path):
    history = train(load_config("tiny", [f"run_dir={tmp_path}"]))
    records = _metrics(tmp_path)
    assert records == history and [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert RECORD_KEYS <= set(r), RECORD_KEYS - set(r)
        assert r["skipped"] is False and np.isfinite(r["loss"]) and r["dropped_token_rate"] == 0.0
        assert len(r["expert_load"]) == 2 and sum(r["expert_load"][0]) == 8 * 32 * 2  # tokens x top_k
    assert records[-1]["loss"] < records[0]["loss"]
    assert load_config(str(tmp_path / "config.toml")) == load_config("tiny", [f"run_dir={tmp_path}"])


def test_auto_merge_trains_one_microbatch_at_a_time_on_a_cpu(tmp_path, capsys):
    """``auto`` resolves to 1 where the fused kernels do not run, trains the losses of an
    explicit 1, and the written config keeps ``auto`` (a resume on GPUs re-resolves it)."""
    auto = train(load_config("tiny", [f"run_dir={tmp_path / 'auto'}",
                                      "parallel.merge_expert_grad_microbatches=auto"]))
    assert "parallel.merge_expert_grad_microbatches=auto: 1 " in capsys.readouterr().out
    one = train(load_config("tiny", [f"run_dir={tmp_path / 'one'}"]))
    assert [r["loss"] for r in auto] == [r["loss"] for r in one]
    written = load_config(str(tmp_path / "auto" / "config.toml"))
    assert written.parallel.merge_expert_grad_microbatches == "auto"


def test_router_bias_steps_once_per_optimizer_step(tmp_path):
    cfg = load_config("tiny", [f"run_dir={tmp_path}", "model.bias_update_rate=0.01"])
    with distributed("cpu"):
        trainer = _trainer(cfg)
        record = trainer.train_step(1).record
    for (_, layer), load in zip(trainer.model.moe_layers(), record["expert_load"], strict=True):
        load_E = torch.tensor(load, dtype=torch.float32)
        expected = 0.01 * torch.sign(load_E.mean() - load_E)
        assert torch.equal(layer.router.expert_bias, expected)


def _trainer(cfg):
    return Trainer(cfg, build_mesh(validate_layout(cfg, 1), "cpu"), torch.device("cpu"))


class _Collect:
    def __init__(self) -> None:
        self.records: list[dict] = []

    def log(self, record) -> None:
        self.records.append(dict(record))

    def close(self) -> None:
        pass


def test_non_finite_steps_are_skipped_and_abort_after_the_limit(tmp_path):
    cfg = load_config("tiny", [f"run_dir={tmp_path}", "train.steps=10",
                               "train.max_consecutive_skips=3"])
    with distributed("cpu"):
        trainer = _trainer(cfg)
        # A NaN main weight: every rebuild brings it back, so every step is non-finite.
        trainer.optimizer.sharded_state()["main/norm.weight"].local[0] = float("nan")
        trainer.optimizer.rebuild_weights()
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        collect = _Collect()
        with pytest.raises(TrainingAborted) as e, StopRequest() as stop:
            trainer.fit(MetricsLog([collect]), stop)
    assert "3 consecutive steps (to step 3) had a non-finite gradient norm" in str(e.value)
    assert "train.max_consecutive_skips" in str(e.value)
    assert [r["skipped"] for r in collect.records] == [True, True, True]
    for name, p in trainer.model.named_parameters():
        assert torch.allclose(p, before[name], rtol=0, atol=0, equal_nan=True), name


def test_a_skipped_step_leaves_weights_and_counter_recovers(tmp_path, monkeypatch):
    cfg = load_config("tiny", [f"run_dir={tmp_path}", "train.steps=6",
                               "train.max_consecutive_skips=3", "model.bias_update_rate=0.01"])
    with distributed("cpu"):
        trainer = _trainer(cfg)
        forward_backward = trainer.forward_backward

        def poisoned(step: int):  # a NaN gradient in steps 2 and 3
            result = forward_backward(step)
            if step in (2, 3):
                trainer.ddp.grad_buffers()[0][1][0] = float("nan")
            return result

        monkeypatch.setattr(trainer, "forward_backward", poisoned)

        def state() -> list[torch.Tensor]:
            return [t.detach().clone() for t in trainer.model.state_dict().values()]

        trainer.train_step(1)
        after_1 = state()
        assert trainer.train_step(2).record["skipped"] and trainer.train_step(3).record["skipped"]
        assert all(torch.equal(a, b) for a, b in zip(after_1, state(), strict=True))  # router bias included
        assert not trainer.train_step(4).record["skipped"]
        assert not all(torch.equal(a, b) for a, b in zip(after_1, state(), strict=True))
        with StopRequest() as stop:  # two skips in a row, then fine: the limit of 3 is not hit
            records = trainer.fit(MetricsLog([]), stop)
    assert [r["skipped"] for r in records] == [False, True, True, False, False, False]


class _SigtermAt(_Collect):
    """A tracker that sends this process SIGTERM while logging step ``at``."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def log(self, record) -> None:
        super().log(record)
        if record["step"] == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_stops_at_the_next_step_boundary(tmp_path, capsys):
    """The flag rides on the next step's all-reduce: every rank stops after that step."""
    cfg = load_config("tiny", [f"run_dir={tmp_path}", "train.steps=1000"])
    previous = signal.getsignal(signal.SIGTERM)
    with distributed("cpu"):
        trainer = _trainer(cfg)
        tracker = _SigtermAt(2)
        with StopRequest() as stop:
            records = trainer.fit(MetricsLog([tracker]), stop)
    assert [r["step"] for r in records] == [1, 2, 3] == [r["step"] for r in tracker.records]
    assert capsys.readouterr().out.strip() == "stopping after step 3: received SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is previous  # the handler was removed


COMMAND_DEADLINE_S = 120  # to the step-2 line, then again from SIGTERM to the exit


class _LineReader:
    """A pipe's lines, read by a daemon thread into a queue (``None`` at end of file), so
    that waiting for one can time out."""

    def __init__(self, pipe) -> None:
        self.queue: queue.Queue[str | None] = queue.Queue()
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self.thread.start()

    def _read(self, pipe) -> None:
        for line in pipe:
            self.queue.put(line)
        self.queue.put(None)

    def next_line(self, deadline: float) -> str | None:
        """The next line (kept in ``lines``), ``None`` at end of file; ``queue.Empty``
        when none came by ``deadline`` (``time.monotonic()``)."""
        line = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
        if line is not None:
            self.lines.append(line)
        return line

    def text(self, join_s: float = 0.0) -> str:
        """Every line read so far (after waiting ``join_s`` for the end of file)."""
        self.thread.join(join_s)
        while True:
            try:
                line = self.queue.get_nowait()
            except queue.Empty:
                return "".join(self.lines)
            if line is not None:
                self.lines.append(line)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigterm_through_the_command_saves_a_checkpoint_and_exits_0(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pretrain", "--config", "tiny", "train.steps=100000",
         f"run_dir={run}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    stdout, stderr = _LineReader(proc.stdout), _LineReader(proc.stderr)

    def fail(what: str) -> None:
        proc.kill()
        proc.wait()
        pytest.fail(f"the command {what} within {COMMAND_DEADLINE_S} s: killed it\n"
                    f"stdout: {stdout.text(5)[-2000:]}\nstderr: {stderr.text(5)[-2000:]}")

    try:
        deadline = time.monotonic() + COMMAND_DEADLINE_S
        while True:
            try:
                line = stdout.next_line(deadline)
            except queue.Empty:
                fail("printed no 'step     2/' line")
            if line is None:  # it exited before step 2: the assertions below say how
                break
            if line.startswith("step     2/"):
                proc.send_signal(signal.SIGTERM)
                break
        try:
            proc.wait(timeout=COMMAND_DEADLINE_S)
        except subprocess.TimeoutExpired:
            fail("did not exit after SIGTERM")
        out, err = stdout.text(COMMAND_DEADLINE_S), stderr.text(COMMAND_DEADLINE_S)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-2000:]
    stops = [x for x in out.splitlines() if x.startswith("stopping after step ")]
    assert len(stops) == 1 and stops[0].endswith(": received SIGTERM"), out[-2000:]
    stopped = int(stops[0].split("stopping after step ")[1].split(":")[0])
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == [f"step_{stopped:010d}"]


def test_muon_and_mxfp8_experts_train(tmp_path):
    """Muon, MXFP8 expert GEMMs, and MXFP8 dispatch payloads on an EP transport of one rank."""
    history = train(load_config("tiny", [
        f"run_dir={tmp_path}", "optim.name=muon", "mxfp8.targets=experts", "train.steps=6",
        "parallel.ep_backend=all_to_all", "parallel.ep_payload=mxfp8"]))
    assert all(not r["skipped"] for r in history)
    assert history[-1]["loss"] < history[0]["loss"]


def test_mxfp8_attention_projections_train(tmp_path):
    """MXFP8 q/k/v/o projections (``attn.w?``) beside the dense layers that share an input:
    the replaced modules are called as they are, the rest keep their path."""
    history = train(load_config("tiny", [f"run_dir={tmp_path}", "mxfp8.targets=experts,attn.w?",
                                         "train.steps=4"]))
    assert all(not r["skipped"] for r in history)
    assert history[-1]["loss"] < history[0]["loss"]


def _mx(x: torch.Tensor) -> torch.Tensor:
    """MXFP8 round trip along the last dim in FP32 (moe_mxfp8's pure-torch reference)."""
    return dequantize(*quantize(x, -1, backend="reference"), -1, dtype=torch.float32, backend="reference")


def _recorded_deliveries(trainer, monkeypatch) -> list[nn.Parameter]:
    """The parameters whose gradients the DDP sink is handed, in order (it still adds them)."""
    delivered: list[nn.Parameter] = []
    add_gradient = trainer.ddp.add_gradient
    monkeypatch.setattr(trainer.ddp, "add_gradient",
                        lambda p, add: (delivered.append(p), add_gradient(p, add))[-1])
    return delivered


def _one_step_main_grads(trainer) -> dict[str, torch.Tensor]:
    """One step's forward and backward: the FP32 main grads it left (then zeroed)."""
    trainer.forward_backward(1)
    grads = {n: trainer.ddp.main_grad(n).clone() for n, _ in trainer.model.named_parameters()}
    trainer.ddp.zero_grad()
    return grads


def _assert_sink_on_equals_off(with_sink: dict[str, torch.Tensor], without: dict[str, torch.Tensor]) -> None:
    for name, want in without.items():
        assert want.abs().sum() > 0, name
        torch.testing.assert_close(with_sink[name], want, rtol=1e-5, atol=1e-7,
                                   msg=f"{name} gradient, sink on vs off")


def _steps_with_the_sink_on_and_off(trainer, monkeypatch, check) -> None:
    """One step's gradients with the DDP sink wired, then with it off, equal;
    ``check(sink, delivered)`` after each step (``delivered``: the parameters handed to it)."""
    delivered = _recorded_deliveries(trainer, monkeypatch)
    grads = []
    for sink in (trainer.ddp, None):
        wire_model(trainer.model, dataclasses.replace(trainer.wiring, gradient_sink=sink))
        delivered.clear()
        grads.append(_one_step_main_grads(trainer))
        check(sink, delivered)
    _assert_sink_on_equals_off(*grads)


@pytest.mark.parametrize("targets", ["experts,attn.w?", "attn.wq"])
def test_mxfp8_attention_projections_beside_the_dense_sink_route(tmp_path, monkeypatch, targets):
    """The dense layers' sink route forced on CPU (as on CUDA, ``moe_model.linear``): MXFP8
    attention projections (all four, or q alone beside k and v taking the route) are each
    called, their outputs are the MXFP8 GEMM's; every dense weight (the MXFP8 projections',
    the dense block's gate/up and w2, the head's) and the MXFP8 experts' weights deliver
    into the DDP sink; one step's gradients equal those with the sink off."""
    monkeypatch.setattr(linear_module, "sink_takes_dense", lambda x: True)
    calls: list[tuple[tuple[nn.Module, ...], torch.Tensor, tuple[torch.Tensor, ...]]] = []
    shared = layers_module.shared_input_linears  # whatever the model calls (wrapped, not replaced)

    def recorded(x, mods):
        out = shared(x, mods)
        calls.append((mods, x.detach(), tuple(o.detach() for o in out)))
        return out

    monkeypatch.setattr(layers_module, "shared_input_linears", recorded)
    cfg = load_config("tiny", [f"run_dir={tmp_path}", f"mxfp8.targets={targets}",
                               "model.n_dense_layers=1"])
    with distributed("cpu"):
        trainer = _trainer(cfg)
        model = trainer.model
        mxfp8 = {n: m for n, m in model.named_modules() if isinstance(m, MXFP8Linear)}
        wanted = ("wq", "wk", "wv", "wo") if targets.endswith("w?") else ("wq",)
        assert sorted(mxfp8) == sorted(f"blocks.{i}.attn.{w}" for i in range(2) for w in wanted)
        dense = {n: m.weight for n, m in model.named_modules() if isinstance(m, Linear)}
        assert len(dense) == 3 + 1 + 2 * (4 - len(wanted))  # dense SwiGLU, head, attention left
        n_micro = trainer.data.n_microbatches
        seen: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {n: [] for n in mxfp8}
        for name, module in mxfp8.items():
            module.register_forward_hook(
                lambda _m, args, out, name=name: seen[name].append((args[0].detach(), out.detach())))
        delivered = _recorded_deliveries(trainer, monkeypatch)
        grads = []
        for sink in (trainer.ddp, None):
            wire_model(model, dataclasses.replace(trainer.wiring, gradient_sink=sink))
            for hooked in seen.values():
                hooked.clear()
            calls.clear()
            delivered.clear()
            grads.append(_one_step_main_grads(trainer))
            for name, hooked in seen.items():
                assert len(hooked) == n_micro, f"{name}: MXFP8Linear called {len(hooked)} times"
                w = _mx(mxfp8[name].weight.detach().bfloat16().float())  # the cache's rule
                for x, y in hooked:
                    want = _mx(x.reshape(-1, x.shape[-1])) @ w.t()
                    torch.testing.assert_close(y.reshape(want.shape), want, rtol=2e-5, atol=2e-6,
                                               msg=f"{name} output")
            attn = [(mods, x, out) for mods, x, out in calls
                    if any(mods[0] is model.blocks[str(i)].attn.wq for i in range(2))]
            assert len(attn) == 2 * n_micro
            for mods, x, out in attn:  # what attention computes with: q, k and v as they are
                x_TI = x.reshape(-1, x.shape[-1])
                for mod, y in zip(mods, out, strict=True):
                    want = (_mx(x_TI) @ _mx(mod.weight.detach().bfloat16().float()).t()
                            if isinstance(mod, MXFP8Linear) else x_TI @ mod.weight.detach().t())
                    torch.testing.assert_close(y.reshape(want.shape), want, rtol=2e-5, atol=2e-6,
                                               msg=f"{type(mod).__name__} output in attention")
            if sink is not None:  # every dense weight and MXFP8 expert weight took the route,
                experts = [m for m in model.modules() if isinstance(m, MXFP8GroupedExperts)]
                assert len(experts) == (1 if "experts" in targets else 0)  # one MoE block
                routed = [*dense.values(), *(m.weight for m in mxfp8.values()),  # once a microbatch
                          *(p for m in experts for p in (m.w1, m.w3, m.w2))]
                assert sorted(map(id, delivered)) == sorted(id(p) for p in routed for _ in range(n_micro))
            else:
                assert not delivered
        trainer.close()
    _assert_sink_on_equals_off(*grads)


@pytest.mark.parametrize("recipe", ["fp8_rowwise_gw_hp", "fp8_rowwise"])
def test_fp8_dense_layers_deliver_their_weight_gradients_into_the_ddp_sink(tmp_path, monkeypatch, recipe):
    """FP8 attention projections and LM head (``FP8Linear``) hand their weight gradients to
    the DDP sink once a microbatch: BF16 gradients as the wired ``DenseWeightGradient``'s
    GEMM, ``fp8_rowwise``'s FP8 gradient computed by the layer; one step's gradients equal
    those with the sink off."""
    cfg = load_config("tiny", [f"run_dir={tmp_path}", "mxfp8.targets=[attn.w?,head]",
                               f"mxfp8.recipe={recipe}", "model.tie_embeddings=false"])
    with distributed("cpu"):
        trainer = _trainer(cfg)
        model = trainer.model
        fp8 = {n: m for n, m in model.named_modules() if isinstance(m, FP8Linear)}
        assert len(fp8) == 2 * 4 + 1
        assert all(m.dense_weight_gradient is DenseWeightGradient for m in fp8.values())

        def check(sink, delivered):
            fp8_delivered = [p for p in delivered if any(p is m.weight for m in fp8.values())]
            assert len(fp8_delivered) == (len(fp8) * trainer.data.n_microbatches if sink else 0)

        _steps_with_the_sink_on_and_off(trainer, monkeypatch, check)
        trainer.close()


@pytest.mark.parametrize("overrides, status, message", [
    (["parallel.pp=3"], 2, "world size 1 is not divisible by parallel.pp=3"),
    (["parallel.ep=2"], 2, "parallel.ep=2 does not divide the data-parallel size 1"),
    (["data.path=/no/such/dir"], 1, "data.path '/no/such/dir' does not exist"),
    (["train.seq_len=1000000000"], 1, "fewer than one sequence of train.seq_len + 1"),
    (["checkpoint.resume=/no/such/checkpoint"], 1, "/no/such/checkpoint is not a checkpoint"),
    (["parallel.ep_payload=mxfp8"], 2, "parallel.ep_payload=mxfp8 needs expert parallelism"),
    (["parallel.ep_backend=all_to_all", "parallel.ep_payload=fp8_rowwise", "mxfp8.targets=experts"], 2,
     "parallel.ep_payload=fp8_rowwise into experts of mxfp8.recipe=mxfp8 would round"),
])
def test_bad_runs_exit_with_one_line(tmp_path, capsys, overrides, status, message):
    assert main(["--config", "tiny", f"run_dir={tmp_path}", *overrides]) == status
    err = capsys.readouterr().err.strip()
    assert err.startswith("pretrain: error: ") and "\n" not in err and message in err, err


def test_token_ids_beyond_the_vocab_exit_with_the_file_name(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "tokens.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 256}))
    ids = np.arange(4000, dtype="<u2") % 256
    ids[1234] = 4321
    (data / "shard.bin").write_bytes(ids.tobytes())
    assert main(["--config", "tiny", f"run_dir={tmp_path / 'run'}", f"data.path={data}"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"pretrain: error: {data / 'shard.bin'}: token id 4321 at position 1234 is >= "
                   "model.vocab_size=256")


def test_cuda_graphs_on_a_machine_without_a_gpu_fail_naming_the_field(tmp_path):
    """``train.device=auto`` passes the config check; the trainer then runs on the CPU."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the run would use it")
    cfg = load_config("tiny", [f"run_dir={tmp_path}", "train.cuda_graphs=true"])
    with distributed("cpu") as rt:
        with pytest.raises(ConfigError, match="train.cuda_graphs needs a CUDA device"):
            Trainer(cfg, build_mesh(validate_layout(cfg, rt.world_size), "cpu"), rt.device)


@pytest.mark.parametrize("n, unit, expected", [
    (32, 4, (7, 4)), (5, 2, (2, 1)), (5, 1, (4, 1)), (1, 4, (0, 1)), (4, 4, (0, 4)), (6, 4, (1, 2)),
])
def test_a_step_splits_into_middle_units_and_a_last_one(n, unit, expected):
    assert split_into_units(n, unit) == expected
    middle, last = expected
    assert middle * unit + last == n and 1 <= last <= unit


def test_a_graph_unit_refuses_batches_unlike_its_captured_inputs():
    """``copy_`` into the static inputs would broadcast a short batch (repeating its tokens)
    or cast float data; a unit checks every batch before it replays anything."""
    from pretrain.graphs import _Unit

    class _Graph:
        replays = 0

        def replay(self) -> None:
            self.replays += 1

    unit = _Unit(_Graph(), [torch.zeros(2, 9, dtype=torch.int64) for _ in range(2)])
    good = torch.arange(18).view(2, 9)
    unit.replay([good, good.int()])  # int32 ids are copied into the int64 inputs
    assert unit.graph.replays == 1 and torch.equal(unit.tokens[1], good)
    for bad, message in ((good[:1], r"microbatch 1 of a graph unit has shape \(1, 9\)"),
                         (good.float(), "dtype torch.float32")):
        with pytest.raises(ValueError, match=message):
            unit.replay([good + 1, bad])
        assert unit.graph.replays == 1 and torch.equal(unit.tokens[0], good)  # nothing copied


def test_the_launch_fingerprint_sees_hooks_replaced_tensors_and_train_eval_not_values():
    """What decides whether a captured CUDA graph may still be replayed."""
    from pretrain.graphs import launch_fingerprint

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    before = launch_fingerprint(model)
    with torch.no_grad():
        model[0].weight.mul_(2)  # new values in place: the optimizer's updates
    assert launch_fingerprint(model) == before
    handle = model[1].register_forward_hook(lambda *args: None)
    assert launch_fingerprint(model) != before
    handle.remove()
    assert launch_fingerprint(model) == before
    hook = model[0].bias.register_post_accumulate_grad_hook(lambda p: None)
    assert launch_fingerprint(model) != before
    hook.remove()
    model.eval()
    assert launch_fingerprint(model) != before
    model.train()
    model[0].weight.data = model[0].weight.data.clone()  # another tensor: another address
    assert launch_fingerprint(model) != before


def test_lr_schedules():
    def lr(cfg: OptimConfig, step: int, total: int) -> float:
        return cfg.lr * build_schedule(cfg, total)(step)

    cos = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr(cos, 1, 100) == pytest.approx(0.1) and lr(cos, 10, 100) == 1.0
    assert lr(cos, 55, 100) == pytest.approx(0.55) and lr(cos, 100, 100) == pytest.approx(0.1)
    wsd = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.0, schedule="wsd", decay_fraction=0.2)
    assert [lr(wsd, s, 100) for s in (50, 80)] == [1.0, 1.0]
    assert lr(wsd, 90, 100) == pytest.approx(0.5) and lr(wsd, 100, 100) == 0.0
    const = OptimConfig(lr=2.0, warmup_steps=0, schedule="constant")
    assert lr(const, 1, 10) == lr(const, 10, 10) == 2.0


def test_resume_refuses_a_data_stream_that_changed_under_its_path(tmp_path, capsys):
    """The order is a permutation of the stream's sequences: a stream that grew (prepared
    again into the same folder) would repeat some sequences of the epoch and skip others.
    The same folder named another way resumes."""
    data, run = tmp_path / "data", tmp_path / "run"
    (tmp_path / "a.txt").write_bytes(bytes(range(32, 127)) * 35)  # 3325 bytes: 103 sequences of 32 + 1
    prepare_data([tmp_path / "a.txt"], data)
    common = ["--config", "tiny", f"run_dir={run}", "checkpoint.every=2"]
    assert main([*common, f"data.path={data}", "train.stop_after=2"]) == 0
    assert main([*common, f"data.path={data}/.", "train.steps=3"]) == 0
    assert "resumed after step 2" in capsys.readouterr().out
    for path in data.iterdir():
        path.unlink()
    (tmp_path / "b.txt").write_bytes(bytes(range(32, 127)) * 70)
    prepare_data([tmp_path / "b.txt"], data)
    assert main([*common, f"data.path={data}"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"pretrain: error: checkpoint.resume: the checkpoint of step 3 was trained on 103 sequences "
        f"of train.seq_len + 1 tokens from data.path='{data}', which now holds 207: the data changed, "
        "and the data order (a permutation of the sequences) would not carry over")


def test_a_failure_after_a_checkpoint_commit_warns_and_training_goes_on(tmp_path, monkeypatch, capsys):
    """The ``latest`` pointer update failing (a full disk, a permission) after the commit:
    the checkpoint is complete and resumable, so the run warns and trains on; the next
    save writes the pointer again."""
    import moe_ckpt.directory

    write_latest, calls = moe_ckpt.directory.write_latest, []

    def failing_once(root, final):
        calls.append(final.name)
        if len(calls) == 1:
            raise OSError("no space left on device")
        write_latest(root, final)

    monkeypatch.setattr(moe_ckpt.directory, "write_latest", failing_once)
    assert main(["--config", "tiny", f"run_dir={tmp_path}", "checkpoint.every=2"]) == 0
    err = capsys.readouterr().err
    assert "warning: checkpoint" in err and "step_0000000002 is committed" in err and "training continues" in err
    assert [r["step"] for r in _metrics(tmp_path)] == [1, 2, 3, 4]
    assert calls == ["step_0000000002", "step_0000000004"]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_0000000004"
    assert main(["--config", "tiny", f"run_dir={tmp_path}", "train.steps=5"]) == 0
    assert "resumed after step 4" in capsys.readouterr().out


def test_fp8_experts_take_the_gradient_sink_and_match_autograd(tmp_path, monkeypatch):
    """``mxfp8.recipe=fp8_rowwise``: the FP8 experts are wired to the DDP sink, and their
    weight gradients through it equal autograd's route (the sink removed)."""
    from moe_mxfp8.fp8_experts import FP8GroupedExperts
    cfg = load_config("tiny", [f"run_dir={tmp_path}", "mxfp8.targets=experts",
                               "mxfp8.recipe=fp8_rowwise"])
    with distributed("cpu"):
        trainer = _trainer(cfg)
        model = trainer.model
        experts = [m for m in model.modules() if isinstance(m, FP8GroupedExperts)]
        assert experts and all(m.grad_sink is trainer.ddp for m in experts)
        expert_weights = {id(w) for m in experts for w in (m.w1, m.w3, m.w2)}

        def check(sink, delivered):
            assert expert_weights <= {id(p) for p in delivered} if sink is not None else not delivered

        _steps_with_the_sink_on_and_off(trainer, monkeypatch, check)
        trainer.close()


def test_fp8_recipes_convert_the_targeted_dense_layers_and_train(tmp_path):
    """``mxfp8.targets`` reaching the attention projections and the head with an FP8 recipe:
    they become ``FP8Linear`` (the other dense layers stay ``Linear``, still wired to the
    sink), their caches refresh after every update (a stale one refuses the forward), and
    the run trains."""
    from moe_mxfp8 import FP8Linear
    args = [f"run_dir={tmp_path}", "mxfp8.targets=[experts,attn.w?,head]",
            "mxfp8.recipe=fp8_rowwise_gw_hp", "model.n_dense_layers=1"]
    with distributed("cpu"):
        trainer = _trainer(load_config("tiny", args))
        fp8 = sorted(n for n, m in trainer.model.named_modules() if isinstance(m, FP8Linear))
        plain = [n for n, m in trainer.model.named_modules() if isinstance(m, Linear)]
        trainer.close()
    assert fp8 == sorted([*(f"blocks.{i}.attn.{w}" for i in range(2) for w in ("wq", "wk", "wv", "wo")),
                          "head"])
    assert len(plain) == 3  # the dense block's SwiGLU
    assert main(["--config", "tiny", *args, "train.steps=6"]) == 0
    losses = [r["loss"] for r in _metrics(tmp_path) if "loss" in r]
    assert len(losses) == 6 and all(np.isfinite(losses)) and losses[-1] < losses[0]


@pytest.mark.parametrize("recipe, capability", [("fp8_rowwise", "9.x"), ("mxfp8", "10.x")])
def test_native_low_precision_gemms_without_the_tensor_cores_are_refused(tmp_path, capsys,
                                                                         recipe, capability):
    """``mxfp8.gemm=native`` on a device without the tensor cores: one line before anything is
    built or written, rather than a traceback at the first forward."""
    run = tmp_path / "run"
    assert main(["--config", "tiny", f"run_dir={run}", "mxfp8.targets=experts",
                 f"mxfp8.recipe={recipe}", "mxfp8.gemm=native"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.endswith(f"mxfp8.gemm=native with mxfp8.recipe={recipe} needs a GPU of compute "
                        f"capability {capability}; this run has train.device=cpu "
                        "(mxfp8.gemm=emulated runs anywhere)")
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()


def test_a_closed_trainer_is_freed_without_a_gc_pass(tmp_path):
    """No reference cycle through the trainer: its memory (GPU memory on a GPU) goes when
    the last reference does, not at some later garbage collection."""
    import gc
    import weakref
    cfg = load_config("tiny", [f"run_dir={tmp_path}"])
    with distributed("cpu"):
        gc.collect()
        gc.disable()
        try:
            trainer = _trainer(cfg)
            trainer.train_step(1)
            trainer.close()
            alive = weakref.ref(trainer)
            del trainer
            assert alive() is None
        finally:
            gc.enable()
