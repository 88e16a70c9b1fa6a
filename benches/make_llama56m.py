"""The benchmark model of the CPU comparisons (benches/RESULTS.md): a random-weight Llama of
~56M parameters (hidden 512, 8 layers, 8 heads / 4 KV heads, intermediate 1376, vocabulary
32000, untied) saved by `transformers`, with a byte-level BPE tokenizer of 32,000 tokens trained
on seeded random text (so detokenizing costs what a real 32k vocabulary costs).

    python benches/make_llama56m.py /tmp/llama56m
"""

from __future__ import annotations

import json
import random
import string
import sys
from pathlib import Path


def corpus(seed: int, words: int = 400_000) -> list[str]:
    """Lines of Zipf-distributed random words (lowercase, 2..9 letters)."""
    rng = random.Random(seed)
    lexicon = [
        "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9)))
        for _ in range(50_000)
    ]
    weights = [1.0 / (rank + 1) for rank in range(len(lexicon))]
    drawn = rng.choices(lexicon, weights=weights, k=words)
    return [" ".join(drawn[i : i + 16]) for i in range(0, words, 16)]


def main(folder: str, seed: int = 0) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=32_000,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    # the trained tokenizer as it is (save_pretrained of a wrapping PreTrainedTokenizerFast
    # may rebuild it), with the config naming its special tokens
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": 2048,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=32_000,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out)
    print(out, sum(p.numel() for p in model.parameters()) / 1e6, "M parameters")


if __name__ == "__main__":
    main(sys.argv[1])
