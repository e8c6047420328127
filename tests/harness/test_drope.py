"""``experiment=drope`` and ``drope_passkey`` (conf/experiment/): a RoPE run's weights (a language
model's, a passkey model's), every position removed, recalibrated at the original length. Without ``init_from`` it is refused in one line before any
data is read; with a RoPE checkpoint every weight loads and the model attends as pe=nope with
those weights (no layer rotates), not as the RoPE base."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from model.config import GPTConfig
from model.gpt import GPT
from model.pe import SCHEMES
from pelab.checkpoint import load_init_weights
from pelab.lit import LitGPT
from pelab.validate import validate_config
from tests.harness.test_train import compose_config

SMALL = ["model.n_layer=2", "model.n_embd=32", "model.n_head=4"]  # both sides: only the size of the test changes
VOCAB = 64


# (the base's experiment, the DroPE experiment that starts from it)
PAIRS = [("context_extension_base", "drope"), ("task_ablation", "drope_passkey")]


def save_rope_base(path, pe="rope", base="context_extension_base"):
    """A checkpoint as train.py writes one (weights and hyper-parameters), of experiment ``base``."""
    cfg = compose_config([f"experiment={base}", *SMALL, f"pe={pe}"])
    torch.manual_seed(0)
    lit = LitGPT(model={**OmegaConf.to_container(cfg.model), "vocab_size": VOCAB}, pe=OmegaConf.to_container(cfg.pe),
                 optim=OmegaConf.to_container(cfg.optim))
    torch.save({"state_dict": lit.state_dict(), "hyper_parameters": dict(lit.hparams), "global_step": 1000}, path)
    return lit.model


@pytest.mark.parametrize("experiment", ["drope", "drope_passkey"])
def test_without_init_from_it_is_refused_in_one_line_before_any_work(experiment, tmp_path, monkeypatch):
    import lightning as L

    import pelab.datamodule
    from pelab.config import ConfigError
    from train import train

    def forbidden(*args, **kwargs):
        pytest.fail("data was read or compute spent without init_from")

    monkeypatch.setattr(pelab.datamodule, "prepare_token_files", forbidden)
    monkeypatch.setattr(L.Trainer, "fit", forbidden)
    out = tmp_path / "out"
    with pytest.raises(ConfigError) as err:
        train(compose_config([f"experiment={experiment}", "logger=csv"], out))
    assert str(err.value) == ("init_from must be a RoPE run's checkpoint, recalibrated without positions "
                              "(init_from=RUN_DIR/checkpoints/last.ckpt), got None")
    assert not out.exists()


@pytest.mark.parametrize("base_experiment,experiment", PAIRS)
def test_a_rope_checkpoint_loads_every_weight_and_attends_without_positions(base_experiment, experiment, tmp_path):
    base = save_rope_base(tmp_path / "base.ckpt", base=base_experiment)
    cfg = compose_config([f"experiment={experiment}", *SMALL, f"init_from={tmp_path / 'base.ckpt'}"])
    checked = validate_config(cfg)
    assert cfg.model.block_size == base.config.block_size == 128  # recalibrated at the original length
    position = checked.position
    drope = GPT(GPTConfig(**{**OmegaConf.to_container(cfg.model), "vocab_size": VOCAB}), position.scheme,
                position.nope_layers)
    assert drope.nope_layers == frozenset(range(2))  # every layer
    load_init_weights(drope, checked.init_state, cfg.init_from)
    assert drope.state_dict().keys() == base.state_dict().keys()
    for key, value in base.state_dict().items():
        assert torch.equal(drope.state_dict()[key], value), key
    nope = GPT(drope.config, SCHEMES["nope"](drope.config))
    nope.load_state_dict(base.state_dict())
    idx = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        dropped = drope.eval()(idx)[0]
        assert torch.equal(dropped, nope.eval()(idx)[0])
        assert not torch.allclose(dropped, base.eval()(idx)[0])


def test_a_checkpoint_of_another_scheme_is_refused_naming_it(tmp_path):
    save_rope_base(tmp_path / "alibi.ckpt", pe="alibi")
    with pytest.raises(ValueError, match=r"has another architecture: it was trained with pe=alibi .* this run has "
                                         r"pe=rope"):
        validate_config(compose_config(["experiment=drope", *SMALL, f"init_from={tmp_path / 'alibi.ckpt'}"]))
