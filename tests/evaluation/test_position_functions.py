"""The learned position functions plotted at the end of training (pelab/probes.py, evaluation/position_functions.py)
against the parameters by hand: T5's table rows, KERPLE's kernel, RoPE's frequency factors."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from model.config import GPTConfig
from pelab.lit import LitGPT
from pelab.probes import PositionFunctions
from model.pe import SCHEMES
from tests.tiny import has_parameters, schemes_where

CONFIG = GPTConfig(vocab_size=32, block_size=200, n_layer=1, n_head=4, n_embd=32)


def test_t5_curve_is_the_bucket_table():
    pe = SCHEMES["t5"](CONFIG)
    x, y, _ = pe.learned_functions(200)["bias vs distance"]
    table = pe.relative_attention_bias.weight.detach()  # (32 buckets, 4 heads)
    assert x.tolist() == list(range(201)) and y.shape == (4, 201)
    for d in range(16):  # exact buckets: distance d is bucket d
        torch.testing.assert_close(y[:, d], table[d])
    # 16 + floor(16 * ln(20/16) / ln(8)) = 16 + floor(1.7168) = 17
    torch.testing.assert_close(y[:, 20], table[17])
    for d in (128, 150, 200):  # max_distance and beyond share the last bucket
        torch.testing.assert_close(y[:, d], table[31])


def test_kerple_curve_is_the_kernel():
    pe = SCHEMES["kerple_log"](CONFIG)
    _, y, _ = pe.learned_functions(200)["bias vs distance"]
    r1, r2 = pe.r1.detach().tolist(), pe.r2.detach().tolist()
    for h in range(4):
        for d in (0, 1, 7, 200):
            assert y[h, d].item() == pytest.approx(-r1[h] * math.log(1 + r2[h] * d), rel=1e-5, abs=1e-6)


def test_learnable_frequencies_curve_and_nothing_for_fixed_schemes():
    pe = SCHEMES["rope"](CONFIG, learnable_freq=True)
    with torch.no_grad():
        pe.log_freq_scale.copy_(torch.linspace(-0.5, 0.5, 4))
    curves = pe.learned_functions(200)
    _, y, _ = curves["frequency factor exp(alpha_k)"]
    torch.testing.assert_close(y[0], torch.tensor([math.exp(v) for v in (-0.5, -1 / 6, 1 / 6, 0.5)]))
    for name in schemes_where(lambda pe: not has_parameters(pe)):
        assert SCHEMES[name](CONFIG).learned_functions(200) == {}


def test_callback_writes_the_plot_at_the_end_of_a_fit(tmp_path):
    x = torch.randint(0, 32, (16, 17))
    loader = DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=4)
    for target, expect in (("model.pe.t5.T5RelativeBias", True), ("model.pe.rope.RoPE", False)):
        module = LitGPT(model={"vocab_size": 32, "block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 16},
                        pe={"_target_": target})
        callback = PositionFunctions()
        trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
                            default_root_dir=tmp_path / target)
        trainer.fit(module, train_dataloaders=loader)
        if expect:
            assert callback.last_path == tmp_path / target / "position_functions" / "step000002.png"
            assert callback.last_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        else:
            assert callback.last_path is None and not (tmp_path / target / "position_functions").exists()
