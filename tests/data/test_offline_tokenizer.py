"""data/tokenizers.py on a node without network: with empty caches, the first gpt2 command fails
with one line naming the fix (scripts/prepare_data.py, PELAB_CACHE, TIKTOKEN_CACHE_DIR), not the
libraries' tracebacks; the ranks tiktoken downloads are kept in PELAB_CACHE, from which an
offline node then loads them."""

import hashlib
from pathlib import Path

import pytest
import tiktoken

import data.tokenizers
from data.paths import PathError
from data.tokenizers import GPT2_RANKS_SHA256, TokenizerUnavailable, get_tokenizer

ROOT = Path(__file__).resolve().parents[2]
CLOSED = "http://127.0.0.1:9"  # the discard port: nothing listens, every connection is refused at once


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """Empty pelab and tiktoken caches; tiktoken's download (requests) and pip's both refused."""
    monkeypatch.setenv("PELAB_CACHE", str(tmp_path / "pelab-cache"))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken-cache"))
    for proxy in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.setenv(proxy, CLOSED)
    for bypass in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(bypass, raising=False)
    monkeypatch.setenv("PIP_INDEX_URL", f"{CLOSED}/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    return tmp_path / "pelab-cache"


def test_gpt2_with_no_network_and_no_cached_ranks_is_one_line(offline):
    with pytest.raises(TokenizerUnavailable) as err:
        get_tokenizer("gpt2")
    message = str(err.value)
    assert isinstance(err.value, PathError) and err.value.__suppress_context__  # printed as it is, no chain
    assert "\n" not in message, message
    assert message.startswith("data.tokenizer=gpt2: the GPT-2 BPE ranks are not on this machine and cannot be "
                              "downloaded (tiktoken: ")
    assert "pip download openai-whisper" in message and "ERROR:" in message  # each route's reason, in short
    assert "run `python scripts/prepare_data.py` with this command's data overrides once on a machine with network" \
        in message
    assert f"(the ranks are kept there: {offline / 'gpt2.tiktoken'})" in message
    assert message.endswith("or set TIKTOKEN_CACHE_DIR to a tiktoken cache holding gpt2")
    assert not offline.joinpath("gpt2.tiktoken").exists()


def test_prepare_data_says_the_same_one_line(offline, monkeypatch, capsys):
    """scripts/prepare_data.py (the documented first step) ends with the line, exit code 1."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import prepare_data

    assert prepare_data.main(["data=gutenberg_gpt2"]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [lines[-1]] and lines[-1].startswith("prepare_data.py: data.tokenizer=gpt2: the GPT-2 BPE "), err
    assert "Traceback" not in err


def stand_in_ranks() -> tiktoken.Encoding:
    """An encoding shaped like GPT-2's (50,256 ranks, <|endoftext|> = 50256) but made here: the
    real ranks need a download, and what is tested is where they go, not what they are."""
    from tiktoken_ext.openai_public import r50k_pat_str

    ranks = {bytes([i]): i for i in range(256)}
    ranks.update({f"{i:05d}".encode(): 256 + i for i in range(50000)})
    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256}, explicit_n_vocab=50257)


def test_ranks_tiktoken_downloads_are_kept_in_pelab_cache_for_offline_nodes(tmp_path, monkeypatch):
    """A node with network: tiktoken's ranks land in PELAB_CACHE as a gpt2.tiktoken whose sha256 is
    the pinned one; an offline node sharing that PELAB_CACHE then loads gpt2 from it, touching no
    network, with the same fingerprint (so token caches built on either node serve both)."""
    import base64

    online = stand_in_ranks()
    dump = b"".join(base64.b64encode(t) + b" %d\n" % r for t, r in online._mergeable_ranks.items())
    monkeypatch.setattr(data.tokenizers, "GPT2_RANKS_SHA256", hashlib.sha256(dump).hexdigest())
    shared = tmp_path / "shared-cache"
    monkeypatch.setenv("PELAB_CACHE", str(shared))
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: online)  # "the download worked"
    first = get_tokenizer("gpt2")
    assert (shared / "gpt2.tiktoken").read_bytes() == dump

    def no_network(*args, **kwargs):
        raise AssertionError("the network was used")

    monkeypatch.setattr(tiktoken, "get_encoding", no_network)
    monkeypatch.setattr(data.tokenizers.subprocess, "run", no_network)
    offline_node = get_tokenizer("gpt2")
    text = "ids 12345 and 00042, then text"
    assert offline_node.encode(text) == online.encode_ordinary(text) == first.encode(text)
    assert offline_node.vocab_size == 50257 and offline_node.eot_token == 50256
    assert offline_node.fingerprint() == first.fingerprint()
