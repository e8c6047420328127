"""Attention maps (evaluation/attention_maps.py): the eager pass against the fused path,
the per-head summaries against hand values, the plot, and the Lightning callback."""

from __future__ import annotations

import csv
import math
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from torch.utils.data import DataLoader, TensorDataset

from evaluation.attention_maps import (
    attention_probs,
    eager_attention_pass,
    head_summaries,
    plot_attention_grid,
    summary_metrics,
)
from pelab.lit import LitGPT
from pelab.probes import AttentionMaps
from model.pe import SCHEMES
from tests.tiny import tiny_gpt


TINY = dict(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32)
ALIBI = {"_target_": "model.pe.alibi.ALiBi"}


# --------------------------------------------------------------------------------------
# the eager pass
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", [n for n in sorted(SCHEMES) if SCHEMES[n].terms != "scores"])  # no fused route
def test_probs_match_fused_attention_and_hidden(scheme, monkeypatch):
    gpt = tiny_gpt(scheme, sharpen=0.3, **TINY)
    idx = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(1))

    # Record every fused call of the real forward: its q, k, v and output.
    calls = []
    sdpa = F.scaled_dot_product_attention

    def recording(q, k, v, *args, **kwargs):
        out = sdpa(q, k, v, *args, **kwargs)
        calls.append((v, out))
        return out

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    with torch.no_grad():
        reference = gpt.hidden(idx)
    monkeypatch.undo()
    assert len(calls) == TINY["n_layer"]

    result = eager_attention_pass(gpt, idx, return_hidden=True)
    assert sorted(result.probs) == [0, 1]
    for layer, (v, fused) in enumerate(calls):
        p = result.probs[layer]
        assert p.shape == (2, 4, 20, 20) and p.dtype == torch.float32
        torch.testing.assert_close(p @ v, fused, atol=1e-5, rtol=1e-5)
        # rows are distributions, exactly zero above the diagonal, and not trivially uniform
        torch.testing.assert_close(p.sum(-1), torch.ones(2, 4, 20), atol=1e-6, rtol=0)
        assert (p.triu(diagonal=1) == 0).all()
        lower = torch.ones(20, 20, dtype=torch.bool).tril()
        assert (p[..., lower] > 0).all()
        assert (p[..., -1, :] - 1 / 20).abs().max() > 1e-2
    torch.testing.assert_close(result.hidden, reference, atol=1e-5, rtol=1e-5)
    assert not any(q.requires_grad for q in result.probs.values())

    # The public helper gives the same maps; a layer subset returns just those layers.
    probs = attention_probs(gpt, idx)
    for layer in probs:
        torch.testing.assert_close(probs[layer], result.probs[layer], atol=0, rtol=0)
    assert sorted(attention_probs(gpt, idx, layers=[-1])) == [1]


def test_explicit_positions_eval_mode_and_mode_restored():
    gpt = tiny_gpt("alibi", sharpen=0.3, **TINY, dropout=0.5)  # dropout makes a train-mode pass differ
    idx = torch.randint(0, 64, (1, 12))
    positions = torch.arange(12) + 7
    with torch.no_grad():
        fused = gpt.hidden(idx, positions)
    result = eager_attention_pass(gpt, idx, positions, return_hidden=True)
    torch.testing.assert_close(result.hidden, fused, atol=1e-5, rtol=1e-5)
    assert torch.equal(result.positions, positions)

    gpt.train()
    gpt.blocks[1].mlp.eval()  # a mixed state must come back exactly
    probs = attention_probs(gpt, idx, positions=positions)
    for layer in probs:  # computed in eval mode: no dropout
        torch.testing.assert_close(probs[layer], result.probs[layer], atol=0, rtol=0)
    assert gpt.training and gpt.blocks[0].attn.training and not gpt.blocks[1].mlp.training
    with pytest.raises(ValueError, match="layer"):
        attention_probs(gpt, idx, layers=[2])


# --------------------------------------------------------------------------------------
# summaries
# --------------------------------------------------------------------------------------


