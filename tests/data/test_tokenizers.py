"""data/tokenizers.py: GPT-2's offline ranks checked by hash, the bytes tokenizer's round trip and
separators (property-based), fingerprints, and the error for an unknown name."""

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from data.tokenizers import GPT2_RANKS_SHA256, fetch_gpt2_ranks_from_whisper, get_tokenizer, gpt2_offline


@pytest.fixture(scope="session")
def gpt2_cache(tmp_path_factory):
    """The offline path, forced: ranks come from the openai-whisper sdist via pip."""
    cache = tmp_path_factory.mktemp("gpt2-ranks")
    fetch_gpt2_ranks_from_whisper(cache / "gpt2.tiktoken")
    return cache


def test_gpt2_offline_hello_world(gpt2_cache):
    enc = gpt2_offline(gpt2_cache)
    assert hashlib.sha256((gpt2_cache / "gpt2.tiktoken").read_bytes()).hexdigest() == GPT2_RANKS_SHA256
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert enc.n_vocab == 50257
    assert enc.encode("<|endoftext|>", allowed_special="all") == [50256]
    text = "The quick brown fox, naïvely — 3.14!"
    assert enc.decode(enc.encode_ordinary(text)) == text


def test_gpt2_offline_rejects_tampered_cache(gpt2_cache, tmp_path):
    bad = tmp_path / "gpt2.tiktoken"
    bad.write_bytes((gpt2_cache / "gpt2.tiktoken").read_bytes().replace(b"IQ==", b"IR==", 1))
    # A corrupted cache is detected by its hash and replaced by a verified download.
    enc = gpt2_offline(tmp_path)
    assert hashlib.sha256(bad.read_bytes()).hexdigest() == GPT2_RANKS_SHA256
    assert enc.encode_ordinary("Hello world") == [15496, 995]


def test_gpt2_tokenizer_wrapper():
    tok = get_tokenizer("gpt2")
    assert tok.vocab_size == 50257 and tok.eot_token == 50256
    assert tok.encode("Hello world") == [15496, 995]


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_bytes_roundtrip_arbitrary_utf8(text):
    tok = get_tokenizer("bytes")
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_bytes_vocab():
    tok = get_tokenizer("bytes")
    assert tok.vocab_size == 256 and tok.eot_token == 0x1E  # ASCII record separator
    assert tok.encode("é") == [0xC3, 0xA9]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(alphabet=st.characters(blacklist_categories=["Cs"]) | st.just("\x1e")), max_size=4))
def test_bytes_documents_separated_exactly_once(texts):
    tok = get_tokenizer("bytes")
    docs = tok.encode_documents(texts)
    for text, ids in zip(texts, docs, strict=True):
        # the text's own U+001E characters are dropped; one separator ends the document
        assert ids == list(text.replace("\x1e", "").encode("utf-8")) + [0x1E]
        assert ids.count(0x1E) == 1
    assert tok.encode_documents(["a\x1eb"], separate=False) == [[97, 98]]


def test_fingerprint_identifies_the_tokenizer():
    import dataclasses

    import tiktoken

    tok = get_tokenizer("bytes")
    assert tok.fingerprint() == get_tokenizer("bytes").fingerprint()  # stable across builds
    other_sep = dataclasses.replace(tok, eot_token=0x04, eot_char="\x04")
    flipped = dataclasses.replace(tok, encoding=tiktoken.Encoding(
        name="bytes", pat_str=r"[\s\S]{1,64}", special_tokens={}, explicit_n_vocab=256,
        mergeable_ranks={bytes([i]): 255 - i for i in range(256)}))
    prints = {tok.fingerprint(), other_sep.fingerprint(), flipped.fingerprint(), get_tokenizer("gpt2").fingerprint()}
    assert len(prints) == 4


def test_unknown_tokenizer_lists_choices():
    with pytest.raises(ValueError, match=r"data\.tokenizer must be one of gpt2, bytes or the path of a tokenizer "
                                         r"file.*got 'gpt3': no such file"):
        get_tokenizer("gpt3")
