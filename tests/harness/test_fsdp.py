"""Validation shards that give every rank the same number of batches (FSDP gathers parameters in
every forward), with the token-weighted loss of one process."""

import warnings
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import Dataset


class Numbered(Dataset):
    """Window i: inputs all i, targets i + 1 (a few of them ignored)."""

    def __init__(self, count: int, length: int = 8) -> None:
        self.count, self.length = count, length

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int):
        y = torch.full((self.length,), (i + 1) % 64)
        y[: i % 3] = -1
        return torch.full((self.length,), i % 64), y


def rank_loaders(count: int, world: int, batch: int, dataset: Dataset | None = None) -> list:
    from data.datamodule import StreamDataModule

    data = StreamDataModule()
    data.val_set, data.val_batch_size, data.num_workers = dataset or Numbered(count), batch, 0
    loaders = []
    for rank in range(world):
        data.trainer = SimpleNamespace(global_rank=rank, world_size=world)
        loaders.append(list(data.val_dataloader()))
    return loaders


@pytest.mark.parametrize("count, world, batch", [(256, 6, 14), (22, 2, 4), (5, 2, 2), (9, 4, 2), (1, 3, 4),
                                                 (256, 8, 32), (100, 3, 7)])
def test_validation_shards_have_equal_batch_counts(count, world, batch):
    loaders = rank_loaders(count, world, batch)
    assert len({len(batches) for batches in loaders}) == 1, [len(batches) for batches in loaders]
    seen = []
    for rank, batches in enumerate(loaders):
        for x, y in batches:
            padding = (y < 0).all(dim=1)
            assert not padding.any() or len(y) == 1  # a padding window sits alone in its batch
            seen += x[~padding, 0].tolist()
        assert sum(len(x) for x, _ in batches) <= -(-count // world)  # at most one padding window
    assert sorted(seen) == sorted(i % 64 for i in range(count))  # every window once, on one rank


def test_padding_leaves_the_token_weighted_validation_loss_unchanged():
    """256 windows, 6 ranks, batches of 14 (ranks 4 and 5 get a padding batch): the loss summed
    over the ranks as torchmetrics reduces it equals one process's, and the ignored-only batch
    adds exactly nothing (no NaN for the metric to drop)."""
    from pelab.lit import LitGPT

    torch.manual_seed(0)
    module = LitGPT(model=dict(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=16),
                    pe={"_target_": "model.pe.rope.RoPE"})
    module.eval()

    def states(batches) -> tuple[float, float]:
        module.val_loss.reset()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*nan.*")
            for i, batch in enumerate(batches):
                module.validation_step(batch, i)
        return float(module.val_loss.mean_value), float(module.val_loss.weight)

    dataset = Numbered(256, length=32)
    (one,) = [states(batches) for batches in rank_loaders(256, 1, 14, dataset)]
    shards = [states(batches) for batches in rank_loaders(256, 6, 14, dataset)]
    assert sum(w for _, w in shards) == one[1]  # the same scored targets
    assert sum(v for v, _ in shards) / sum(w for _, w in shards) == pytest.approx(one[0] / one[1], rel=1e-6)