def naive_summaries(p: torch.Tensor, positions: list[int]) -> tuple[list[float], list[float]]:
    """Loop reference for one (B, H, T, T) tensor: per-head mean distance and entropy."""
    B, H, T, _ = p.shape
    dist, ent = [], []
    for h in range(H):
        d_sum = e_sum = 0.0
        for b in range(B):
            for i in range(T):
                for j in range(T):
                    pij = float(p[b, h, i, j])
                    d_sum += pij * (positions[i] - positions[j])
                    if pij > 0:
                        e_sum -= pij * math.log(pij)
        dist.append(d_sum / (B * T))
        ent.append(e_sum / (B * T))
    return dist, ent


def test_head_summaries_hand_values():
    T = 5
    uniform = torch.tril(torch.ones(T, T)) / torch.arange(1, T + 1)[:, None]  # row i: 1/(i+1) on j <= i
    onehot = torch.eye(T)  # attends to itself: distance 0, entropy 0
    first = torch.zeros(T, T)
    first[:, 0] = 1.0  # attends to token 0: distance i, entropy 0
    p = torch.stack([uniform, onehot, first])[None]  # (1, 3, T, T)
    s = head_summaries({0: p})[0]
    # uniform: mean_i i/2 = (0 + .5 + 1 + 1.5 + 2) / 5 = 1.0; mean_i log(i + 1) = log(5!) / 5
    torch.testing.assert_close(s["distance"], torch.tensor([1.0, 0.0, 2.0]))
    torch.testing.assert_close(s["entropy"], torch.tensor([math.log(120) / 5, 0.0, 0.0]))
    # explicit positions scale the distances (positions 0, 2, 4, ...), entropy unchanged
    s2 = head_summaries({0: p}, positions=torch.arange(T) * 2)[0]
    torch.testing.assert_close(s2["distance"], torch.tensor([2.0, 0.0, 4.0]))
    assert summary_metrics({3: s})["attention/L3H2/distance"] == pytest.approx(2.0)


