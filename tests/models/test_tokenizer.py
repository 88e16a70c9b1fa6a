"""Tokenizers: byte-level default, tokenizer.json, the AutoTokenizer fallback, and load errors."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pagedllm.tokenizer import (
    BYTE_BOS_ID,
    BYTE_EOS_ID,
    AutoTokenizerAdapter,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    TokenizerLoadError,
    load_tokenizer,
)

from model_factory import BOS_ID, EOS_ID, save_tiny_tokenizer

TEXTS = ["hello world, the quick brown fox", "Größe naïve café — 123", ""]


@pytest.fixture(scope="module")
def json_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok_json")
    save_tiny_tokenizer(folder, "json")
    return folder


@pytest.fixture(scope="module")
def vocab_merges_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok_vocab_merges")
    save_tiny_tokenizer(folder, "vocab_merges")
    return folder


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trips_text(text):
    tok = ByteTokenizer()
    assert tok.decode(tok.encode(text)) == text


def test_byte_tokenizer_prepends_bos_and_maps_bytes_to_ids():
    assert ByteTokenizer().encode("Hé") == [BYTE_BOS_ID, 72, 0xC3, 0xA9]


def test_byte_tokenizer_renders_specials_only_when_asked():
    tok = ByteTokenizer()
    ids = [BYTE_BOS_ID, *b"hi", BYTE_EOS_ID]
    assert (tok.decode(ids), tok.decode(ids, skip_special_tokens=False)) == ("hi", "<s>hi</s>")


def test_byte_tokenizer_decodes_a_cut_multibyte_character_without_raising():
    ids = ByteTokenizer().encode("é")[:2]  # BOS + first byte of a 2-byte character
    assert ByteTokenizer().decode(ids) == "\ufffd"


def test_byte_tokenizer_ignores_ids_outside_its_vocabulary():
    assert ByteTokenizer().decode([104, 10_000, 105]) == "hi"


def test_builtin_name_gives_the_byte_tokenizer():
    tok = load_tokenizer("pagedllm/tiny-random")
    assert isinstance(tok, ByteTokenizer) and (tok.bos_token_id, tok.eos_token_id) == (256, 257)


def test_tokenizer_json_is_loaded_with_the_tokenizers_library(json_dir):
    tok = load_tokenizer(json_dir)
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (BOS_ID, EOS_ID, 300)


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_json_encodes_like_transformers(json_dir, text):
    assert load_tokenizer(json_dir).encode(text) == AutoTokenizer.from_pretrained(json_dir).encode(
        text
    )


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_json_round_trips_text(json_dir, text):
    tok = load_tokenizer(json_dir)
    assert tok.encode(text)[0] == BOS_ID
    assert tok.decode(tok.encode(text)) == text


def test_tokenizer_json_decodes_every_prefix(json_dir):
    tok = load_tokenizer(json_dir)
    ids = tok.encode(TEXTS[1])
    prefixes = [tok.decode(ids[:k]) for k in range(len(ids) + 1)]
    assert prefixes[-1] == TEXTS[1] and all(isinstance(p, str) for p in prefixes)


def test_folder_without_tokenizer_json_falls_back_to_auto_tokenizer(vocab_merges_dir, json_dir):
    tok = load_tokenizer(vocab_merges_dir)
    assert isinstance(tok, AutoTokenizerAdapter)
    assert tok.encode(TEXTS[1]) == load_tokenizer(json_dir).encode(TEXTS[1])
    assert tok.decode(tok.encode(TEXTS[1])) == TEXTS[1]
    assert (tok.bos_token_id, tok.eos_token_id) == (BOS_ID, EOS_ID)


def test_folder_without_any_tokenizer_files_is_reported(tmp_path):
    with pytest.raises(TokenizerLoadError, match=f"{tmp_path}.*tokenizer.json"):
        load_tokenizer(tmp_path)


def test_missing_tokenizer_folder_is_reported(tmp_path):
    with pytest.raises(TokenizerLoadError, match="nowhere"):
        load_tokenizer(tmp_path / "nowhere")


def test_malformed_tokenizer_json_names_the_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(TokenizerLoadError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


def test_model_config_ids_fill_in_unnamed_specials(tmp_path, json_dir):
    (tmp_path / "tokenizer.json").write_text((json_dir / "tokenizer.json").read_text())
    tok = load_tokenizer(tmp_path, eos_token_id=7, bos_token_id=BOS_ID)
    assert (tok.bos_token_id, tok.eos_token_id) == (BOS_ID, 7)
