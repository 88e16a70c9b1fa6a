"""`pagedllm export-tiny`: the built-in tiny model as a checkpoint folder (and a LoRA
adapter), to try --model, LoRA and draft models with."""

from __future__ import annotations

import argparse

from pagedllm.cli.flags import EPILOG, POSITIVE, common_flags


def add_parser(sub) -> argparse.ArgumentParser:
    """The `export-tiny` subcommand's parser."""
    export = sub.add_parser(
        "export-tiny",
        help="write the built-in tiny model as a checkpoint folder (and a LoRA adapter) to try "
        "--model, LoRA and draft models with",
        epilog=EPILOG,
    )
    export.add_argument("folder", help="where to write it (must not exist, or be empty)")
    export.add_argument(
        "--family",
        default="llama",
        # tiny_random.FAMILIES, spelled out: importing it would import torch before --help
        choices=["llama", "qwen2", "qwen3"],
        help="the architecture written (llama with --seed 0 is pagedllm/tiny-random itself)",
    )
    export.add_argument(
        "--num-layers",
        type=POSITIVE,
        default=None,
        help="keep the first N of the 4 layers: a draft model for the full one (default: all)",
    )
    export.add_argument(
        "--with-adapter",
        action="store_true",
        help="also write a random PEFT LoRA adapter for it in FOLDER/adapter",
    )
    export.add_argument("--seed", type=int, default=0, help="random seed of the weights")
    common_flags(export)
    return export


def run(args: argparse.Namespace) -> int:
    from pagedllm.cli.export_tiny import export_tiny

    written = export_tiny(
        args.folder,
        family=args.family,
        num_layers=args.num_layers,
        with_adapter=args.with_adapter,
        seed=args.seed,
    )
    folder = written["model"]
    layers = f"its first {args.num_layers} layers, " if args.num_layers else ""
    print(f"{folder}: the tiny random model as a {args.family} checkpoint ({layers}byte tokenizer)")
    print(f"  try: pagedllm generate --model {folder} 'Hello'")
    if "adapter" in written:
        print(f"{written['adapter']}: a PEFT LoRA adapter for it")
        print(
            f"  try: pagedllm serve --model {folder} --lora-modules tiny-lora={written['adapter']}"
        )
    return 0
