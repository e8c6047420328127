"""Data parallelism on CPU processes (gloo): gradient parity with one process, validation and
extrapolation sharded across ranks with the single-process values, the tokens-per-step rule."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def worker(devices: int, batch: int, tokens: Path, out: Path) -> dict:
    proc = subprocess.run([sys.executable, "tests/harness/ddp_worker.py", str(devices), str(batch), str(tokens), str(out)],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=True)


def test_two_ranks_with_batch_b_equal_one_process_with_2b_and_validate_disjoint_shards(tmp_path):
    tokens = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, 256, 20_000, dtype=np.uint16).tofile(tokens)
    one = worker(1, 8, tokens, tmp_path / "one.pt")
    two = worker(2, 4, tokens, tmp_path / "two.pt")
    for name, value in one["params"].items():
        torch.testing.assert_close(two["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert one["val_batches"] == 6 and two["val_batches"] == 3  # 22 windows: rank 0 holds 11 of them, not 22
    assert two["val_loss"] == pytest.approx(one["val_loss"], rel=1e-6)  # token-weighted over the same windows
    # the extrapolation table: each rank scored half the windows, summed NLL and counts reduced
    assert [row[:3] for row in two["table"]] == [row[:3] for row in one["table"]]
    # every window of 6000 tokens: 187 x 32, 46 x 128; sliding (stride = half): 373 x 16, 92 x 64
    assert [row[2] for row in one["table"]] == [5984, 5888, 5968, 5888]
    assert [row[3] for row in two["table"]] == pytest.approx([row[3] for row in one["table"]], rel=1e-9)
    # loss by position: per-position sums and counts all-reduced with the totals (exact counts)
    assert [row[:5] for row in two["positions"]] == [row[:5] for row in one["positions"]]
    # float32 forwards of differently composed batches: ~6e-8 per position (the totals average it out)
    assert [row[5] for row in two["positions"]] == pytest.approx([row[5] for row in one["positions"]], rel=1e-6)
    assert {(n, mode): sum(r[4] for r in two["positions"] if r[:2] == (n, mode)) for n, mode, *_ in two["table"]} \
        == {(n, mode): tokens for n, mode, tokens, _ in two["table"]}


@pytest.mark.parametrize("tokens_per_step, batch, block, devices, nodes, expected", [
    (524288, 16, 1024, 8, 2, 2),   # nanoGPT's 0.5M-token GPT-2 batch on 2 nodes of 8 GPUs
    (524288, 16, 1024, 4, 1, 8),
    (4096, 16, 256, 1, 1, 1),
])
def test_tokens_per_step_sets_the_accumulation(tokens_per_step, batch, block, devices, nodes, expected):
    from pelab.batch import accumulation_for

    assert accumulation_for(tokens_per_step, batch, block, devices, nodes) == expected


@pytest.mark.parametrize("tokens_per_step, why", [
    (500000, r"data.tokens_per_step=500000 is not a whole number .* = 262144 tokens; allowed: a multiple of "
             r"262144, e.g. 262144 or 524288"),
    (131072, r"allowed: a multiple of 262144, e.g. 262144$"),
    (0, r"data.tokens_per_step=0 is not valid"),
])
def test_impossible_tokens_per_step_is_named(tokens_per_step, why):
    from pelab.batch import accumulation_for
    from pelab.config import ConfigError

    with pytest.raises(ConfigError, match=why):
        accumulation_for(tokens_per_step, 16, 1024, 8, 2)


def test_fsdp_preset_builds_a_block_wrapped_full_shard_strategy():
    """Lightning 2.6 refuses FSDP without a GPU, so on CPU the preset is checked as far as it
    can be: it composes with the model presets and builds the strategy Lightning will run."""
    import hydra
    from hydra import compose, initialize_config_dir
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.fsdp import ShardingStrategy

    from model.config import GPTConfig
    from model.gpt import Block

    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        cfg = compose("config", overrides=["trainer=fsdp", "model=gpt2_medium", "data=gutenberg_gpt2"])
    strategy = hydra.utils.instantiate(cfg.trainer.strategy)
    assert isinstance(strategy, FSDPStrategy) and strategy.sharding_strategy == ShardingStrategy.FULL_SHARD
    assert strategy.requested_state_dict_type == "auto"  # sharded above 2 GiB of state (gpt2_medium: 4.2 GiB)
    assert strategy.kwargs["auto_wrap_policy"]._module_classes == {Block}
    assert (cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd, cfg.model.block_size) == (24, 16, 1024, 1024)
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        large = compose("config", overrides=["trainer=fsdp", "model=gpt2_large"]).model
    config = GPTConfig(vocab_size=50257, **large)
    # GPT-2 large: 774M parameters = 12 L d^2 (blocks) + V d (tied embedding) + T d (learned positions)
    params = 12 * config.n_layer * config.n_embd**2 + config.padded_vocab_size * config.n_embd + 1024 * config.n_embd
    assert abs(params / 774e6 - 1) < 0.01 and config.head_dim == 64


def test_end_of_training_evaluation_says_it_is_skipped_under_fsdp(tmp_path):
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy

    from pelab.probes import EndOfTrainingEvaluation

    class Data:
        def unigram_loss(self):
            return 3.25

        def split_path(self, split):
            raise AssertionError("no evaluation may read the held-out split under FSDP")

    trainer = SimpleNamespace(strategy=FSDPStrategy(), checkpoint_callback=None, datamodule=Data(), loggers=[],
                              default_root_dir=str(tmp_path), global_step=7, is_global_zero=True, world_size=2,
                              callback_metrics={})
    callback = EndOfTrainingEvaluation(extrapolation={"enabled": True}, tasks={"enabled": False})
    with pytest.warns(UserWarning, match=r"skipped under FSDPStrategy .* scripts/eval_extrapolation.py"):
        callback.on_fit_end(trainer, pl_module=None)
    assert not (tmp_path / "extrapolation").exists()
    assert float(trainer.callback_metrics["val/unigram_loss"]) == 3.25  # the model-free baseline still runs


def test_attention_maps_say_they_are_skipped_under_fsdp(tmp_path):
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy

    from pelab.probes import AttentionMaps

    trainer = SimpleNamespace(strategy=FSDPStrategy(), global_step=3, is_global_zero=True,
                              default_root_dir=str(tmp_path), log_dir=None)
    with pytest.warns(UserWarning, match=r"AttentionMaps: skipped under FSDPStrategy"):
        AttentionMaps().run(trainer, pl_module=None)
    assert not any(tmp_path.iterdir())
