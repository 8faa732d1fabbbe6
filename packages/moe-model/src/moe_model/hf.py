"""Hugging Face interop: the ``Qwen3MoeForCausalLM`` checkpoint layout.

On disk (what ``transformers`` reads and writes, including 5.x, which fuses the
experts in memory but converts back on save): ``config.json`` plus safetensors
with one tensor per expert projection, e.g.
``model.layers.{i}.mlp.experts.{e}.gate_proj.weight [F, D]``, the router at
``model.layers.{i}.mlp.gate.weight [E, D]`` and dense layers (``mlp_only_layers``)
at ``model.layers.{i}.mlp.{gate,up,down}_proj.weight``. Our stacked
``blocks.{i}.mlp.experts.w1 [E, F, D]`` is exactly the per-expert ``gate_proj``
weights stacked (w3 = up_proj, w2 = down_proj); the 5.x in-memory fused
``gate_up_proj [E, 2F, D]`` is also accepted when loading.

One table (``hf_names``) maps our logical tensors to HF names both ways. The export
is pure functions, so a checkpoint exporter writes HF files from global tensors
without building a model: ``hf_config(cfg)`` (the ``config.json`` content) and
``convert_to_hf(name, tensor, cfg)``. The import is ``Qwen3MoeFolder``: the
folder's config, a check of its tensors (``hf_shapes``), and any box of a logical
tensor read lazily (a parallel run reads only the slices each rank holds).

Qwen3-MoE cannot represent shared experts, sigmoid router scores, a selection
bias (aux-loss-free balancing), or attention without QK-norm; such configs are
refused. Training-only settings (loss coefficients, recompute, capacity) are not
part of the checkpoint; transformers always runs dropless.

``safetensors`` is this package's optional ``hf`` extra and is imported lazily.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from moe_model.config import MoEConfig
from moe_model.init import logical_name
from moe_model.model import MoETransformer

_TOP = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "head.weight": "lm_head.weight"}
_BLOCK = {  # ours after "blocks.{i}." -> HF after "model.layers.{i}."
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.w1.weight": "mlp.gate_proj.weight",
    "mlp.w3.weight": "mlp.up_proj.weight",
    "mlp.w2.weight": "mlp.down_proj.weight",
}
_EXPERTS = {"mlp.experts.w1": "gate_proj", "mlp.experts.w3": "up_proj", "mlp.experts.w2": "down_proj"}
_IGNORED_HF = ("rotary_emb.inv_freq",)


def check_representable(cfg: MoEConfig) -> None:
    """Raise ``ValueError`` if the Qwen3-MoE layout cannot hold this model."""
    problems = []
    if cfg.n_shared_experts:
        problems.append("n_shared_experts > 0 (Qwen3-MoE has no shared experts)")
    if cfg.router_score != "softmax":
        problems.append(f"router_score={cfg.router_score!r} (Qwen3-MoE routes with softmax)")
    if cfg.bias_update_rate > 0:
        problems.append("bias_update_rate > 0 (Qwen3-MoE has no expert selection bias)")
    if not cfg.qk_norm:
        problems.append("qk_norm=False (Qwen3-MoE always normalises queries and keys)")
    if problems:
        raise ValueError("the Qwen3-MoE layout cannot represent MoEConfig with " + "; ".join(problems))


def hf_config(cfg: MoEConfig, dtype: torch.dtype = torch.bfloat16,
              max_position_embeddings: int = 32768) -> dict[str, Any]:
    """``config.json`` content of a ``Qwen3MoeForCausalLM`` equal to ``cfg``'s model."""
    check_representable(cfg)
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.dense_hidden_width,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(cfg.n_dense_layers)),
        "moe_intermediate_size": cfg.expert_hidden,
        "num_experts": cfg.n_experts,
        "num_experts_per_tok": cfg.top_k,
        "norm_topk_prob": cfg.norm_topk_weights,
        "router_aux_loss_coef": cfg.lb_loss_coef,
        "initializer_range": cfg.init_std,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }


