"""Tokenizers behind one small interface: `encode`, `decode`, `eos_token_id`, `bos_token_id`,
`vocab_size`.

- `HFTokenizer`: a checkpoint's `tokenizer.json` through the `tokenizers` library (fast, no
  transformers needed); special tokens named in `tokenizer_config.json`.
- `AutoTokenizerAdapter`: `transformers.AutoTokenizer` for folders without `tokenizer.json`.
- `ByteTokenizer`: 256 byte tokens + BOS/EOS/PAD, for the built-in `pagedllm/tiny-random`.

`encode` adds the BOS token exactly when the model's own tokenizer would (its post-processor).
`decode` never raises on a partial sequence: incomplete UTF-8 becomes U+FFFD.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pagedllm.checkpoint.packaged import PACKAGED_MODELS
from pagedllm.config import TINY_RANDOM_MODEL

if TYPE_CHECKING:
    from pagedllm.checkpoint.gguf_reader import GGUFFile

BYTE_BOS_ID = 256
BYTE_EOS_ID = 257
BYTE_PAD_ID = 258
BYTE_VOCAB_SIZE = 259
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"


class TokenizerLoadError(ValueError):
    """No usable tokenizer in a folder, or a malformed tokenizer file (the message names it)."""


@runtime_checkable
class Tokenizer(Protocol):
    """What the engine uses of a tokenizer."""

    eos_token_id: int | None
    bos_token_id: int | None
    vocab_size: int
    all_special_ids: frozenset[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str: ...


class ByteTokenizer:
    """Token i < 256 is byte i; then BOS, EOS, PAD. `encode` prepends BOS (with special tokens)."""

    special_tokens = {BYTE_BOS_ID: "<s>", BYTE_EOS_ID: "</s>", BYTE_PAD_ID: "<pad>"}

    def __init__(self) -> None:
        self.bos_token_id: int | None = BYTE_BOS_ID
        self.eos_token_id: int | None = BYTE_EOS_ID
        self.pad_token_id: int | None = BYTE_PAD_ID
        self.vocab_size = BYTE_VOCAB_SIZE
        self.all_special_ids = frozenset(self.special_tokens)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        body = list(text.encode("utf-8"))
        return [BYTE_BOS_ID, *body] if add_special_tokens else body

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        pieces: list[str] = []
        pending = bytearray()
        for token in ids:
            token = int(token)
            if 0 <= token < 256:
                pending.append(token)
                continue
            # ids outside the vocabulary have no text; specials only when asked for
            special = self.special_tokens.get(token)
            if special is not None and not skip_special_tokens:
                pieces.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
                pieces.append(special)
        pieces.append(pending.decode("utf-8", errors="replace"))
        return "".join(pieces)


class HFTokenizer:
    """A `tokenizers.Tokenizer` loaded from a checkpoint's tokenizer.json."""

    def __init__(
        self,
        folder: str | Path,
        *,
        eos_token_id: int | None = None,
        bos_token_id: int | None = None,
    ):
        from tokenizers import Tokenizer as RustTokenizer

        folder = Path(folder)
        path = folder / TOKENIZER_JSON
        try:
            self._tok = RustTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on bad files
            raise TokenizerLoadError(f"{path}: cannot load tokenizer ({exc})") from exc
        config = _read_tokenizer_config(folder)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = self._special_id(config, "bos_token", bos_token_id)
        self.eos_token_id = self._special_id(config, "eos_token", eos_token_id)
        self.pad_token_id = self._special_id(config, "pad_token", None)
        self.all_special_ids = frozenset(
            token_id
            for token_id, added in self._tok.get_added_tokens_decoder().items()
            if added.special
        )

    def _special_id(self, config: dict[str, Any], key: str, fallback: int | None) -> int | None:
        token = config.get(key)
        if isinstance(token, dict):  # {"content": "<s>", ...} in older tokenizer_config files
            token = token.get("content")
        token_id = self._tok.token_to_id(token) if isinstance(token, str) else None
        return token_id if token_id is not None else fallback

    @property
    def backend(self):
        """The `tokenizers.Tokenizer` itself, for libraries that need the whole vocabulary
        (structured output hands it to its grammar engine)."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


class AutoTokenizerAdapter:
    """`transformers.AutoTokenizer` behind the engine's interface (folders without
    tokenizer.json)."""

    def __init__(
        self,
        folder: str | Path,
        *,
        eos_token_id: int | None = None,
        bos_token_id: int | None = None,
    ):
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except Exception as exc:  # transformers raises OSError/ValueError/KeyError variously
            raise TokenizerLoadError(
                f"{folder}: no usable tokenizer (looked for {TOKENIZER_JSON}, then transformers' "
                f"AutoTokenizer files such as tokenizer.model or vocab.json + merges.txt): {exc}"
            ) from exc
        self.vocab_size = len(self._tok)
        self.bos_token_id = _first_not_none(self._tok.bos_token_id, bos_token_id)
        self.eos_token_id = _first_not_none(self._tok.eos_token_id, eos_token_id)
        self.pad_token_id = self._tok.pad_token_id
        self.all_special_ids = frozenset(self._tok.all_special_ids)

    @property
    def backend(self):
        """The `transformers` tokenizer itself (see `HFTokenizer.backend`)."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


