"""The built-in default model `pagedllm/tiny-random`: a small Llama with seeded random weights.

It needs no files, so every engine feature runs on a fresh machine; its text is gibberish.
Weights are drawn on the CPU from one seeded generator in a fixed parameter order, then moved,
so they are identical across runs and machines. Scales keep every layer's contribution O(1):
unit-variance embeddings, 1/sqrt(fan_in) projections (attention scores ~ N(0, 1), so attention
is neither uniform nor one-hot) and a sharper output head so greedy choices vary with context.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch

from pagedllm.config import TINY_RANDOM_MODEL
from pagedllm.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeConfig
from pagedllm.models.decoder import DecoderForCausalLM
from pagedllm.tokenizer import BYTE_BOS_ID, BYTE_EOS_ID, BYTE_PAD_ID, BYTE_VOCAB_SIZE

MODEL_NAME = TINY_RANDOM_MODEL
DEFAULT_SEED = 0
_HEAD_GAIN = 3.0  # logits std ~3: peaked enough that the greedy token depends on the context


# what sets each family apart in the tiny shapes (as a checkpoint of the family would say); the
# sliding-window families (Mistral, Gemma) have no built-in tiny model
_FAMILY_FLAGS = {"llama": {}, "qwen2": {"qkv_bias": True}, "qwen3": {"qk_norm": True}}
FAMILIES = tuple(_FAMILY_FLAGS)


def tiny_random_config(family: str = "llama") -> ModelConfig:
    """A 4-layer Llama (hidden 256, 8 heads, 4 kv heads, head_dim 32) over the byte vocabulary;
    `family` "qwen2" / "qwen3" gives the same shapes with that family's flags (q/k/v bias, q/k
    norm)."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {list(FAMILIES)}, got {family!r}")
    architecture = next(a for a, f in SUPPORTED_ARCHITECTURES.items() if f == family)
    cfg = ModelConfig(
        architecture="LlamaForCausalLM",
        family="llama",
        num_layers=4,
        hidden_size=256,
        intermediate_size=688,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        vocab_size=BYTE_VOCAB_SIZE,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope=RopeConfig(theta=10000.0),
        tie_word_embeddings=False,
        bos_token_id=BYTE_BOS_ID,
        eos_token_ids=(BYTE_EOS_ID,),
        pad_token_id=BYTE_PAD_ID,
        checkpoint_dtype="float32",
        path=None,
    )
    return dataclasses.replace(
        cfg, architecture=architecture, family=family, **_FAMILY_FLAGS[family]
    )


def build_tiny_random(
    cfg: ModelConfig | None = None,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = DEFAULT_SEED,
) -> DecoderForCausalLM:
    """The tiny model with weights from `torch.Generator().manual_seed(seed)`."""
    cfg = cfg or tiny_random_config()
    with torch.device("meta"):
        model = DecoderForCausalLM(cfg)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    state = {
        name: _random_weight(name, tuple(param.shape), generator).to(device=device, dtype=dtype)
        for name, param in model.state_dict().items()
    }
    model.load_state_dict(state, strict=True, assign=True)
    model.reset_rotary()
    return model.requires_grad_(False).eval()


def _random_weight(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    weight = torch.randn(shape, generator=generator)
    if name == "model.embed_tokens.weight":
        return weight
    gain = _HEAD_GAIN if name == "lm_head.weight" else 1.0
    return weight * (gain / math.sqrt(shape[1]))


def save_byte_tokenizer(folder: str | Path) -> None:
    """The tiny model's byte tokenizer as `tokenizer.json` + `tokenizer_config.json`: byte b is
    token b, then <s>, </s>, <pad>; encoding prepends <s>, as `ByteTokenizer` does."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    # byte-level BPE spells byte b as the printable character GPT-2's table gives it
    tok = Tokenizer(models.BPE(vocab={_gpt2_byte_char(b): b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = {BYTE_BOS_ID: "<s>", BYTE_EOS_ID: "</s>", BYTE_PAD_ID: "<pad>"}
    # added after the 256 bytes, in id order: they take exactly those ids
    tok.add_special_tokens([AddedToken(t, special=True) for _, t in sorted(specials.items())])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", BYTE_BOS_ID)]
    )
    folder = Path(folder)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _gpt2_byte_char(b: int) -> str:
    """GPT-2's byte -> character table: printable Latin-1 bytes stand for themselves, the
    others take the characters from 256 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    if b in printable:
        return chr(b)
    return chr(256 + sum(1 for other in range(b) if other not in printable))