def _dense_layers(hf: Mapping[str, Any], n_layers: int) -> int:
    """Number of leading dense layers; refuses any other dense/sparse pattern."""
    step = hf.get("decoder_sparse_step", 1) or 1
    only = set(hf.get("mlp_only_layers") or [])
    dense = [i for i in range(n_layers) if i in only or (i + 1) % step != 0]
    if dense != list(range(len(dense))):
        raise ValueError(
            f"config.json: dense layers {dense} (mlp_only_layers / decoder_sparse_step) are "
            "not a leading run; moe_model only supports the first k layers being dense"
        )
    return len(dense)


def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> MoEConfig:
    """``MoEConfig`` of a Qwen3-MoE ``config.json``; ``overrides`` set training-only fields."""
    if hf.get("model_type") != "qwen3_moe":
        raise ValueError(f"config.json: model_type {hf.get('model_type')!r} is not 'qwen3_moe'")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    checks = {
        "hidden_act": hf.get("hidden_act", "silu") == "silu",
        "attention_bias": not hf.get("attention_bias", False),
        "use_sliding_window": not hf.get("use_sliding_window", False),
        "rope_parameters": rope.get("rope_type", rope.get("type", "default")) == "default",
    }
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        raise ValueError(f"config.json: unsupported setting(s) {bad} for moe_model")
    n_layers = hf["num_hidden_layers"]
    n_dense = _dense_layers(hf, n_layers)
    fields: dict[str, Any] = {
        "vocab_size": hf["vocab_size"],
        "d_model": hf["hidden_size"],
        "n_layers": n_layers,
        "n_heads": hf["num_attention_heads"],
        "n_kv_heads": hf.get("num_key_value_heads", hf["num_attention_heads"]),
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        "n_experts": hf.get("num_experts", hf.get("num_local_experts")),
        "top_k": hf["num_experts_per_tok"],
        "expert_hidden": hf["moe_intermediate_size"],
        "n_dense_layers": n_dense,
        "dense_hidden": hf["intermediate_size"] if n_dense else None,
        "norm_topk_weights": bool(hf.get("norm_topk_prob", False)),
        "rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "qk_norm": True,
    }
    return MoEConfig(**{**fields, **overrides})


def _split_block(name: str) -> tuple[int, str] | None:
    if not name.startswith("blocks."):
        return None
    _, layer, rest = name.split(".", 2)
    return int(layer), rest


def _stacked_experts(name: str) -> bool:
    """Whether our logical tensor ``name`` stacks one HF tensor per expert along dim 0.

    Decided by the name, never by the number of HF names: with one expert the
    stack still has a leading dim of 1 that HF does not have.
    """
    split = _split_block(name)
    return split is not None and split[1] in _EXPERTS


def hf_names(name: str, cfg: MoEConfig) -> list[str]:
    """HF tensor names of our logical tensor ``name`` (one per expert for stacked experts)."""
    check_representable(cfg)
    if name == "head.weight" and cfg.tie_embeddings:
        return []
    if name in _TOP:
        return [_TOP[name]]
    split = _split_block(name)
    if split is not None:
        layer, rest = split
        prefix = f"model.layers.{layer}."
        if rest in _BLOCK:
            return [prefix + _BLOCK[rest]]
        if rest in _EXPERTS:
            return [f"{prefix}mlp.experts.{e}.{_EXPERTS[rest]}.weight" for e in range(cfg.n_experts)]
    raise ValueError(f"{name!r} has no Qwen3-MoE counterpart")


def convert_to_hf(name: str, tensor: torch.Tensor, cfg: MoEConfig) -> list[tuple[str, torch.Tensor]]:
    """HF tensors for our full logical tensor ``name`` (stacked experts -> one per expert)."""
    names = hf_names(name, cfg)
    if not _stacked_experts(name):
        return [(n, tensor) for n in names]
    if tensor.ndim != 3 or tensor.shape[0] != len(names):
        raise ValueError(
            f"{name}: expected the full logical tensor with {len(names)} experts, got shape "
            f"{tuple(tensor.shape)}"
        )
    return list(zip(names, tensor.unbind(0), strict=True))


