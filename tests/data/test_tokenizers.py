"""data/tokenizers.py: GPT-2's offline ranks checked by hash, the bytes tokenizer's round trip and
separators (property-based), fingerprints, the error for an unknown name, and tokenizers given
by path: a tokenizer.json with more than 65,535 ids (built here) against the `tokenizers` library,
trained on for a few steps, and a tiktoken ranks file against tiktoken."""

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


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=300))
def test_bytes_array_shortcut_equals_tiktoken(text):
    """The bytes tokenizer's array encoder (what the token cache uses) gives tiktoken's ids."""
    from data.tokenizers import bytes_encoding, utf8_ids

    assert utf8_ids(text).tolist() == bytes_encoding().encode_ordinary(text)


def test_bytes_array_shortcut_on_lone_surrogates():
    from data.tokenizers import bytes_encoding, utf8_ids

    for text in ("a\ud800b", "\udfff", "ok \ud83d\ude00 \ud83d"):
        assert utf8_ids(text).tolist() == bytes_encoding().encode_ordinary(text)


# A local tokenizer.json with more than 65,535 ids (built here with the `tokenizers` library):
# filler words, then the corpus's words at ids above 65,535, then <|endoftext|>.
BIG_VOCAB = 70_000
WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "far", "away", "[UNK]"]


def big_tokenizer_json(path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"filler{i}": i for i in range(BIG_VOCAB - len(WORDS))}
    vocab.update({w: BIG_VOCAB - len(WORDS) + i for i, w in enumerate(WORDS)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|endoftext|>"])  # id BIG_VOCAB
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def test_tokenizer_json_by_path_matches_the_library(tmp_path):
    from tokenizers import Tokenizer as Reference

    path = big_tokenizer_json(tmp_path / "tok" / "tokenizer.json")
    tok = get_tokenizer(str(path))
    reference = Reference.from_file(str(path))
    assert tok.vocab_size == BIG_VOCAB + 1 and tok.eot_token == BIG_VOCAB
    text = "the cat sat on the mat"
    assert tok.encode(text) == reference.encode(text).ids and min(tok.encode(text)) > 65_535
    # a separator spelled inside a document is text, not a boundary (tiktoken's encode_ordinary)
    assert BIG_VOCAB not in tok.encode("the <|endoftext|> cat")
    assert tok.encode_documents(["a dog", "ran far"]) == [reference.encode("a dog").ids + [BIG_VOCAB],
                                                          reference.encode("ran far").ids + [BIG_VOCAB]]
    assert get_tokenizer(str(path.parent)).fingerprint() == tok.fingerprint()  # a folder: its tokenizer.json
    import pickle

    assert pickle.loads(pickle.dumps(tok)).encode(text) == tok.encode(text)


def test_tiktoken_ranks_file_by_path(tmp_path):
    import base64

    import tiktoken
    from tiktoken_ext.openai_public import r50k_pat_str

    ranks = {bytes([i]): i for i in range(256)} | {b"th": 256, b"the": 257, b" the": 258}
    path = tmp_path / "small.tiktoken"
    path.write_text("".join(f"{base64.b64encode(k).decode()} {v}\n" for k, v in ranks.items()))
    tok = get_tokenizer(str(path))
    reference = tiktoken.Encoding("ref", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                  special_tokens={"<|endoftext|>": 259})
    assert tok.vocab_size == 260 and tok.eot_token == 259
    text = "the theory of the thing"
    assert tok.encode(text) == reference.encode_ordinary(text) and 258 in tok.encode(text)
    gap = tmp_path / "gap.tiktoken"
    gap.write_text(f"{base64.b64encode(b'a').decode()} 0\n{base64.b64encode(b'b').decode()} 5\n")
    with pytest.raises(ValueError, match=r"data\.tokenizer=.*gap\.tiktoken.*ranks must be 0\.\.N-1"):
        get_tokenizer(str(gap))
    garbage = tmp_path / "notes.txt"
    garbage.write_text("this is not a ranks file\n")
    with pytest.raises(ValueError, match=r"data\.tokenizer=.*notes\.txt.*neither a Hugging Face tokenizer\.json.*"
                                         r"nor a tiktoken ranks file"):
        get_tokenizer(str(garbage))
    broken = tmp_path / "broken.json"
    broken.write_text('{"model": ')
    with pytest.raises(ValueError, match=r"data\.tokenizer=.*broken\.json.*not a readable Hugging Face"):
        get_tokenizer(str(broken))


def test_bad_tokenizer_path_fails_before_data_is_read(tmp_path, monkeypatch):
    import pelab.datamodule
    from data.corpus import GutenbergCorpus
    from pelab.datamodule import TextDataModule

    monkeypatch.setattr(pelab.datamodule, "prepare_token_files", lambda *a, **k: pytest.fail("data was read"))
    with pytest.raises(ValueError, match=r"data\.tokenizer must be one of gpt2, bytes or the path of a tokenizer "
                                         r"file .*got '.*nowhere/tokenizer\.json': no such file"):
        TextDataModule(GutenbergCorpus(), tokenizer=str(tmp_path / "nowhere" / "tokenizer.json"))


def test_trains_from_a_tokenizer_json_above_65535_ids(tmp_path):
    """train.py (in process, a few steps) on data=text with data.tokenizer=PATH: uint32 token
    files holding ids above 65,535, a model with the tokenizer's vocabulary, a finite loss."""
    import json
    import math

    import numpy as np
    from hydra import compose, initialize_config_dir

    from train import train

    root = __import__("pathlib").Path(__file__).resolve().parents[2]
    path = big_tokenizer_json(tmp_path / "tok" / "tokenizer.json")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(0)
    for i in range(12):
        (corpus / f"{i}.txt").write_text(" ".join(rng.choice(WORDS[:-1], size=200)) + "\n")
    overrides = [
        "data=text", f"data.paths=[{corpus}]", f"data.tokenizer={path}", f"data.data_dir={tmp_path / 'cache'}",
        "data.val_fraction=0.3", "logger=none", "model.n_layer=1", "model.n_embd=16", "model.n_head=2",
        "model.block_size=16", "data.batch_size=2", "trainer.max_steps=3", "trainer.val_check_interval=3",
        "trainer.limit_val_batches=1", "eval.extrapolation.enabled=false", "~callbacks.attention_maps",
        "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "optim.warmup_steps=1",
        f"paths.output_dir={tmp_path / 'out'}",
    ]
    with initialize_config_dir(str(root / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    val_loss = train(cfg)
    assert val_loss is not None and math.isfinite(val_loss)
    assert cfg.model.vocab_size == BIG_VOCAB + 1
    cache = next((tmp_path / "cache").glob("files-corpus-*/tokenizer-*"))
    meta = json.loads((cache / "meta.json").read_text())
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == BIG_VOCAB + 1
    tokens = np.concatenate([np.fromfile(f, dtype=np.uint32) for f in cache.glob("shards/*/train.bin")])
    assert tokens.min() > 65_535 and tokens.max() == BIG_VOCAB and meta["splits"]["train"]["max_id"] == BIG_VOCAB