def load_tokenizer(
    name: str | Path, *, eos_token_id: int | None = None, bos_token_id: int | None = None
) -> Tokenizer:
    """The tokenizer of a checkpoint folder or a GGUF file (built from its metadata), or the byte
    tokenizer of `pagedllm/tiny-random`.

    `eos_token_id`/`bos_token_id` (usually the ModelConfig's) fill in what the tokenizer files
    leave unnamed.
    """
    if str(name) == TINY_RANDOM_MODEL:
        return ByteTokenizer()
    if str(name) in PACKAGED_MODELS or str(name).lower().endswith(".gguf"):
        from pagedllm.checkpoint.gguf_reader import open_gguf
        from pagedllm.checkpoint.packaged import resolve_model

        return GGUFTokenizer(open_gguf(resolve_model(str(name))))
    folder = Path(name)
    if not folder.is_dir():
        raise TokenizerLoadError(f"tokenizer folder {folder} does not exist or is not a directory")
    if (folder / TOKENIZER_JSON).is_file():
        return HFTokenizer(folder, eos_token_id=eos_token_id, bos_token_id=bos_token_id)
    try:
        import transformers  # noqa: F401  (optional dependency)
    except ImportError as exc:
        raise TokenizerLoadError(
            f"{folder}: no {TOKENIZER_JSON}, and `transformers` (needed for other tokenizer "
            f"formats) is not installed"
        ) from exc
    return AutoTokenizerAdapter(folder, eos_token_id=eos_token_id, bos_token_id=bos_token_id)


def _read_tokenizer_config(folder: Path) -> dict[str, Any]:
    path = folder / TOKENIZER_CONFIG
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TokenizerLoadError(f"{path}: malformed JSON ({exc})") from exc
    return data if isinstance(data, dict) else {}


def _first_not_none(*values: int | None) -> int | None:
    return next((v for v in values if v is not None), None)


class GGUFTokenizer(HFTokenizer):
    """A GGUF file's tokenizer behind the engine's interface (an `HFTokenizer` whose
    `tokenizers.Tokenizer` is built from the metadata: `checkpoint/gguf_tokenizer.py`), with the
    file's chat template."""

    def __init__(self, file: GGUFFile) -> None:  # noqa: D107 - no folder to read
        from pagedllm.checkpoint.gguf_tokenizer import build_gguf_tokenizer

        self._tok = build_gguf_tokenizer(file)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        ids = {key: file.get(f"tokenizer.ggml.{key}_token_id") for key in ("bos", "eos", "padding")}
        self.bos_token_id, self.eos_token_id, self.pad_token_id = (
            value if isinstance(value, int) else None for value in ids.values()
        )
        self.all_special_ids = frozenset(
            token_id
            for token_id, added in self._tok.get_added_tokens_decoder().items()
            if added.special
        )
        template = file.get("tokenizer.chat_template")
        self.chat_template: str | None = template if isinstance(template, str) else None