def hf_shapes(cfg: MoEConfig) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor the model's weights read, with its shape (from the one table
    ``hf_names`` walks: the import is the export read backwards)."""
    check_representable(cfg)
    with torch.device("meta"):
        params = dict(MoETransformer(cfg).named_parameters())  # a tied head is the embedding
    out: dict[str, tuple[int, ...]] = {}
    for name, p in params.items():
        shape = tuple(p.shape[1:]) if _stacked_experts(name) else tuple(p.shape)
        out.update((n, shape) for n in hf_names(name, cfg))
    return out


class Qwen3MoeFolder:
    """A ``Qwen3MoeForCausalLM`` folder (``config.json`` and safetensors): its config, a check
    of its tensors, and any box of our logical tensors read lazily from it.

    Only the safetensors headers are read on opening; ``read`` fetches just the slices a
    box needs (one expert range of one layer, a run of rows), so each rank of a parallel
    run reads only what it holds. Errors are ``ValueError``s naming the folder and the
    tensor or key.
    """

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open

        self.path = path = Path(path)
        if not path.is_dir():
            raise ValueError(f"{path} is not a directory")
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} has no config.json: not a Hugging Face model folder")
        try:
            self.config: dict[str, Any] = json.loads((path / "config.json").read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path / 'config.json'}: not valid JSON ({e})") from None
        if not isinstance(self.config, dict) or self.config.get("model_type") != "qwen3_moe":
            got = self.config.get("model_type") if isinstance(self.config, dict) else None
            raise ValueError(f"{path / 'config.json'}: model_type {got!r} is not 'qwen3_moe' "
                             "(a Qwen3MoeForCausalLM folder)")
        index = path / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (path / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise ValueError(f"{path}: no model.safetensors or model.safetensors.index.json")
        self._where: dict[str, Any] = {}
        for f in files:
            handle = safe_open(str(path / f), framework="pt")
            self._where.update((k, handle) for k in handle.keys())

    def model_config(self, **overrides: Any) -> MoEConfig:
        """``MoEConfig`` of ``config.json``; ``overrides`` set training-only fields."""
        try:
            return config_from_hf(self.config, **overrides)
        except (KeyError, TypeError, ValueError) as e:
            what = f"no key {e.args[0]!r}" if isinstance(e, KeyError) else str(e)
            raise ValueError(f"{self.path / 'config.json'}: {what.removeprefix('config.json: ')}") \
                from None

    def check(self, cfg: MoEConfig) -> None:
        """Every tensor ``cfg``'s weights read is here with its shape, and nothing else is."""
        used: set[str] = set()
        for name, shape in hf_shapes(cfg).items():
            stored, got = self._locate(name)
            if stored is None:
                raise ValueError(f"{self.path}: tensor {name!r} is missing")
            if got != shape:
                raise ValueError(f"{self.path}: tensor {name!r} has shape {got}, the model of "
                                 f"its config.json needs {shape}")
            used.add(stored)
        unused = sorted(k for k in set(self._where) - used if not k.endswith(_IGNORED_HF))
        if unused:
            raise ValueError(f"{self.path}: tensor {unused[0]!r} is not part of a Qwen3-MoE model "
                             f"of this config.json ({len(unused)} such tensors)")

    def read(self, name: str, cfg: MoEConfig, offset: tuple[int, ...],
             shape: tuple[int, ...]) -> torch.Tensor:
        """The box at ``offset`` of ``shape`` of our logical tensor ``name`` (of ``cfg``'s
        model), in the stored dtype. Call ``check`` first: shapes are not checked here."""
        hf = hf_names(logical_name(name, cfg), cfg)
        index = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
        if not _stacked_experts(name):
            return self._read(hf[0], index)
        experts = range(index[0].start, index[0].stop)
        return torch.stack([self._read(hf[e], index[1:]) for e in experts])

    # A per-expert tensor stored in transformers 5's in-memory fused layout:
    # experts.gate_up_proj [E, 2F, D] (gate rows first), experts.down_proj [E, D, F].
    def _fused(self, name: str) -> tuple[str, int, int] | None:
        """(stored fused name, expert, row offset) of per-expert tensor ``name``, if fused."""
        head, sep, tail = name.partition(".mlp.experts.")
        if not sep or tail.count(".") != 2:
            return None
        expert, proj, _ = tail.split(".")
        fused = f"{head}.mlp.experts.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
        if fused not in self._where or not expert.isdigit():
            return None
        n_experts, rows = self._where[fused].get_slice(fused).get_shape()[:2]
        if int(expert) >= n_experts:
            return None
        half = rows // 2
        return fused, int(expert), half if proj == "up_proj" else 0

    def _locate(self, name: str) -> tuple[str | None, tuple[int, ...]]:
        """(stored tensor holding ``name``, ``name``'s shape); (None, ()) when absent."""
        if name in self._where:
            return name, tuple(self._where[name].get_slice(name).get_shape())
        fused = self._fused(name)
        if fused is None:
            return None, ()
        stored = fused[0]
        _, dim1, dim2 = self._where[stored].get_slice(stored).get_shape()
        return stored, (dim1 if stored.endswith("down_proj") else dim1 // 2, dim2)

    def _read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        if name in self._where:
            return self._where[name].get_slice(name)[index]
        fused = self._fused(name)
        assert fused is not None, name  # check() found every name
        stored, expert, rows = fused
        first, second = index
        return self._where[stored].get_slice(stored)[
            expert, first.start + rows:first.stop + rows, second]


def from_pretrained(path: str | Path, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu", **overrides: Any) -> MoETransformer:
    """Load a ``Qwen3MoeForCausalLM`` checkpoint folder into a new ``MoETransformer``.

    ``overrides`` set training-only ``MoEConfig`` fields (e.g. ``recompute="block"``).
    Unknown tensors in the checkpoint are an error, as are missing ones.
    """
    folder = Qwen3MoeFolder(path)
    cfg = folder.model_config(**overrides)
    folder.check(cfg)
    with torch.device("meta"):
        model = MoETransformer(cfg)
    model.to_empty(device=device)
    model.tie_weights()
    model.to(dtype)
    state = {name: folder.read(name, cfg, (0,) * t.ndim, tuple(t.shape))
             for name, t in model.state_dict().items()}
    model.load_state_dict(state, strict=True)
    return model


def save_pretrained(model: MoETransformer, path: str | Path, dtype: torch.dtype | None = None,
                    max_position_embeddings: int = 32768) -> None:
    """Write ``model`` (whole, unpartitioned) as a checkpoint ``transformers`` loads.

    ``dtype``: the stored dtype (default: the parameters' dtype).
    """
    cfg: MoEConfig = model.config
    check_representable(cfg)
    missing = [n for n in ("embed", "norm", "head") if getattr(model, n) is None]
    missing += [f"blocks.{i}" for i in range(cfg.n_layers) if str(i) not in model.blocks]
    missing += [f"{n}.experts (holds {layer.experts.expert_range})"
                for n, layer in model.moe_layers() if layer.experts.n_local != cfg.n_experts]
    if missing:
        raise ValueError(f"save_pretrained needs the whole model; this one lacks {missing}")
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        for hf_name, hf_t in convert_to_hf(name, t, cfg):
            tensors[hf_name] = hf_t.detach().to("cpu", dtype or hf_t.dtype).contiguous()
    stored = dtype or next(model.parameters()).dtype
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = hf_config(cfg, stored, max_position_embeddings)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
