"""The built-in configs ``--config NAME`` names: trees of dotted keys over the defaults.

Kept apart from the config dataclasses so that the command line can list them
without importing the model (``pretrain --help`` stays fast).
"""

from __future__ import annotations

from typing import Any

_BENCH_MODEL = {
    "vocab_size": 100352, "d_model": 2048, "n_layers": 8, "n_heads": 16, "n_kv_heads": 4,
    "head_dim": 128, "n_experts": 64, "top_k": 8, "expert_hidden": 1024,
}
_BENCH_TRAIN = {"steps": 20, "seq_len": 4096, "global_batch": 64, "micro_batch": 2}

PRESETS: dict[str, dict[str, Any]] = {
    # The embedded default: the stdlib corpus, a couple of minutes on two CPU cores.
    "default": {},
    # Seconds on a CPU; used by the tests. Global batch 8 of micro batch 2 splits evenly over
    # 1, 2 and 4 data-parallel ranks with the same microbatches, so those layouts compare exactly.
    "tiny": {
        "model": {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16,
                  "n_experts": 4, "top_k": 2, "expert_hidden": 64},
        "train": {"steps": 4, "seq_len": 32, "global_batch": 8, "micro_batch": 2},
        "optim": {"warmup_steps": 2},
        "metrics": {"expert_load_every": 1},
    },
    # Throughput benchmarks on H200s: synthetic tokens, bf16 compute (docs/performance.md).
    "bench-1gpu": {
        "model": _BENCH_MODEL,
        # the microbatches replayed from CUDA graphs: +0.9 to +2.4% on one H200, the device
        # idle 26 ms per step instead of ~60 (tools/bench_train_step.py --config bench-1gpu
        # with and without train.cuda_graphs=false)
        "train": {**_BENCH_TRAIN, "cuda_graphs": True},
        "optim": {"warmup_steps": 5},
        "data": {"path": "synthetic"},
        "checkpoint": {"final": False},  # a throughput measurement keeps no weights
        # four microbatches' expert weight gradients per launch: +3.5% for 7 GiB at 2, +1.5%
        # more for 14 GiB more at 4 (95.5 of 141 GB; tools/bench_train_step.py --config
        # bench-1gpu parallel.merge_expert_grad_microbatches=1|2|4); bench-2gpu keeps 1, which
        # EP2 needs (at 2 it ran out of memory on two H200s; DP2 ran +6% at 2,
        # docs/performance.md)
        "parallel": {"merge_expert_grad_microbatches": 4},
    },
    "bench-2gpu": {
        "model": {**_BENCH_MODEL, "n_layers": 16},
        "train": _BENCH_TRAIN,
        "optim": {"warmup_steps": 5},
        "data": {"path": "synthetic"},
        "checkpoint": {"final": False},
    },
}
