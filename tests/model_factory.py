"""Tiny random Hugging Face checkpoints and a paged-cache driver, shared by the model tests.

- `tiny_hf_config(family, ...)`: a small `transformers` config for "llama" (Llama 3.1-style
  `llama3` rope scaling), "qwen2" (qkv bias) or "qwen3" (q/k norm, explicit head_dim).
- `save_tiny_checkpoint(folder, family, ...)`: random weights (seeded, scaled so logits are far
  from uniform), saved as safetensors (sharded with `max_shard_size`), plus tokenizer files:
  `tokenizer="json"` (tokenizer.json), `"vocab_merges"` (no tokenizer.json: AutoTokenizer path)
  or `None` (no tokenizer at all).
- `save_truncated_checkpoint(target, folder, num_layers)`: `target`'s first layers only (a
  draft model for speculative decoding).
- `PagedRunner`: runs our model step by step over a paged KV cache with random, non-contiguous
  block tables and hand-built AttentionMetadata, the way the engine will.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from pagedllm.attention.paged import AttentionMetadata

FAMILIES = ("llama", "qwen2", "qwen3")
VOCAB_SIZE = 320  # > the tokenizer's vocabulary, as in real checkpoints
TOKENIZER_VOCAB_SIZE = 300
BOS_ID, EOS_ID = 0, 1  # "<s>", "</s>" are the first two entries of the tiny tokenizer
_TOKENIZER_CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "paged attention keeps the KV cache in fixed-size blocks.",
    "Größe, naïve café — unicode text 123 456.",
]
_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
)


def tiny_hf_config(
    family: str, *, tie_word_embeddings: bool = False, **overrides
) -> PretrainedConfig:
    """A tiny transformers config of the family (see module docstring)."""
    kwargs = dict(_COMMON, tie_word_embeddings=tie_word_embeddings)
    if family == "llama":
        # small original context so that all three llama3 frequency bands occur with head_dim 16
        kwargs["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        kwargs["rope_theta"] = 10000.0
        config_class = LlamaConfig
    elif family == "qwen2":
        kwargs["rope_theta"] = 1000000.0
        config_class = Qwen2Config
    elif family == "qwen3":
        kwargs["head_dim"] = 24  # deliberately != hidden_size / num_attention_heads
        config_class = Qwen3Config
    else:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    kwargs.update(overrides)
    return config_class(**kwargs)


def randomize_weights(model: torch.nn.Module, seed: int) -> None:
    """Re-draw every parameter so that biases and norm weights matter and logits are spread out."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied parameters appear once
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.1 * noise)
            elif "embed_tokens" in name:
                param.copy_(noise)
            else:
                param.copy_(noise / math.sqrt(param.shape[1]))


def build_hf_model(config: PretrainedConfig, seed: int = 0) -> torch.nn.Module:
    """A float32 transformers model of `config` with `randomize_weights(seed)`."""
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model, seed)
    return model.eval()


