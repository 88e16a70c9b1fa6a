"""Greedy parity of pagedllm's GGUF path with `transformers` loading the same file (weights
dequantized to float32): 8 chat prompts, 64 tokens each, teacher-forced (transformers' argmax
after every prefix of our answer must be our next token), for each file given.

    python benches/gguf_parity.py /work/models/smollm2-Q8_0.gguf /work/models/smollm2-Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from pagedllm import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "How many legs does a spider have?",
    "What is the boiling point of water in Celsius?",
    "Who wrote Romeo and Juliet?",
    "Name three primary colors.",
    "What is the largest planet in the solar system?",
    "Give me a short tip for learning to code.",
    "Translate 'good morning' into Spanish.",
]


def parity(path: Path, max_tokens: int) -> tuple[int, int, int]:
    """(prompts whose answers are equal, tokens equal up to the first difference, tokens)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    reference = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    prompts = []
    for q in QUESTIONS:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    llm = LLM(str(path), max_model_len=512, cpu_kv_cache_space=0.25)
    outs = llm.generate(
        [{"prompt_token_ids": ids} for ids in prompts],
        SamplingParams(max_tokens=max_tokens, temperature=0),
        use_tqdm=False,
    )
    equal_prompts = equal_tokens = total = 0
    for ids, out in zip(prompts, outs):
        ours = list(out.outputs[0].token_ids)
        with torch.no_grad():
            logits = reference(torch.tensor([ids + ours])).logits[0]
        expected = logits[len(ids) - 1 : -1].argmax(-1).tolist()
        same = next((i for i, (a, b) in enumerate(zip(ours, expected)) if a != b), len(ours))
        equal_prompts += same == len(ours)
        equal_tokens += same
        total += len(ours)
    return equal_prompts, equal_tokens, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    print("| file | prompts equal | tokens equal before a difference / tokens |")
    print("|---|---:|---:|")
    for path in args.files:
        prompts, tokens, total = parity(path, args.max_tokens)
        print(f"| {path.name} | {prompts}/{len(QUESTIONS)} | {tokens}/{total} |")


if __name__ == "__main__":
    main()
