"""Export a checkpoint to Hugging Face safetensors shards, in one CPU process.

moe-ckpt knows nothing of any model: the caller says which stored tensors are
model weights (``select``), how one becomes Hugging Face tensors (``convert``,
e.g. splitting stacked experts), and what ``config.json`` holds. Tensors are read
one at a time whatever layout saved them, converted, cast to BF16 (floating
point only; integer buffers keep their dtype), and packed in stored order into
shards of at most ``max_shard_bytes`` (a single tensor larger than the cap gets a
shard of its own). The export is written to a temporary sibling directory and
renamed into place, so ``out_dir`` is complete or absent.

Every file gets the permissions of an ordinary file this process creates (0o666
less the umask, e.g. 0644). ``safetensors.torch.save_file`` (0.8 at least) writes
each shard to a private temporary file (mode 0600) and renames it over the target,
so the shards are given ``config.json``'s mode: otherwise a shared export would be
unreadable to other users.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from moe_ckpt.load import open_checkpoint, read_tensors

Converter = Callable[[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]
INDEX_NAME = "model.safetensors.index.json"


def export_hf(
    checkpoint_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    convert: Converter,
    select: Callable[[str], bool],
    config: Mapping[str, Any],
    max_shard_bytes: int = 5 * 10**9,
    dtype: torch.dtype = torch.bfloat16,
    files: Mapping[str, str] | None = None,
) -> Path:
    """Write ``model-XXXXX-of-YYYYY.safetensors``, ``model.safetensors.index.json``
    and ``config.json`` into ``out_dir`` (which must not exist); return its path.

    ``files``: more text files for the folder, by plain file name (the tokenizer's,
    ``generation_config.json``), written with the rest: all or nothing."""
    for name in files or {}:
        if not name or Path(name).name != name or name in (".", "..", INDEX_NAME, "config.json"):
            raise ValueError(f"files: {name!r} must be a plain file name other than the export's own")
    out = Path(out_dir).absolute()
    if out.exists():
        raise FileExistsError(f"export directory {out} already exists")
    manifest = open_checkpoint(checkpoint_dir)
    names = [n for n in manifest.tensors if select(n)]
    if not names:
        raise ValueError(
            f"select() chose none of the {len(manifest.tensors)} tensors in {checkpoint_dir}"
        )
    tmp = out.with_name(f".{out.name}.partial-{uuid.uuid4().hex}")
    tmp.mkdir(parents=True)
    try:
        # Written first: an ordinary file, whose mode (umask applied, as for any file
        # this process creates) the shards copy.
        (tmp / "config.json").write_text(json.dumps(dict(config), indent=2) + "\n")
        file_mode = stat.S_IMODE(os.stat(tmp / "config.json").st_mode)
        for name, text in (files or {}).items():
            (tmp / name).write_text(text)
        shard_files, weight_map, total = _write_shards(
            checkpoint_dir, names, convert, dtype, max_shard_bytes, tmp, file_mode
        )
        final_names = {
            f: f"model-{i + 1:05d}-of-{len(shard_files):05d}.safetensors"
            for i, f in enumerate(shard_files)
        }
        for f, final in final_names.items():
            os.rename(tmp / f, tmp / final)
        index = {
            "metadata": {"total_size": total},
            "weight_map": {k: final_names[v] for k, v in sorted(weight_map.items())},
        }
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_shards(
    checkpoint_dir: str | os.PathLike,
    names: list[str],
    convert: Converter,
    dtype: torch.dtype,
    max_shard_bytes: int,
    tmp: Path,
    file_mode: int,
) -> tuple[list[str], dict[str, str], int]:
    files: list[str] = []
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = total = 0

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            files.append(f"part-{len(files):05d}.safetensors")
            save_file(shard, str(tmp / files[-1]), metadata={"format": "pt"})
            # safetensors created it 0600 (a temporary file renamed into place).
            os.chmod(tmp / files[-1], file_mode)
            for k in shard:
                weight_map[k] = files[-1]
            shard, shard_bytes = {}, 0

    for name, full in read_tensors(checkpoint_dir, names):
        for hf_name, t in convert(name, full):
            if hf_name in weight_map or hf_name in shard:
                raise ValueError(f"convert() produced {hf_name!r} twice (last from {name!r})")
            # A copy: converters may return views sharing storage, which safetensors refuses.
            t = (
                t.detach()
                .to(dtype=dtype if t.is_floating_point() else t.dtype, copy=True)
                .contiguous()
            )
            nbytes = t.numel() * t.element_size()
            if shard and shard_bytes + nbytes > max_shard_bytes:
                flush()
            shard[hf_name] = t
            shard_bytes += nbytes
            total += nbytes
    flush()
    return files, weight_map, total