def save_tiny_checkpoint(
    folder: str | Path,
    family: str,
    *,
    tie_word_embeddings: bool = False,
    max_shard_size: str | None = None,
    tokenizer: str | None = "json",
    seed: int = 0,
    **overrides,
) -> Path:
    """Write a tiny random checkpoint of `family` into `folder` and return the folder."""
    folder = Path(folder)
    config = tiny_hf_config(family, tie_word_embeddings=tie_word_embeddings, **overrides)
    model = build_hf_model(config, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    if tokenizer is not None:
        save_tiny_tokenizer(folder, tokenizer)
    return folder


def save_truncated_checkpoint(target: str | Path, folder: str | Path, num_layers: int) -> Path:
    """A copy of checkpoint `target` keeping only its first `num_layers` decoder layers: a
    smaller model with the same vocabulary whose predictions often agree with the target's
    (a speculative draft model)."""
    from safetensors.torch import load_file, save_file

    target, folder = Path(target), Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for file in target.iterdir():
        if file.suffix != ".safetensors" and file.is_file():
            (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (folder / "config.json").write_text(json.dumps(config))
    for file in target.glob("*.safetensors"):
        kept = {
            name: tensor
            for name, tensor in load_file(file).items()
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers
        }
        save_file(kept, folder / file.name, metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.exists():  # sharded: the index must not name the dropped tensors
        data = json.loads(index.read_text())
        data["weight_map"] = {
            name: shard
            for name, shard in data["weight_map"].items()
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers
        }
        index.write_text(json.dumps(data))
    return folder


def build_tiny_tokenizer() -> Tokenizer:
    """A byte-level BPE (GPT-2 style) trained on a fixed corpus; prepends <s> like Llama."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TOKENIZER_CORPUS * 4, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    return tok


def save_tiny_tokenizer(folder: str | Path, fmt: str = "json") -> None:
    """`fmt` "json": tokenizer.json; "vocab_merges": only vocab.json + merges.txt
    (GPT2Tokenizer)."""
    folder = Path(folder)
    tok = build_tiny_tokenizer()
    config = {"bos_token": "<s>", "eos_token": "</s>"}
    if fmt == "json":
        tok.save(str(folder / "tokenizer.json"))
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    elif fmt == "vocab_merges":
        tok.model.save(str(folder))
        config.update(tokenizer_class="GPT2Tokenizer", add_bos_token=True)
    else:
        raise ValueError(f"unknown tokenizer format {fmt!r}")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@dataclass
class _Sequence:
    tokens: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)


class PagedRunner:
    """Drives `model(input_ids, positions, kv_cache, meta)` for several sequences, step by step.

    Blocks come from a shuffled free list, so block tables are random and non-contiguous.
    """

    def __init__(
        self, model: torch.nn.Module, *, num_blocks: int = 64, block_size: int = 4, seed: int = 0
    ):
        cfg = model.config
        self.model, self.block_size = model, block_size
        dtype = next(model.parameters()).dtype
        device = next(model.parameters()).device
        self.kv_cache = torch.zeros(
            2,
            cfg.num_layers,
            num_blocks,
            block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            dtype=dtype,
            device=device,
        )
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.seqs: dict[str, _Sequence] = {}

    def step(self, new_tokens: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """Append `new_tokens` to each named sequence in one packed forward; logits [n, V] per
        sequence."""
        for name, tokens in new_tokens.items():
            self._grow(self.seqs.setdefault(name, _Sequence()), len(tokens))
        input_ids, positions, slots, starts = [], [], [], [0]
        for name, tokens in new_tokens.items():
            seq = self.seqs[name]
            first = len(seq.tokens)
            seq.tokens.extend(tokens)
            input_ids += tokens
            positions += range(first, len(seq.tokens))
            slots += [self._slot(seq, pos) for pos in range(first, len(seq.tokens))]
            starts.append(starts[-1] + len(tokens))
        meta = self._metadata(list(new_tokens), slots, starts)
        device = self.kv_cache.device
        with torch.no_grad():
            hidden = self.model(
                torch.tensor(input_ids, dtype=torch.int64, device=device),
                torch.tensor(positions, dtype=torch.int64, device=device),
                self.kv_cache,
                meta,
            )
            logits = self.model.compute_logits(hidden)
        return {name: logits[starts[i] : starts[i + 1]] for i, name in enumerate(new_tokens)}

    def tokens(self, name: str) -> list[int]:
        return list(self.seqs[name].tokens)

    def _grow(self, seq: _Sequence, num_new: int) -> None:
        needed = -(-(len(seq.tokens) + num_new) // self.block_size)
        while len(seq.blocks) < needed:
            seq.blocks.append(self.free_blocks.pop())

    def _slot(self, seq: _Sequence, pos: int) -> int:
        return seq.blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def _metadata(self, names: list[str], slots: list[int], starts: list[int]) -> AttentionMetadata:
        seqs = [self.seqs[name] for name in names]
        width = max(len(seq.blocks) for seq in seqs)
        tables = [seq.blocks + [0] * (width - len(seq.blocks)) for seq in seqs]
        query_lens = [b - a for a, b in zip(starts, starts[1:])]
        device = self.kv_cache.device
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(
                [len(seq.tokens) for seq in seqs], dtype=torch.int32, device=device
            ),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            max_query_len=max(query_lens),
            max_seq_len=max(len(seq.tokens) for seq in seqs),
            is_decode_only=all(n == 1 for n in query_lens),
        )


def paged_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation of one prompt through the paged cache (prefill, then decode steps)."""
    runner = PagedRunner(model, num_blocks=-(-(len(prompt) + max_new_tokens) // 4))
    logits = runner.step({"s": prompt})["s"][-1]
    out: list[int] = []
    while True:
        out.append(int(logits.argmax()))
        if len(out) == max_new_tokens:
            return out
        logits = runner.step({"s": [out[-1]]})["s"][-1]


def hf_generate_greedy(
    model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """transformers' greedy `generate` of a loaded model (on its device): exactly
    `max_new_tokens` per prompt (no stop on EOS, like `ignore_eos`), one prompt at a time."""
    model.generation_config.eos_token_id = None
    device = next(model.parameters()).device
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        outs.append(out[0, len(prompt) :].tolist())
    return outs