def test_head_summaries_match_loop_on_model_probs():
    gpt = tiny_gpt("rope_alibi", sharpen=0.3, **TINY)
    idx = torch.randint(0, 64, (2, 9))
    positions = torch.tensor([0, 1, 2, 4, 5, 8, 9, 10, 13])
    probs = attention_probs(gpt, idx, positions)
    summaries = head_summaries(probs, positions)
    for layer, p in probs.items():
        dist, ent = naive_summaries(p, positions.tolist())
        torch.testing.assert_close(summaries[layer]["distance"], torch.tensor(dist), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(summaries[layer]["entropy"], torch.tensor(ent), atol=1e-5, rtol=1e-5)


def test_plot_grid_layout(tmp_path):
    probs = attention_probs(tiny_gpt("rope", sharpen=0.3, **TINY), torch.randint(0, 64, (1, 10)))
    fig = plot_attention_grid(probs, heads=[0, 2], title="t")
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == ["L0 H0", "L0 H2", "L1 H0", "L1 H2"]
    assert len(fig.axes) == 5  # + colorbar
    data = panels[0].images[0].get_array()
    assert data.mask[0, 1:].all() and not data.mask[-1].any()  # causal upper triangle blank
    fig.savefig(tmp_path / "grid.png")
    assert (tmp_path / "grid.png").stat().st_size > 0


# --------------------------------------------------------------------------------------
# the callback
# --------------------------------------------------------------------------------------


class RecordingWandb(WandbLogger):
    """A WandbLogger that records calls instead of starting a W&B run."""

    def __init__(self) -> None:  # no super().__init__: nothing of wandb is touched
        self.images, self.metrics = [], []

    @property
    def experiment(self):
        return None

    @property
    def name(self):
        return "recording"

    @property
    def version(self):
        return "0"

    @property
    def save_dir(self):
        return None

    def log_hyperparams(self, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.metrics.append((step, dict(metrics)))

    def log_image(self, key, images, step=None, **kwargs):
        self.images.append((key, list(images), step))

    def save(self):
        pass

    def finalize(self, status):
        pass


class ModeProbe(L.Callback):
    """Records that every training step runs in train mode."""

    def __init__(self) -> None:
        self.modes = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.modes.append(pl_module.training and pl_module.model.blocks[0].training)


class TinyData(L.LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.train_set = TensorDataset(*self._xy(torch.randint(0, 64, (16, 33), generator=g)))
        self.val_set = TensorDataset(*self._xy(torch.randint(0, 64, (2, 33), generator=g)))

    @staticmethod
    def _xy(t):
        return t[:, :-1], t[:, 1:]

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=2)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=2)


def tiny_module() -> LitGPT:
    torch.manual_seed(0)
    return LitGPT(model=TINY, pe=ALIBI, optim={"warmup_steps": 1, "weight_decay": 0.0})


def fit(tmp_path, callback, use_datamodule=True, max_steps=5):
    csv_logger = CSVLogger(tmp_path, name="csv", version="")
    wandb = RecordingWandb()
    probe = ModeProbe()
    trainer = L.Trainer(
        default_root_dir=tmp_path, max_steps=max_steps, val_check_interval=1, limit_val_batches=1,
        num_sanity_val_steps=1, accelerator="cpu", logger=[csv_logger, wandb], callbacks=[callback, probe],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
    )
    module = tiny_module()
    if use_datamodule:
        trainer.fit(module, datamodule=TinyData())
    else:
        data = TinyData()
        trainer.fit(module, data.train_dataloader(), data.val_dataloader())
    return trainer, module, csv_logger, wandb, probe


def test_callback_in_a_fit(tmp_path):
    callback = AttentionMaps(every_n_validations=2, sample_length=16, heads=[0, 3])
    trainer, module, csv_logger, wandb, probe = fit(tmp_path, callback)

    # 5 validations after steps 1..5 (the sanity check not counted): every 2nd + fit end
    files = sorted(p.name for p in (tmp_path / "attention").iterdir())
    assert files == ["step000002.png", "step000004.png", "step000005.png"]
    assert callback.validations == 5
    assert all(probe.modes) and len(probe.modes) == 5 and module.training

    assert [(key, step) for key, _, step in wandb.images] == [("attention/maps", s) for s in (2, 4, 5)]
    assert wandb.images[0][1] == [str(tmp_path / "attention" / "step000002.png")]
    attention_logs = [(s, m) for s, m in wandb.metrics if "attention/L0H0/distance" in m]
    assert [s for s, _ in attention_logs] == [2, 4, 5]
    assert len(attention_logs[0][1]) == 2 * 4 * 2  # layers x heads x {distance, entropy}

    with open(tmp_path / "csv" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("attention/L1H3/entropy")]
    assert [int(r["step"]) for r in rows] == [2, 4, 5]
    for r in rows:
        assert 0.0 <= float(r["attention/L1H3/distance"]) <= 15.0  # T = 16 sample
        assert 0.0 <= float(r["attention/L1H3/entropy"]) <= math.log(16)


def test_callback_without_datamodule_uses_val_loader(tmp_path):
    callback = AttentionMaps(every_n_validations=3, layers=[1])
    trainer, module, *_ = fit(tmp_path, callback, use_datamodule=False, max_steps=3)
    assert sorted(p.name for p in (tmp_path / "attention").iterdir()) == ["step000003.png"]
    assert callback._sample.shape == (1, 32)
    assert torch.equal(callback._sample[0], TinyData().val_set[0][0])
    assert set(callback.last_metrics) == {f"attention/L1H{h}/{n}" for h in range(4) for n in ("distance", "entropy")}


def test_callback_restores_training_mode(tmp_path):
    module = tiny_module()
    module.train()
    data = TinyData()
    trainer = SimpleNamespace(
        sanity_checking=False, is_global_zero=True, datamodule=data, val_dataloaders=None,
        global_step=7, default_root_dir=str(tmp_path), log_dir=None, loggers=[],
    )
    callback = AttentionMaps(every_n_validations=1, max_heads_plotted=2)
    callback.on_validation_epoch_end(trainer, module)
    assert module.training and all(m.training for m in module.modules())
    assert callback.last_path == tmp_path / "attention" / "step000007.png" and callback.last_path.exists()
    callback.on_train_end(trainer, module)  # same step: not redone
    assert callback.validations == 1
    trainer.sanity_checking = True
    callback.on_validation_epoch_end(trainer, module)
    assert callback.validations == 1
    assert callback.state_dict() == {"validations": 1}
