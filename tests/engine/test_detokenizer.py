"""Incremental detokenizer: equals a full decode, UTF-8 safe, stop strings, bounded window."""

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pagedllm.engine.detokenizer import MAX_WINDOW_TOKENS, IncrementalDetokenizer
from pagedllm.sampling_params import SamplingParams

BOS, EOS = 256, 257
MIXED_TEXT = "naïve café: 5€ — 日本語 😀 ok"
SENTENCES = [
    "Hello world, this is a tiny corpus.",
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the cache in blocks.",
    "hello hello world world the the cache",
]


class ByteTokenizer:
    """One token per UTF-8 byte, plus BOS/EOS specials."""

    def __init__(self):
        self.calls = []

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens=True):
        self.calls.append(len(ids))
        specials = {BOS: "<s>", EOS: "</s>"}
        out, run = [], bytearray()
        for i in ids:
            if i in specials:
                out.append(run.decode("utf-8", errors="replace"))
                run = bytearray()
                out.append("" if skip_special_tokens else specials[i])
            else:
                run.append(i)
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


def stream(detok, ids):
    """Append ids until a stop string; return (deltas, stop, tail released by finish)."""
    deltas = []
    for i in ids:
        delta, stop = detok.append(i)
        deltas.append(delta)
        if stop is not None:
            return deltas, stop, detok.finish()
    return deltas, None, detok.finish()


@pytest.fixture(scope="module")
def byte_level_bpe():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<eos>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(SENTENCES, trainer)
    return tok


@pytest.fixture(scope="module")
def sentencepiece_style_bpe():
    """Metaspace BPE with byte fallback, as Llama's tokenizer: '▁' for spaces, <0xNN> tokens for
    unknown characters, leading space stripped on decode."""
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace()
    trained.train_from_iterator(SENTENCES, trainers.BpeTrainer(vocab_size=200, show_progress=False))
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for token in trained.get_vocab():
        vocab.setdefault(token, len(vocab))
    merges = [
        tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
        for m in json.loads(trained.to_str())["model"]["merges"]
    ]
    tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return tok


def test_byte_tokens_stream_equals_full_decode():
    tok = ByteTokenizer()
    ids = tok.encode(MIXED_TEXT)
    deltas, _, tail = stream(IncrementalDetokenizer(tok), ids)
    assert "".join(deltas) + tail == tok.decode(ids) == MIXED_TEXT


def test_split_multibyte_character_is_never_emitted_half_done():
    tok = ByteTokenizer()
    deltas, _, _ = stream(IncrementalDetokenizer(tok), tok.encode("€😀日"))
    assert [d for d in deltas if d] == ["€", "😀", "日"]


def test_incomplete_character_at_the_end_becomes_replacement_on_finish():
    detok = IncrementalDetokenizer(ByteTokenizer())
    assert [detok.append(i)[0] for i in (0x68, 0xE2, 0x82)] == ["h", "", ""]
    assert detok.finish() == "\ufffd"
    assert detok.text == "h\ufffd"


def test_invalid_byte_is_emitted_once_text_follows():
    detok = IncrementalDetokenizer(ByteTokenizer())
    assert detok.append(0xFF)[0] == ""
    assert detok.append(ord("A"))[0] == "\ufffdA"


def test_long_run_of_invalid_bytes_keeps_every_replacement_char():
    detok = IncrementalDetokenizer(ByteTokenizer())
    deltas, _, tail = stream(detok, [0xFF] * 40 + [ord("z")])
    assert "".join(deltas) + tail == "\ufffd" * 40 + "z"


def test_byte_level_bpe_stream_equals_full_decode(byte_level_bpe):
    ids = byte_level_bpe.encode(MIXED_TEXT + " Hello world, the cache.").ids
    assert len(ids) > MAX_WINDOW_TOKENS  # the window slides during the stream
    deltas, _, tail = stream(IncrementalDetokenizer(byte_level_bpe), ids)
    assert "".join(deltas) + tail == byte_level_bpe.decode(ids)
    assert "\ufffd" not in "".join(deltas)


