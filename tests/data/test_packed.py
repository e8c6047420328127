"""Packed documents on the data side (data/packing.py): the layout of a window from its
separators, the refusals before any data is read, and a training stream (its windows and
resume position) the options leave exactly as it was."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from data.corpus import HubCorpus, TextFilesCorpus
from data.packing import DocumentOptions, document_layout
from data.stream import GlobalSamples
from pelab.datamodule import TextDataModule
from tests.data.test_text_data import SEP, docs, write_txt

ROOT = Path(__file__).resolve().parents[2]


def test_layout_of_a_window_by_hand():
    # separators (9) close documents: the token after one opens the next; the first partial
    # document starts at 0; a separator as the window's last token opens nothing
    idx = torch.tensor([[5, 3, 9, 7, 8, 9, 9, 4, 4, 9],
                        [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]])
    positions, documents = document_layout(idx, 9)
    assert positions.tolist() == [[0, 1, 2, 0, 1, 2, 0, 0, 1, 2], list(range(10))]
    assert documents.tolist() == [[0, 0, 0, 1, 1, 1, 2, 3, 3, 3], [0] * 10]
    assert positions.dtype == documents.dtype == torch.int64


def test_options_read_what_they_say():
    idx = torch.tensor([[5, 9, 7, 8]])
    assert DocumentOptions().layout(idx) == (None, None)
    positions, documents = DocumentOptions(positions=True, eot_token=9).layout(idx)
    assert positions.tolist() == [[0, 1, 0, 1]] and documents is None
    positions, documents = DocumentOptions(mask=True, eot_token=9).layout(idx)
    assert positions is None and documents.tolist() == [[0, 0, 1, 1]]
    both = DocumentOptions(True, True, 9)
    assert both.mode == "both" and both.resolve(None) is both
    assert both.resolve("none").mode == "none" and both.resolve("mask") == DocumentOptions(False, True, 9)
    with pytest.raises(ValueError, match=r"eval\.documents='all'.*none, positions, mask, both"):
        both.resolve("all")


def test_corpus_without_separators_is_refused_naming_option_and_data():
    wikitext = HubCorpus("Salesforce/wikitext", "wikitext-103-raw-v1", rows_are_documents=False)
    for key in ("document_mask", "document_positions"):
        with pytest.raises(ValueError, match=rf"data\.{key}=true .*Salesforce_wikitext.*rows_are_documents: false"):
            TextDataModule(wikitext, **{key: True})
    TextDataModule(wikitext)  # the defaults are today's behaviour


def compose_config(overrides, tmp_path):
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[*overrides, f"paths.output_dir={tmp_path / 'out'}"])


@pytest.mark.parametrize("overrides, message", [
    (["data=wikitext103", "model=gpt2", "data.document_mask=true"],
     r"^data\.document_mask=true needs documents separated .*wikitext"),
    (["data=wikitext103", "model=gpt2", "eval.documents=both"], r"eval\.documents=both needs documents .*wikitext"),
    (["data.document_positions=true", "+pe.randomize_to=64"],
     r"data\.document_positions=true and pe\.randomize_to=64"),
    (["data=synthetic", "eval.extrapolation.enabled=false", "eval.documents=mask"],
     r"eval\.documents=mask needs documents .*synthetic"),
    (["eval.documents=some"], r"eval\.documents .*none, positions, mask, both, got .some."),
])
def test_bad_combinations_fail_before_data(overrides, message, tmp_path, monkeypatch):
    import pelab.datamodule
    from pelab.config import ConfigError
    from pelab.validate import validate_config

    monkeypatch.setattr(pelab.datamodule, "prepare_token_files", lambda *a, **k: pytest.fail("data was read"))
    with pytest.raises(ConfigError, match=message):
        validate_config(compose_config(overrides, tmp_path))


def test_training_stream_is_unchanged_by_the_options(tmp_path):
    write_txt(tmp_path / "c", docs(12))
    corpus = TextFilesCorpus([str(tmp_path / "c")], val_fraction=0.25)
    streams = []
    for options in ({}, {"document_positions": True, "document_mask": True}):
        module = TextDataModule(corpus, block_size=32, batch_size=2, data_dir=str(tmp_path / "data"), **options)
        module.setup()
        assert module.documents.eot_token == SEP
        windows = []
        for rank in (0, 1):
            for consumed in (0, 5):  # a resumed run continues after the samples already trained on
                samples = list(GlobalSamples(consumed, rank, 2, 2, 100))[:8]
                windows.append([module.train_set.start(g) for g in samples])
                windows.append(torch.stack([module.train_set[g][0] for g in samples]))
        windows.append(torch.stack([module.val_set[i][0] for i in range(len(module.val_set))]))
        streams.append(windows)
    plain, packed = streams
    assert len(plain) == len(packed)
    for a, b in zip(plain, packed):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    assert plain[0] != plain[2] and plain[0] != plain[4]  # offsets and ranks do draw other windows
    assert any((w == SEP).any() for w in plain[1])  # windows cross documents: there is something to pack


def test_extrapolation_rows_say_which_documents_they_read():
    """eval.extrapolation.documents: null follows training, a list gives rows per mode, and the
    document-respecting rows score exactly the windows scored with the layout by hand."""
    import math

    import numpy as np

    from evaluation.extrapolation import ExtrapolationConfig, evaluate_extrapolation
    from tests.tiny import build

    _, model, _ = build("alibi")
    g = np.random.default_rng(0)
    tokens = g.integers(1, 31, 16 * 33 + 1)
    tokens[g.random(tokens.shape) < 0.1] = 0  # documents of ~10 tokens
    trained = DocumentOptions(True, True, eot_token=0)
    config = ExtrapolationConfig(multipliers=[1], documents=[None, "none"], precision="32", q_chunk=16)
    rows = evaluate_extrapolation(model, tokens, 32, config, log=lambda _: None, documents=trained)
    assert [r.documents for r in rows] == ["both", "none"]
    assert rows[0].loss != rows[1].loss
    x = torch.from_numpy(tokens[: 16 * 32 + 1].astype(np.int64))
    xy = torch.stack([x[i * 32 : i * 32 + 33] for i in range(16)])
    with torch.no_grad():
        nll = model.token_nll(xy[:, :-1], xy[:, 1:], *trained.layout(xy[:, :-1])[:1],
                              documents=trained.layout(xy[:, :-1])[1])
    assert math.isclose(rows[0].loss, nll.double().mean().item(), rel_tol=1e-6)
    plain = evaluate_extrapolation(model, tokens, 32, ExtrapolationConfig(multipliers=[1], precision="32"),
                                   log=lambda _: None)
    assert plain[0].documents == "none" and plain[0].loss == rows[1].loss
