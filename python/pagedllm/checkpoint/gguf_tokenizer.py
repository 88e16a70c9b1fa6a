"""The tokenizer a GGUF file carries, built as a `tokenizers.Tokenizer` (no transformers).

- `tokenizer.ggml.model = "gpt2"`: byte-level BPE (vocabulary + merges), text split first by the
  pre-tokenizer regex llama.cpp picks for `tokenizer.ggml.pre` (`PRE_TOKENIZER_SPLITS`);
- `"llama"`: SentencePiece BPE (vocabulary + scores, merges derived from the scores when the
  file has none) with byte fallback and the "▁" prefix space.

Control tokens (type 3) become special added tokens, user-defined ones (type 4) plain added
tokens, so both are matched whole in text, as llama.cpp does. BOS/EOS/padding ids and
`add_bos_token` come from the metadata; `tokenizer.chat_template` is the chat template.
transformers' `integrations/gguf/gguf_tokenizer_mapping.py` builds the same tokenizers.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as RustTokenizer

from pagedllm.checkpoint.gguf_reader import GGUFError, GGUFFile

CONTROL, USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's `tokenizer.ggml.pre` -> the regexes text is split by, in order, before the bytes are
# mapped (llama-vocab.cpp); "gpt2"'s own regex is ByteLevel's, applied last in every case below
# that does not replace it
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "llama3": (_LLAMA3_SPLIT,),
    "llama-v3": (_LLAMA3_SPLIT,),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "smaug-bpe": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
    "deepseek-r1-qwen": (_QWEN2_SPLIT,),
}
# pre-tokenizers that isolate every digit, then split as GPT-2 does (llama.cpp's STARCODER group)
DIGIT_SPLIT_PRE = frozenset({"smollm", "starcoder", "refact", "codeshell", "exaone", "minerva"})


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the spelling of byte-level vocabularies)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars)}


def _byte_level_model(file: GGUFFile, tokens: list[str]) -> RustTokenizer:
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    vocab = {}
    for index, token in enumerate(tokens):
        # a token outside the byte alphabet (mislabelled text) is spelled byte by byte
        spelled = token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode())
        vocab.setdefault(spelled, index)
    merges = [tuple(m.split(" ", 1)) for m in file.get("tokenizer.ggml.merges") or []]
    tok = RustTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    pre = file.get("tokenizer.ggml.pre", "default")
    if pre in PRE_TOKENIZER_SPLITS:
        splits = [
            pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZER_SPLITS[pre]
        ]
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    elif pre in DIGIT_SPLIT_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:  # "default", "gpt2" and others: GPT-2's own regex
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_model(file: GGUFFile, tokens: list[str]) -> RustTokenizer:
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = file.get("tokenizer.ggml.merges")
    if merges:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:
        scores = file.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise GGUFError(f"{file.path}: a 'llama' tokenizer needs tokenizer.ggml.scores")
        pairs = _merges_from_scores(vocab, dict(zip(tokens, scores)))
    unk_id = file.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    tok = RustTokenizer(models.BPE(vocab, pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = bool(file.get("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """SentencePiece's merges: every split of a token into two tokens, best score first
    (transformers' `generate_merges`, same order)."""
    merges = []
    for piece, score in scores.items():
        local = [
            (piece[:i], piece[i:], score)
            for i in range(1, len(piece))
            if piece[:i] in vocab and piece[i:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


_BUILDERS = {"gpt2": _byte_level_model, "llama": _sentencepiece_model}


def build_gguf_tokenizer(file: GGUFFile) -> RustTokenizer:
    """The `tokenizers.Tokenizer` the file's metadata describes."""
    kind = file.get("tokenizer.ggml.model")
    if kind not in _BUILDERS:
        raise GGUFError(
            f"{file.path}: tokenizer.ggml.model = {kind!r} is not supported "
            f"(supported: {', '.join(_BUILDERS)}); pass a tokenizer folder with --tokenizer"
        )
    tokens = file.get("tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFError(f"{file.path}: missing metadata key 'tokenizer.ggml.tokens'")
    tok = _BUILDERS[kind](file, tokens)
    _add_special_tokens(tok, file, tokens, byte_level=kind == "gpt2")
    _add_bos_eos(tok, file, tokens, default_bos=kind == "llama")
    return tok


def _add_special_tokens(tok: RustTokenizer, file: GGUFFile, tokens: list[str], byte_level: bool):
    types = file.get("tokenizer.ggml.token_type") or []
    alphabet = set(_byte_alphabet().values()) if byte_level else None
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(tokens, types)
        if kind == CONTROL and (alphabet is None or set(token) <= alphabet)
    ]
    tok.add_special_tokens(control)
    user = [
        AddedToken(token, normalized=False, special=False)
        for token, kind in zip(tokens, types)
        if kind == USER_DEFINED
    ]
    tok.add_tokens(user)


def _add_bos_eos(tok: RustTokenizer, file: GGUFFile, tokens: list[str], default_bos: bool):
    def token(key: str) -> str | None:
        index = file.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None

    bos, eos = token("bos"), token("eos")
    add_bos = bos is not None and bool(file.get("tokenizer.ggml.add_bos_token", default_bos))
    add_eos = eos is not None and bool(file.get("tokenizer.ggml.add_eos_token", False))
    single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
    specials = [(t, tok.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    tok.post_processor = processors.TemplateProcessing(
        single=" ".join(single), special_tokens=list(dict.fromkeys(specials))
    )
