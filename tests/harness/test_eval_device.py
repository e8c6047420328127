"""The end-of-training evaluation runs on the device that trained, not where Lightning's teardown
parks the module (the CPU, after a GPU run).

On a CPU-only machine the GPU case is imitated by a strategy whose teardown parks the model on
the meta device (no values, so nothing can be scored there) and whose ``model_to_device`` brings
it back to the root device with its trained weights, as a move from the host back to a GPU would.
A probe run on the parked module would see the meta device; the test asserts the device each
probe saw is the strategy's root device, and that the module is parked again afterwards."""

import copy
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.utils.data import DataLoader, TensorDataset

import pelab.probes
from pelab.lit import LitGPT
from pelab.probes import EndOfTrainingEvaluation

TINY = dict(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16)


class ParkingStrategy(SingleDeviceStrategy):
    """Test-only: teardown leaves the GPT on another device than the root device (meta: values
    kept aside), and ``model_to_device`` returns it to the root device with its weights."""

    def __init__(self) -> None:
        super().__init__(device=torch.device("cpu"))
        self.kept: torch.nn.Module | None = None

    def teardown(self) -> None:
        super().teardown()
        module = self.lightning_module
        self.kept, module.model = module.model, copy.deepcopy(module.model).to("meta")

    def model_to_device(self) -> None:
        if self.kept is not None:
            self.lightning_module.model, self.kept = self.kept, None
        super().model_to_device()


class HeldOut(L.LightningDataModule):
    """Training batches and a held-out token file, as pelab's text data modules give them."""

    held_out_text = True
    meta = {"dtype": "uint16"}

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        tokens = torch.from_numpy(np.fromfile(path, dtype=np.uint16).astype(np.int64))
        x = tokens[: 64 * 17].view(64, 17)
        self.train_set = TensorDataset(x[:, :-1], x[:, 1:])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=4)

    def split_path(self, split: str) -> Path:
        return self.path

    def unigram_loss(self) -> float:
        return 4.0


def test_end_of_training_probes_run_on_the_root_device_not_where_teardown_parks_the_module(
        tmp_path, monkeypatch, capsys):
    tokens = tmp_path / "val.bin"
    np.random.default_rng(0).integers(0, 64, 4096, dtype=np.uint16).tofile(tokens)
    seen: list[torch.device] = []
    run = pelab.probes.run_evaluations

    def recording(subject, *args, **kwargs):  # the device of the weights the probes are given
        seen.append(next(subject.gpt.parameters()).device)
        return run(subject, *args, **kwargs)

    monkeypatch.setattr(pelab.probes, "run_evaluations", recording)
    torch.manual_seed(0)
    module = LitGPT(model=TINY, pe={"_target_": "model.pe.rope.RoPE"}, optim={"warmup_steps": 1})
    strategy = ParkingStrategy()
    evaluation = EndOfTrainingEvaluation(extrapolation={"enabled": True, "multipliers": [1, 2], "precision": "32"},
                                         probe={"enabled": False}, tasks={"enabled": False})
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=2, precision="32-true", logger=False,
                        callbacks=[evaluation], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path)
    trainer.fit(module, datamodule=HeldOut(tokens))

    assert seen == [strategy.root_device]  # today's code handed the probes the parked (meta) module
    out = capsys.readouterr().out
    assert f"[pelab] evaluation on {strategy.root_device}: extrapolation" in out
    rows = (tmp_path / "extrapolation" / "extrapolation.csv").read_text().splitlines()
    assert len(rows) == 3 and all("nan" not in row for row in rows)  # scored with the trained weights
    assert next(module.parameters()).device.type == "meta"  # parked again where teardown left it


def test_the_module_goes_back_where_teardown_left_it_when_a_probe_fails():
    from types import SimpleNamespace

    module = LitGPT(model=TINY, pe={"_target_": "model.pe.rope.RoPE"}, optim={"warmup_steps": 1})
    strategy = ParkingStrategy()
    strategy.connect(module)
    strategy.kept, module.model = module.model, copy.deepcopy(module.model).to("meta")  # as teardown leaves it
    with pytest.raises(RuntimeError, match="probe failed"):
        with pelab.probes.on_training_device(SimpleNamespace(strategy=strategy), module):
            assert next(module.parameters()).device == strategy.root_device
            raise RuntimeError("probe failed")
    assert next(module.parameters()).device.type == "meta"
