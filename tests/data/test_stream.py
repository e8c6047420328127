"""data/stream.py through TextDataModule.train_dataloader: samples keyed by the global sample
index (one-rank runs unchanged, resumes on another rank count continue the stream), epoch
sampling, resume with DataLoader workers. Ranks are imitated by one data module per rank with
a stand-in trainer (rank, world size, step, accumulation), as Lightning sets them."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from data.corpus import GutenbergCorpus
from data.stream import GlobalSamples, TrainWindows, load_tokens
from pelab.datamodule import TextDataModule
from tests.data.test_text_data import docs, write_txt


@dataclass
class FakeTrainer:
    global_rank: int = 0
    world_size: int = 1
    global_step: int = 0
    accumulate_grad_batches: int = 1


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("stream") / "train.bin"
    np.arange(100_000, dtype=np.uint32).tofile(path)  # token t sits at position t: a window's first token is its start
    return path


@pytest.fixture(scope="module")
def module(tmp_path_factory):
    """A small text corpus, prepared once; each test gives it its own trainer and state."""
    root = tmp_path_factory.mktemp("corpus")
    write_txt(root / "c", docs(40))
    from data.corpus import TextFilesCorpus

    corpus = TextFilesCorpus([str(root / "c")], val_fraction=0.1)
    dm = TextDataModule(corpus, block_size=16, batch_size=4, seed=3, data_dir=str(root / "data"))
    dm.setup()
    return dm


def rank_module(base: TextDataModule, trainer: FakeTrainer, sampling: str = "random", state: dict | None = None,
                num_workers: int = 0) -> TextDataModule:
    """What one rank builds: the same options and files, its own trainer and restored state."""
    dm = TextDataModule(base.corpus, block_size=base.block_size, batch_size=base.batch_size, seed=base.seed,
                        data_dir=str(base.token_dir.parents[1]), sampling=sampling, num_workers=num_workers)
    dm.setup()
    dm.trainer = trainer
    if state is not None:
        dm.load_state_dict(state)
    return dm


def run_steps(base, world: int, accumulation: int, first_step: int, steps: int, sampling: str = "random",
              state: dict | None = None, num_workers: int = 0):
    """The windows (inputs, one row per sample) each optimisation step trains on over all ranks,
    and the data module state a checkpoint written after the last step holds."""
    per_step: list[list[torch.Tensor]] = [[] for _ in range(steps)]
    saved = None
    for rank in range(world):
        trainer = FakeTrainer(rank, world, first_step, accumulation)
        dm = rank_module(base, trainer, sampling, state, num_workers)
        batches = iter(dm.train_dataloader())
        for s in range(steps):
            for _ in range(accumulation):
                per_step[s].extend(next(batches)[0])
        trainer.global_step = first_step + steps
        saved = dm.state_dict()
        del batches
    return [torch.stack(rows) for rows in per_step], saved


def as_set(rows: torch.Tensor) -> Counter:
    return Counter(tuple(r.tolist()) for r in rows)


def test_one_rank_stream_is_the_one_before_global_keying(tokens):
    """Starts of rank 0 (world 1) hard-coded from the per-rank code at 484f064 (RandomWindows,
    seed 1337): from sample 0, and from 10**9 (a resumed run)."""
    windows = TrainWindows(tokens, "uint32", 64, seed=1337)
    assert [windows.start(g) for g in range(12)] == [52163, 51612, 24342, 40918, 14291, 71565, 95205, 84340, 24673,
                                                    9176, 94363, 50559]
    assert [windows.start(10**9 + g) for g in range(4)] == [32835, 18643, 58893, 71115]
    x, y = windows[3]
    assert x.tolist() == list(range(40918, 40918 + 64)) and y.tolist() == list(range(40919, 40919 + 64))


def test_default_run_first_batch_is_unchanged(cache_root):
    """The default run's data (Gutenberg, bytes, context 256, batch 16, seed 1337), one rank:
    window starts and first batch recorded from the code at 484f064."""
    dm = TextDataModule(GutenbergCorpus(val_fraction=0.1), tokenizer="bytes", block_size=256, batch_size=16, seed=1337)
    dm.setup()
    assert dm.train_set.num_starts == 5647297
    assert [dm.train_set.start(g) for g in range(6)] == [5236338, 1776293, 5481830, 215874, 4204039, 1671694]
    dm.trainer = FakeTrainer()
    x, _ = next(iter(dm.train_dataloader()))
    assert x[:, 0].tolist() == [119, 99, 32, 99, 115, 32, 32, 118, 102, 32, 111, 112, 101, 32, 108, 105]
    assert int(x.sum()) == 372039


def test_global_samples_by_hand():
    # 2 ranks, micro-batches of 3, resumed after 12 samples: rank 1's micro-batches are rows 1, 3, ...
    assert list(GlobalSamples(12, 1, 2, 3, 40)) == [15, 16, 17, 21, 22, 23, 27, 28, 29, 33, 34, 35]
    assert len(GlobalSamples(12, 1, 2, 3, 40)) == 12  # 28 samples left: 4 whole rows of 6
    assert list(GlobalSamples(5, 0, 1, 2, 11)) == [5, 6, 7, 8, 9, 10]


def test_resume_on_four_ranks_continues_the_two_rank_stream(module):
    """tokens_per_step fixed (16 samples): 2 ranks x 4 x accumulation 2, cut at step 3, resumed
    on 4 ranks x 4 x accumulation 1. Every step trains on the uninterrupted run's windows: no
    replay, no gap. The per-rank keying before replayed half of them (ranks 0-1 rewound)."""
    whole, _ = run_steps(module, world=2, accumulation=2, first_step=0, steps=6)
    before, state = run_steps(module, world=2, accumulation=2, first_step=0, steps=3)
    assert state == {"samples_consumed": 48}
    after, _ = run_steps(module, world=4, accumulation=1, first_step=3, steps=3, state=state)
    for s, rows in enumerate(before + after):
        assert as_set(rows) == as_set(whole[s]), s
    # the same with no saved count (a checkpoint from before it was kept): global step x global batch
    after_old, _ = run_steps(module, world=4, accumulation=1, first_step=3, steps=3)
    assert all(as_set(a) == as_set(b) for a, b in zip(after_old, after))
    # and 2 ranks with batch 4 train on the windows one rank with accumulation 2 does
    one, _ = run_steps(module, world=1, accumulation=4, first_step=0, steps=2)
    assert all(as_set(a) == as_set(b) for a, b in zip(one, whole))


def test_saved_count_resumes_when_the_global_batch_changes(module):
    """Without tokens_per_step, 2 -> 3 ranks changes the global batch (8 -> 12 samples): the
    count in the checkpoint, not global_step x the new batch, says where the stream goes on."""
    whole, _ = run_steps(module, world=1, accumulation=1, first_step=0, steps=14)  # 4 samples a step
    _, state = run_steps(module, world=2, accumulation=1, first_step=0, steps=3)
    assert state == {"samples_consumed": 24}
    after, _ = run_steps(module, world=3, accumulation=1, first_step=3, steps=2, state=state)
    assert as_set(torch.cat(after)) == as_set(torch.cat(whole[6:12]))  # samples 24 .. 47


def test_epoch_sampling_visits_every_window_once_per_epoch(tokens):
    windows = TrainWindows(tokens, "uint32", 64, seed=5, sampling="epoch")
    W = (100_000 - 1) // 64
    assert windows.num_windows == W == 1562
    epochs = [[windows.start(g) for g in range(e * W, (e + 1) * W)] for e in range(3)]
    for starts in epochs:
        assert sorted(starts) == list(range(0, W * 64, 64))  # each window once, none overlapping
    assert epochs[0] != epochs[1] != epochs[2]  # a new order each epoch
    assert epochs[0] != sorted(epochs[0])
    again = TrainWindows(tokens, "uint32", 64, seed=5, sampling="epoch")
    assert [again.start(g) for g in range(2 * W - 5, 2 * W + 5)] == epochs[1][-5:] + epochs[2][:5]
    other = TrainWindows(tokens, "uint32", 64, seed=6, sampling="epoch")
    assert [other.start(g) for g in range(W)] != epochs[0]
    negative = TrainWindows(tokens, "uint32", 64, seed=-1, sampling="epoch")  # a seed numpy alone would refuse
    assert sorted(negative.start(g) for g in range(W)) == sorted(epochs[0])
    x, y = windows[7]
    s = epochs[0][7]
    assert x.tolist() == list(range(s, s + 64)) and y.tolist() == list(range(s + 1, s + 65))


def test_epoch_stream_on_ranks_covers_the_split(module):
    """Through the loaders of 3 ranks: the first epoch's samples are every window of the split
    once (the windows' token contents, as a multiset), then the next epoch starts over."""
    dm = rank_module(module, FakeTrainer(), "epoch")
    W = dm.train_set.num_windows
    tokens = np.asarray(load_tokens(dm.split_path("train"), "uint16"))  # one file, or a sharded cache's parts
    expected = as_set(torch.from_numpy(tokens[: W * 16].astype(np.int64)).view(W, 16))
    steps = -(-W // 12) + 1  # 3 ranks x 4 samples a step, past the end of the first epoch
    rows, _ = run_steps(module, world=3, accumulation=1, first_step=0, steps=steps, sampling="epoch")
    stream = torch.cat(rows)  # in global sample order: rank 0's micro-batch, then rank 1's, ...
    assert as_set(stream[:W]) == expected
    assert not as_set(stream[W:]) - expected and len(stream) - W >= 12


@pytest.mark.parametrize("sampling", ["random", "epoch"])
def test_resume_mid_epoch_with_workers_is_exact(module, sampling):
    """Two DataLoader workers (they prefetch ahead of training): the state counts optimisation
    steps, so a resume mid-epoch continues with the exact next batches, in order."""
    W = rank_module(module, FakeTrainer(), sampling).train_set.num_windows
    cut = W // 8 + 1  # mid-epoch: 8 samples a step
    whole, _ = run_steps(module, 2, 1, 0, cut + 3, sampling)
    _, state = run_steps(module, 2, 1, 0, cut, sampling, num_workers=2)
    after, _ = run_steps(module, 2, 1, cut, 3, sampling, state=state, num_workers=2)
    for a, b in zip(after, whole[cut:]):
        assert torch.equal(a, b)


def test_bad_sampling_is_one_line_before_data(tmp_path, monkeypatch):
    import data.cache
    import pelab.datamodule
    from pelab.config import ConfigError
    from pelab.validate import validate_config

    for where in (data.cache, pelab.datamodule):
        monkeypatch.setattr(where, "prepare_token_files", lambda *a, **k: pytest.fail("data was read"))
    (cfg,) = compose_configs(tmp_path, ["data.sampling=bogus"])
    with pytest.raises(ConfigError, match=r"^data\.sampling='bogus' is not valid; allowed: random, epoch$"):
        validate_config(cfg)


def compose_configs(tmp_path, *overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(Path(__file__).resolve().parents[2] / "conf"), version_base="1.3"):
        return [compose("config", overrides=[*o, f"paths.output_dir={tmp_path / 'out'}"]) for o in overrides]


def test_gpu_presets_load_with_workers(tmp_path):
    cpu, gpu, ddp, fsdp, synthetic, given = compose_configs(
        tmp_path, [], ["trainer=gpu"], ["trainer=ddp"], ["trainer=fsdp"], ["trainer=fsdp", "data=synthetic"],
        ["trainer=ddp", "data.num_workers=1"])
    assert [c.data.num_workers for c in (cpu, gpu, ddp, fsdp, synthetic, given)] == [0, 4, 4, 4, 4, 1]
    assert "loader" not in gpu.trainer and gpu.trainer.accelerator == "gpu"  # nothing extra for Lightning's Trainer


@pytest.mark.parametrize("node_rank, calls", [(0, 1), (1, 0)])
def test_only_the_first_node_prepares(module, monkeypatch, node_rank, calls):
    """Lightning's own gate (its data connector) on local rank 0 of node 0 and of node 1."""
    import lightning as L

    from lightning.pytorch.utilities.rank_zero import rank_zero_only
    from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

    monkeypatch.setenv("NODE_RANK", str(node_rank))
    for gate in (rank_zero_only, utils_rank_zero_only):  # the Trainer sets the process-wide rank: restored after
        monkeypatch.setattr(gate, "rank", gate.rank)
    dm = rank_module(module, FakeTrainer())
    prepared = []
    monkeypatch.setattr(dm, "prepare_data", lambda: prepared.append(1))
    trainer = L.Trainer(accelerator="cpu", devices=1, num_nodes=2, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False)
    model = L.LightningModule()
    trainer.strategy.connect(model)
    trainer._data_connector.attach_datamodule(model, datamodule=dm)
    assert (trainer.node_rank, trainer.local_rank) == (node_rank, 0)
    trainer._data_connector.prepare_data()
    assert len(prepared) == calls
