"""Launch counts per direction for the configurations test_launch_count.py compares (JSON), then ``ok``.

Run under ``TRITON_INTERPRET=1`` (``moe_testing.run_under_triton_interpreter``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") == "1"
sys.path.insert(0, str(Path(__file__).parent))
from _launch_counter import count_directions  # noqa: E402

# (EP ranks, experts): the counts must not grow with either.
CONFIGS = ((2, 8), (2, 64), (4, 8))

if __name__ == "__main__":
    for combine in ("source", "destination"):
        for ranks, experts in CONFIGS:
            print(json.dumps({"combine": combine, "ranks": ranks, "experts": experts,
                              "counts": count_directions(combine, experts, ranks)}))
    print("ok")
