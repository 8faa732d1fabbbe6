"""Sample text from a checkpoint or a Hugging Face Qwen3-MoE folder (CPU or one GPU).

    pretrain generate SOURCE --prompt TEXT [--max-new-tokens N] [--temperature T]
                             [--top-k K] [--seed S] [--tokenizer PATH] [--device D]
"""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "sample text from a checkpoint or a Hugging Face Qwen3-MoE folder"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", type=Path, metavar="SOURCE",
                        help="a checkpoint directory (RUN_DIR/checkpoints/step_N) or a Hugging "
                             "Face folder with config.json (e.g. one export-hf wrote)")
    parser.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                        help="tokens to generate at most (default: 64; fewer when the model "
                             "ends the text)")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T",
                        help="0: greedy (default); otherwise sample from softmax(logits / T)")
    parser.add_argument("--top-k", type=int, default=None, metavar="K",
                        help="sample among the K most likely tokens only (with --temperature > 0)")
    parser.add_argument("--seed", type=int, default=0, metavar="S",
                        help="seed of the sampling (default: 0)")
    parser.add_argument("--tokenizer", type=Path, default=None, metavar="PATH",
                        help="a tokenizers JSON file or a folder with tokenizer.json (default: "
                             "the source's own)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: the GPU when there is one (default)")


def run(args: argparse.Namespace) -> int:
    from pretrain.cli import fail

    if args.max_new_tokens < 1:
        return fail(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}", 2)
    if not args.temperature >= 0:
        return fail(f"--temperature must be >= 0, got {args.temperature}", 2)
    if args.top_k is not None and args.top_k < 1:
        return fail(f"--top-k must be >= 1, got {args.top_k}", 2)

    import torch
    from moe_model import generate

    from pretrain.inference import default_device, default_dtype, load_model

    device = default_device(args.device)
    loaded, tokenizer = load_model(args.source, device, default_dtype(device), args.tokenizer)
    ids = tokenizer.encode(args.prompt).ids
    if not ids:
        return fail("--prompt encodes to no tokens", 2)
    vocab = loaded.model.config.vocab_size
    if max(ids) >= vocab:
        return fail(f"--prompt: token id {max(ids)} is outside the model's vocabulary of {vocab} "
                    "(another tokenizer?)", 1)
    new = generate(loaded.model, torch.tensor([ids]), args.max_new_tokens, args.temperature,
                   args.top_k, args.seed, loaded.eos_id)
    print(args.prompt + tokenizer.decode(new[0].tolist()), flush=True)
    return 0
