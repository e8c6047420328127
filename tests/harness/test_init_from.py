"""``init_from=CKPT``: a run that starts from another run's weights (context extension), checked
before any data is read; the weights it loads equal the checkpoint's (a learned table linearly
interpolated to a new length, checked against a hand-written float64 loop)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from pelab.lit import LitGPT
from pelab.validate import validate_config
from tests.harness.test_train import compose_config

SMALL = ["model.n_layer=1", "model.n_embd=32", "model.n_head=4", "model.block_size=32"]


def save_base(path, overrides=(), optimizer=False, seed=0):
    """A pelab checkpoint as train.py writes it (weights and hyper-parameters), trained at 32."""
    cfg = compose_config([*SMALL, *overrides])
    torch.manual_seed(seed)
    lit = LitGPT(model={**OmegaConf.to_container(cfg.model), "vocab_size": 64}, pe=OmegaConf.to_container(cfg.pe),
                 optim=OmegaConf.to_container(cfg.optim))
    ckpt = {"state_dict": lit.state_dict(), "hyper_parameters": dict(lit.hparams), "global_step": 7}
    if optimizer:  # a resumable checkpoint
        ckpt["optimizer_states"] = []
    torch.save(ckpt, path)
    return lit


def run_config(path, *overrides):
    return compose_config([*SMALL, f"init_from={path}", *overrides])


def test_weights_load_and_scheme_options_may_change(tmp_path):
    base = save_base(tmp_path / "base.ckpt")
    cfg = run_config(tmp_path / "base.ckpt", "model.block_size=128", "pe.base=500000", "pe.scaling.kind=yarn",
                     "pe.scaling.factor=4", "optim.lr=3e-4", "model.dropout=0.1")
    checked = validate_config(cfg)
    assert cfg.pe.scaling.original_length == 32  # default: the checkpoint's block_size, recorded in the config
    assert checked.position.scheme.scaling.original_length == 32
    from pelab.checkpoint import load_init_weights
    from model.gpt import GPT
    from model.config import GPTConfig

    gpt = GPT(GPTConfig(vocab_size=64, **{**OmegaConf.to_container(cfg.model)}), checked.position.scheme)
    load_init_weights(gpt, checked.init_state, cfg.init_from)
    for key, value in base.model.state_dict().items():
        assert torch.equal(gpt.state_dict()[key], value), key


def test_another_architecture_lists_every_differing_key(tmp_path):
    save_base(tmp_path / "base.ckpt")
    cfg = run_config(tmp_path / "base.ckpt", "model.n_layer=3", "model.n_embd=64", "model.block_size=64")
    with pytest.raises(ValueError) as err:
        validate_config(cfg)
    msg = str(err.value)
    assert f"init_from={tmp_path / 'base.ckpt'} has another architecture" in msg
    assert "model.n_layer=1" in msg and "model.n_layer=3" in msg
    assert "model.n_embd=32" in msg and "model.n_embd=64" in msg
    assert "model.block_size=32" not in msg  # the length may change


def test_another_scheme_is_refused(tmp_path):
    save_base(tmp_path / "base.ckpt")
    with pytest.raises(ValueError, match=r"pe=rope .* this run has pe=alibi"):
        validate_config(run_config(tmp_path / "base.ckpt", "pe=alibi"))


@pytest.mark.parametrize("damage, message", [
    ("missing", "does not exist"),
    ("truncated", "is truncated or corrupt"),
    ("foreign", "is not a PyTorch checkpoint"),
    ("not_pelab", "not a Lightning checkpoint"),
])
def test_bad_file_is_refused_naming_init_from(tmp_path, damage, message):
    path = tmp_path / "x.ckpt"
    if damage == "truncated":
        save_base(path)
        path.write_bytes(path.read_bytes()[:2000])
    elif damage == "foreign":
        path.write_text("hello")
    elif damage == "not_pelab":
        torch.save({"weights": torch.zeros(2)}, path)
    with pytest.raises(ValueError) as err:
        validate_config(run_config(path))
    assert f"init_from={path}" in str(err.value) and message in str(err.value)


def test_learned_table_past_its_length_is_refused_without_extend(tmp_path):
    save_base(tmp_path / "base.ckpt", ["pe=learned"])
    with pytest.raises(ValueError, match="pe.extend must be 'interpolate' to start a table of 64 positions from one "
                                         "of 32"):
        validate_config(run_config(tmp_path / "base.ckpt", "pe=learned", "model.block_size=64"))


@pytest.mark.parametrize("new", [64, 45, 16])
def test_learned_table_is_linearly_interpolated(tmp_path, new):
    base = save_base(tmp_path / "base.ckpt", ["pe=learned"])
    checked = validate_config(run_config(tmp_path / "base.ckpt", "pe=learned", f"model.block_size={new}",
                                         "pe.extend=interpolate"))
    old = base.model.pe.wpe.weight.detach().double()
    got = checked.init_state["pe.wpe.weight"].double()
    assert got.shape == (new, 32)
    m = old.shape[0]
    for p in range(new):  # row p samples the old table at x = p (m - 1) / (new - 1)
        x = p * (m - 1) / (new - 1)
        lo = min(int(x), m - 2)
        w = x - lo
        torch.testing.assert_close(got[p], (1 - w) * old[lo] + w * old[lo + 1], atol=1e-6, rtol=0)
    torch.testing.assert_close(got[0], old[0], atol=0, rtol=0)
    torch.testing.assert_close(got[-1], old[-1], atol=1e-6, rtol=0)


def test_resumed_fine_tune_continues_the_fine_tune(tmp_path):
    """resume=auto (ckpt_path set to the run's own checkpoint): the fine-tune's checkpoint is
    restored by Lightning, init_from's weights are not loaded over it, and the resolved
    pe.scaling.original_length matches the fine-tune's saved one."""
    save_base(tmp_path / "base.ckpt")
    overrides = ["model.block_size=64", "pe.scaling.kind=linear", "pe.scaling.factor=2"]
    cfg = run_config(tmp_path / "base.ckpt", *overrides)
    validate_config(cfg)
    tune = LitGPT(model={**OmegaConf.to_container(cfg.model), "vocab_size": 64}, pe=OmegaConf.to_container(cfg.pe))
    torch.save({"state_dict": tune.state_dict(), "hyper_parameters": dict(tune.hparams), "optimizer_states": []},
               tmp_path / "last.ckpt")
    resumed = run_config(tmp_path / "base.ckpt", *overrides, f"ckpt_path={tmp_path / 'last.ckpt'}")
    assert validate_config(resumed).init_state is None


def test_context_extension_experiment_composes_every_method(tmp_path):
    """experiment=context_extension with each conf/extension method validates from a base of
    experiment=context_extension_base, original length 128, the method's options in place."""
    cfg = compose_config(["experiment=context_extension_base"])
    torch.manual_seed(0)
    lit = LitGPT(model={**OmegaConf.to_container(cfg.model), "vocab_size": 256}, pe=OmegaConf.to_container(cfg.pe))
    torch.save({"state_dict": lit.state_dict(), "hyper_parameters": dict(lit.hparams)}, tmp_path / "base.ckpt")
    expected = {"plain": ("none", 10000.0), "linear": ("linear", 10000.0), "ntk": ("ntk", 10000.0),
                "base_raise": ("none", 500000.0), "yarn": ("yarn", 10000.0), "llama3": ("llama3", 10000.0)}
    for method, (kind, base) in expected.items():
        run = compose_config(["experiment=context_extension", f"extension={method}", f"init_from={tmp_path / 'base.ckpt'}"])
        checked = validate_config(run)
        pe = checked.position.scheme
        assert (run.model.block_size, pe.base) == (512, base), method
        assert (pe.scaling.kind, pe.scaling.factor, pe.scaling.original_length) == \
            (kind, 4.0, 128) if kind != "none" else pe.scaling is None, method


def test_init_from_under_ddp_starts_every_rank_from_the_checkpoint(tmp_path):
    """train.py on 2 gloo processes with init_from: the run trains from step 0 (fresh
    schedule), and with a vanishing learning rate its weights are the checkpoint's (a random
    init differs by ~0.02). The checkpoint is FAST's model (vocab 256: the bytes tokenizer),
    seed 0, written through train.py's Trainer checkpoint IO in this process: a train.py run
    to make it (a 12 s subprocess) tested nothing here (tests/harness/test_train.py resumes
    train.py's own checkpoints)."""
    import lightning as L

    from pelab.checkpoint import AtomicCheckpointIO
    from tests.harness.test_train import FAST, read_metrics, run_train

    base = tmp_path / "base"
    cfg = compose_config([o for o in FAST if o.startswith("model.")])
    torch.manual_seed(0)
    module = LitGPT(model={**cfg.model, "vocab_size": 256}, pe=cfg.pe, optim=cfg.optim)
    trainer = L.Trainer(max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        plugins=[AtomicCheckpointIO()], default_root_dir=base)
    trainer.strategy.connect(module)
    trainer.save_checkpoint(base / "checkpoints" / "last.ckpt")
    tune = tmp_path / "tune"
    proc = run_train(["trainer.accelerator=cpu", "trainer.devices=2", "trainer.strategy=ddp", "logger=csv",
                      f"init_from={base / 'checkpoints' / 'last.ckpt'}", "optim.lr=1e-12", "optim.min_lr=1e-12",
                      f"hydra.run.dir={tune}", *FAST], tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "MEMBER: 2/2" in proc.stderr + proc.stdout
    assert min(read_metrics(tune / "csv" / "metrics.csv")["step"]) < 2  # trained from the start, not resumed
    before = torch.load(base / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    after = torch.load(tune / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    assert after.keys() == before.keys()
    for key, value in before.items():
        torch.testing.assert_close(after[key].float(), value.float(), atol=1e-7, rtol=0, msg=key)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_at_load(tmp_path, bad):
    """Before: loaded silently, and the run died at step 0 advising a lower learning rate."""
    path = tmp_path / "base.ckpt"
    save_base(path)
    ckpt = torch.load(path, weights_only=True)
    ckpt["state_dict"]["model.blocks.0.attn.c_attn.weight"][1, 2] = bad
    torch.save(ckpt, path)
    floats = sum(v.is_floating_point() for v in ckpt["state_dict"].values())
    with pytest.raises(ValueError, match=rf"init_from={path} holds non-finite weights \(NaN/inf\) in 1 of {floats} "
                                         r"tensors, first 'model.blocks.0.attn.c_attn.weight': a run cannot start"):
        validate_config(run_config(path))