def test_byte_fallback_bpe_stream_after_prompt_equals_full_decode(sentencepiece_style_bpe):
    tok = sentencepiece_style_bpe
    prompt = tok.encode("Hello world").ids
    output = tok.encode("Hello world " + MIXED_TEXT + " the quick brown fox").ids[2:]
    deltas, _, tail = stream(IncrementalDetokenizer(tok, prompt), output)
    full = tok.decode(prompt + output)
    assert "".join(deltas) + tail == full[len(tok.decode(prompt)) :]
    assert "\ufffd" not in "".join(deltas)


def test_prompt_context_keeps_the_leading_space_of_the_first_word(sentencepiece_style_bpe):
    tok = sentencepiece_style_bpe
    prompt = tok.encode("Hello").ids
    world = tok.encode("Hello world").ids[len(prompt) :]
    deltas, _, tail = stream(IncrementalDetokenizer(tok, prompt), world)
    assert "".join(deltas) + tail == " world"


def test_decode_window_stays_bounded_on_long_sequences():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, tok.encode("a prompt of some length " * 20))
    stream(detok, tok.encode("long output " * 100))
    assert max(tok.calls) <= MAX_WINDOW_TOKENS


def test_special_tokens_skipped_by_default():
    deltas, _, tail = stream(IncrementalDetokenizer(ByteTokenizer()), [ord("a"), EOS])
    assert "".join(deltas) + tail == "a"


def test_special_tokens_kept_when_not_skipped():
    detok = IncrementalDetokenizer(ByteTokenizer(), skip_special_tokens=False)
    deltas, _, tail = stream(detok, [ord("a"), EOS])
    assert "".join(deltas) + tail == "a</s>"


def test_stop_string_across_tokens_cuts_text_before_it():
    tok = ByteTokenizer()
    deltas, stop, tail = stream(
        IncrementalDetokenizer(tok, stop=["STOP"]), tok.encode("hello STOP more")
    )
    assert stop == "STOP"
    assert "".join(deltas) + tail == "hello "


def test_include_stop_str_in_output_keeps_the_stop_string():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, stop=["STOP"], include_stop_str_in_output=True)
    deltas, stop, tail = stream(detok, tok.encode("hello STOP more"))
    assert (stop, "".join(deltas) + tail) == ("STOP", "hello STOP")


def test_stop_string_inside_one_multi_token_delta_cuts_at_its_start(byte_level_bpe):
    ids = byte_level_bpe.encode("Hello world, this is").ids
    deltas, stop, tail = stream(IncrementalDetokenizer(byte_level_bpe, stop=["lo w"]), ids)
    assert (stop, "".join(deltas) + tail) == ("lo w", "Hel")


def test_earliest_of_stop_strings_ending_together_wins():
    tok = ByteTokenizer()
    deltas, stop, tail = stream(IncrementalDetokenizer(tok, stop=["é", "xé"]), tok.encode("abxé!"))
    assert (stop, "".join(deltas) + tail) == ("xé", "ab")


def test_partial_stop_string_is_held_back_then_released():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, stop=["STOP"])
    for i in tok.encode("hello ST"):
        detok.append(i)
    assert detok.text == "hello"  # "ST" (with the space before it) may still become "STOP"
    for i in tok.encode("ART"):
        detok.append(i)
    assert detok.text == "hello ST"
    assert detok.finish() == "ART" and detok.text == "hello START"


def test_stop_string_before_min_tokens_is_ignored():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, stop=["X"], min_tokens=3)
    deltas, stop, tail = stream(detok, tok.encode("aXbXc"))
    assert (stop, "".join(deltas) + tail) == ("X", "aXb")


def test_append_after_stop_raises():
    detok = IncrementalDetokenizer(ByteTokenizer(), stop=["a"])
    assert detok.append(ord("a")) == ("", "a")
    with pytest.raises(RuntimeError, match="stopped"):
        detok.append(ord("b"))


