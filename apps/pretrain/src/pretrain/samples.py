"""What the model writes during training: prompts completed at each evaluation.

``PromptSamples(prompts, max_new_tokens, tokenizer, path)`` is built once per run;
calling it with the model and the step completes every prompt greedily with
``max_new_tokens`` tokens (cut at the data's end of text) and appends one JSON
line per prompt to ``path`` (``RUN_DIR/samples.jsonl``)::

    {"step": 500, "prompt": "def main(", "completion": "):\\n    return 0\\n"}

Every rank holding a whole model (one process, data or expert parallelism) calls
it at the same step: each generates the same fixed number of tokens, so the
ranks of an expert-parallel group run the same forwards together (a rank that
stopped early at its end of text would leave the others waiting). Only the rank
given a ``path`` writes. A pipeline stage holds no whole model and is refused.
The model's training mode is left as it is; the forwards run without gradients,
record no routing statistics and drop no slot (``moe_model.dropless_dispatch``: a
training capacity would drop prefill tokens of a short prompt, which inference
does not).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from moe_model import MoETransformer, dropless_dispatch, generate

from pretrain.tokenizer_files import TokenizerError, load_tokenizer

SAMPLES_FILE = "samples.jsonl"


class PromptSamples:
    def __init__(self, prompts: Sequence[str], max_new_tokens: int, tokenizer: dict[str, Any],
                 path: Path | None) -> None:
        """``tokenizer``: the run's record (``pretrain.tokenizer_files.data_tokenizer``)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if tokenizer.get("json") is None:
            raise TokenizerError(f"eval.prompts needs the data's tokenizer; {tokenizer.get('name')!r} "
                                 "data has none")
        self.tokenizer = load_tokenizer(tokenizer["json"], "the data's tokenizer")
        self.eos_id: int | None = tokenizer.get("eos_id")
        self.prompts = list(prompts)
        self.ids = [self.tokenizer.encode(p).ids for p in self.prompts]
        empty = [p for p, ids in zip(self.prompts, self.ids, strict=True) if not ids]
        if empty:
            raise TokenizerError(f"eval.prompts: {empty[0]!r} encodes to no tokens")
        self.max_new_tokens, self.path = max_new_tokens, path

    def __call__(self, model: MoETransformer, step: int) -> list[dict[str, Any]]:
        """Complete every prompt; the records (also appended to ``path`` when given)."""
        if model.embed is None or model.head is None:
            raise ValueError("eval.prompts needs the whole model on each rank (no pipeline stages)")
        device = next(model.parameters()).device
        records = []
        for prompt, ids in zip(self.prompts, self.ids, strict=True):
            with dropless_dispatch(model):  # as inference runs it: no prompt token dropped
                new = generate(model, torch.tensor([ids], device=device), self.max_new_tokens)[0].tolist()
            if self.eos_id is not None and self.eos_id in new:
                new = new[:new.index(self.eos_id)]
            records.append({"step": step, "prompt": prompt, "completion": self.tokenizer.decode(new)})
        if self.path is not None:
            with self.path.open("a") as f:
                f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        return records
