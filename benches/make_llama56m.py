"""Save the benchmarks' 56M-parameter random Llama (hidden 512, 8 layers, 8 heads / 4 KV heads,
intermediate 1376, vocabulary 32000, untied, float32) to a folder, for `pagedllm bench --model`.

    python benches/make_llama56m.py /tmp/<your-dir>/llama56m
"""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    config = LlamaConfig(
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=1376,
        vocab_size=32000,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    model.save_pretrained(args.folder)


if __name__ == "__main__":
    main()