def test_from_params_takes_stop_strings_and_flags():
    tok = ByteTokenizer()
    params = SamplingParams(stop="!", include_stop_str_in_output=True, skip_special_tokens=False)
    detok = IncrementalDetokenizer.from_params(tok, [], params)
    deltas, stop, tail = stream(detok, [BOS] + tok.encode("hi! there"))
    assert (stop, "".join(deltas) + tail) == ("!", "<s>hi!")


@pytest.mark.parametrize("shift", range(MAX_WINDOW_TOKENS))
def test_window_slide_inside_a_multibyte_character_loses_nothing(shift):
    tok = ByteTokenizer()
    ids = tok.encode("x" * shift + MIXED_TEXT * 3)
    deltas, _, tail = stream(IncrementalDetokenizer(tok), ids)
    assert "".join(deltas) + tail == tok.decode(ids)
    assert "\ufffd" not in "".join(deltas)


def test_random_bytes_after_a_random_prompt_equal_the_outputs_decode():
    """Random byte soup (the tiny random model's output) after a random prompt: the stream is
    the decoding of the output bytes (a prompt's incomplete last character is not theirs)."""
    rng = random.Random(0)
    tok = ByteTokenizer()
    for _ in range(400):
        alphabet = [rng.randrange(256) for _ in range(rng.randrange(2, 12))]
        ids = [rng.choice(alphabet) for _ in range(rng.randrange(1, 300))]
        prompt = [rng.randrange(256) for _ in range(rng.randrange(0, 8))]
        deltas, _, tail = stream(IncrementalDetokenizer(tok, prompt), ids)
        assert "".join(deltas) + tail == tok.decode(ids), (prompt, ids)


def test_invalid_byte_run_longer_than_any_window_keeps_every_replacement_char():
    detok = IncrementalDetokenizer(ByteTokenizer())
    deltas, _, tail = stream(detok, [0xFF] * 150 + list("é".encode()) + [0xE2])
    assert "".join(deltas) + tail == "\ufffd" * 150 + "é\ufffd"


def test_a_prompt_ending_in_u_fffd_adds_nothing_to_the_output():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, tok.encode("answer yes or no \ufffd"))
    deltas, _, tail = stream(detok, tok.encode("yes"))
    assert "".join(deltas) + tail == "yes"


def test_a_prompt_ending_inside_a_character_adds_nothing_to_the_output():
    tok = ByteTokenizer()
    euro = "€".encode()
    detok = IncrementalDetokenizer(tok, tok.encode("price 日本") + list(euro[:2]))
    deltas, _, tail = stream(detok, tok.encode('{"a": 1}'))
    assert "".join(deltas) + tail == '{"a": 1}'


def test_output_bytes_never_complete_the_prompts_last_character():
    # the output is what its own tokens decode to: orphan continuation bytes are U+FFFD
    tok = ByteTokenizer()
    euro = "€".encode()
    detok = IncrementalDetokenizer(tok, tok.encode("price 日本") + list(euro[:1]))
    deltas, _, tail = stream(detok, list(euro[1:]) + [ord("!")])
    assert "".join(deltas) + tail == tok.decode(list(euro[1:]) + [ord("!")]) == "\ufffd\ufffd!"


def test_an_incomplete_output_character_after_such_a_prompt_is_still_held_back():
    tok = ByteTokenizer()
    euro = "€".encode()
    detok = IncrementalDetokenizer(tok, tok.encode("x\ufffd"))
    assert [detok.append(b)[0] for b in euro] == ["", "", "€"]
    assert detok.finish() == "" and detok.text == "€"


def test_a_prompt_ending_in_u_fffd_keeps_the_leading_space_of_the_first_word(
    sentencepiece_style_bpe,
):
    tok = sentencepiece_style_bpe
    # ☃ is not in the vocabulary: three byte tokens; cut inside it, the prompt ends in U+FFFD
    prompt = tok.encode("Hello ☃").ids[:-1]
    assert tok.decode(prompt).endswith("\ufffd")
    world = tok.encode("Hello world").ids[len(tok.encode("Hello").ids) :]
    deltas, _, tail = stream(IncrementalDetokenizer(tok, prompt), world)
    assert "".join(deltas) + tail == " world"
