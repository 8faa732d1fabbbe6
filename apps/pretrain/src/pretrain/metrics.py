"""Per-step metrics: one JSON object per optimizer step, plus a progress line."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, TextIO


class MetricsWriter:
    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "metrics.jsonl"
        self._file: TextIO = self.path.open("a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")

    def close(self) -> None:
        self._file.close()


def progress_line(record: dict[str, Any], total_steps: int) -> str:
    return (
        f"step {record['step']:>5}/{total_steps}  loss {record['loss']:.4f}  "
        f"lr {record['lr']:.2e}  grad_norm {record['grad_norm']:.3f}  "
        f"tok/s {record['tokens_per_s']:,.0f}"
    )
