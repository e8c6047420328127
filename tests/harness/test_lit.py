import math

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from pelab.lit import LitGPT
from pelab.optim import OptimConfig
from model.pe import SCHEMES

TINY = dict(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32)
PE_TARGETS = {name: f"{cls.__module__}.{cls.__name__}" for name, cls in SCHEMES.items()}


def test_schedule_matches_hand_values():
    o = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=9)
    assert o.lr_at(0, 109) == pytest.approx(0.1)  # (0 + 1) / (9 + 1)
    assert o.lr_at(8, 109) == pytest.approx(0.9)
    assert o.lr_at(9, 109) == pytest.approx(1.0)  # cosine starts at lr
    assert o.lr_at(59, 109) == pytest.approx(0.1 + 0.5 * 0.9)  # half way: cos(pi/2) = 0
    assert o.lr_at(109, 109) == pytest.approx(0.1)
    assert o.lr_at(500, 109) == pytest.approx(0.1)
    values = [o.lr_at(s, 109) for s in range(9, 110)]
    assert all(a >= b for a, b in zip(values, values[1:]))  # monotone decay


@pytest.mark.parametrize("bad,message", [
    (dict(lr=1e-3, min_lr=1e-2), "optim.min_lr must be in (0, optim.lr=0.001], got 0.01"),
    (dict(min_lr=0.0), "optim.min_lr must be in (0, optim.lr=0.001], got 0.0"),
    (dict(warmup_steps=-1), "optim.warmup_steps must be an integer >= 0, got -1"),
    (dict(lr="1e-3"), "optim.lr must be a number, got '1e-3'"),  # a string is not a number
    (dict(warmup_steps=True), "optim.warmup_steps must be an integer, got True"),  # nor a bool an int
    (dict(warmup_steps=1.5), "optim.warmup_steps must be an integer, got 1.5"),
    (dict(betas=[0.9]), "optim.betas must be [a number, a number], got [0.9]"),
    (dict(betas=[0.9, 1.0]), "optim.betas must be two numbers in [0, 1), got [0.9, 1.0]"),
    (dict(eps=0.0), "optim.eps must be > 0, got 0.0"),
    (dict(decay_steps=0), "optim.decay_steps must be null (= trainer.max_steps) or an integer >= 1, got 0"),
])
def test_optim_config_rejects_bad_values(bad, message):
    with pytest.raises(ValueError) as err:
        OptimConfig(**bad)
    assert str(err.value) == message


def test_optim_config_accepts_ints_for_floats():
    assert OptimConfig(lr=1, min_lr=1, weight_decay=0).lr == 1  # Hydra reads "optim.lr=1" as an int


def test_weight_decay_groups():
    module = LitGPT(model=TINY, pe={"_target_": PE_TARGETS["learned"]}, optim={"weight_decay": 0.1})
    module.trainer = type("T", (), {"max_steps": 10})()  # only max_steps is read
    opt = module.configure_optimizers()["optimizer"]
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    ids = lambda group: {id(p) for p in group["params"]}  # noqa: E731
    gpt = module.model
    assert id(gpt.pe.wpe.weight) in ids(no_decay)  # position table: no decay
    assert id(gpt.blocks[0].ln_1.weight) in ids(no_decay)
    assert id(gpt.blocks[0].attn.c_attn.weight) in ids(decay)
    assert id(gpt.lm_head.weight) in ids(decay)
    total = sum(p.numel() for g in opt.param_groups for p in g["params"])
    assert total == sum(p.numel() for p in gpt.parameters())  # every parameter exactly once


@pytest.mark.parametrize("precision,fused", [("bf16-mixed", True), ("32-true", True), ("16-mixed", False)])
def test_adamw_is_fused_except_under_the_grad_scaler(precision, fused):
    """The fused AdamW kernel on CPU too, except under 16-mixed, whose GradScaler makes
    Lightning refuse gradient clipping with a fused step."""
    from types import SimpleNamespace

    from lightning.pytorch.plugins.precision import MixedPrecision, Precision

    module = LitGPT(model=TINY, pe={"_target_": PE_TARGETS["learned"]})
    plugin = Precision() if precision == "32-true" else MixedPrecision(precision, "cpu")  # 16-mixed: a GradScaler
    module.trainer = SimpleNamespace(max_steps=10, precision=precision, precision_plugin=plugin)
    assert module.configure_optimizers()["optimizer"].defaults["fused"] is fused


class GradientProbe(L.Callback):
    """Gradient norms and largest elements before clipping (on_before_optimizer_step) and
    after it (on_before_zero_grad, which runs at the start of the next step's closure, so
    the previous step's clipped gradients are still there)."""

    def __init__(self) -> None:
        self.before, self.after = [], []

    @staticmethod
    def _norms(module):
        grads = [p.grad.double() for p in module.parameters() if p.grad is not None]
        return math.sqrt(sum(float(g.square().sum()) for g in grads)), max(float(g.abs().max()) for g in grads)

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.before.append(self._norms(module))

    def on_before_zero_grad(self, trainer, module, optimizer):
        if any(p.grad is not None for p in module.parameters()):  # not before the first step
            self.after.append(self._norms(module))


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_gradient_clipping_with_the_fused_adamw(precision, algorithm):
    """trainer.gradient_clip_val clips with the fused AdamW, where Lightning's own
    mixed-precision clipping refuses fused optimizers. Limits far below the raw gradients,
    so clipping always acts."""
    torch.manual_seed(0)
    x = torch.randint(0, 64, (4, 33))
    loader = DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=4)
    module = LitGPT(model=TINY, pe={"_target_": PE_TARGETS["rope"]}, optim={"warmup_steps": 0})
    probe, limit = GradientProbe(), 1e-3 if algorithm == "norm" else 1e-5
    trainer = L.Trainer(max_steps=4, accelerator="cpu", precision=precision, logger=False, callbacks=[probe],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        gradient_clip_val=limit, gradient_clip_algorithm=algorithm)
    trainer.fit(module, loader)
    assert trainer.optimizers[0].defaults["fused"] is True
    assert len(probe.after) == 3  # steps 1-3, seen at the start of steps 2-4
    for (norm_before, max_before), (norm_after, max_after) in zip(probe.before, probe.after):
        if algorithm == "norm":
            assert norm_before > 10 * limit and norm_after == pytest.approx(limit, rel=1e-3)
        else:
            assert max_before > 10 * limit and max_after == pytest.approx(limit, rel=1e-6)


def test_gradient_clipping_under_the_grad_scaler_is_lightnings(monkeypatch):
    """16-mixed (CUDA; Lightning turns it into bf16 on CPU): GradScaler, an AdamW that is not
    fused, and Lightning's clipping, which unscales first."""
    from types import SimpleNamespace

    from lightning.pytorch.plugins.precision import MixedPrecision

    module = LitGPT(model=TINY, pe={"_target_": PE_TARGETS["learned"]})
    plugin = MixedPrecision("16-mixed", "cpu")
    assert plugin.scaler is not None
    module.trainer = SimpleNamespace(precision_plugin=plugin, precision="16-mixed", max_steps=10)
    optimizer = module.configure_optimizers()["optimizer"]
    assert optimizer.defaults["fused"] is False
    calls = []
    monkeypatch.setattr(module, "clip_gradients", lambda *args: calls.append(args))
    module.configure_gradient_clipping(optimizer, 0.5, "norm")
    assert calls == [(optimizer, 0.5, "norm")]


def test_gradient_clipping_under_fsdp_uses_the_sharded_norm():
    """Under FSDP the norm must span every shard: the root module's own clip_grad_norm_ (a
    stand-in here: Lightning refuses FSDP without a GPU)."""
    from types import SimpleNamespace

    from lightning.pytorch.plugins.precision import FSDPPrecision
    from lightning.pytorch.strategies import FSDPStrategy

    calls = []
    strategy = FSDPStrategy()
    strategy._lightning_module = None
    module = LitGPT(model=TINY, pe={"_target_": PE_TARGETS["learned"]})
    root = SimpleNamespace(clip_grad_norm_=lambda value: calls.append(value))
    module.trainer = SimpleNamespace(precision_plugin=FSDPPrecision("bf16-mixed"), strategy=strategy)
    strategy.model = root
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    optimizer = torch.optim.AdamW(module.parameters())
    module.configure_gradient_clipping(optimizer, 0.5, "norm")
    assert calls == [0.5]
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in module.parameters())  # nothing else clipped


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_loss_decreases_on_a_repeated_batch(scheme):
    torch.manual_seed(0)
    x = torch.randint(0, 64, (4, 33))
    loader = DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=4)
    module = LitGPT(model=TINY, pe={"_target_": PE_TARGETS[scheme]},
                    optim={"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2, "weight_decay": 0.0})
    module.eval()
    with torch.no_grad():
        before = module(*next(iter(loader)))[1].item()
    module.train()
    trainer = L.Trainer(max_steps=60, accelerator="cpu", precision="bf16-mixed", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        gradient_clip_val=1.0, limit_val_batches=0)
    trainer.fit(module, train_dataloaders=loader)
    module.eval()
    with torch.no_grad():
        after = module(*next(iter(loader)))[1].item()
    assert before == pytest.approx(math.log(64), abs=0.3)
    assert after < 0.75 * before, (scheme, before, after)


def test_checkpoint_rebuilds_the_model(tmp_path):
    module = LitGPT(model=TINY, pe={"_target_": PE_TARGETS["rope_alibi"], "bias_heads": 2}, optim={})
    trainer = L.Trainer(max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path)
    trainer.strategy.connect(module)
    path = tmp_path / "m.ckpt"
    trainer.save_checkpoint(path)
    loaded = LitGPT.load_from_checkpoint(path)
    assert loaded.model.pe.bias_heads == 2
    x = torch.randint(0, 64, (2, 16))
    module.eval(), loaded.eval()
    torch.testing.assert_close(module(x)[0], loaded(x)[0])


def test_tokens_per_sec_counts_every_micro_batch_and_logs_once_per_log_step(monkeypatch):
    """With gradient accumulation the callback logs at optimizer steps only (public API: a change of
    trainer.global_step), over the tokens of every micro-batch since the previous log."""
    import types

    import pelab.callbacks as callbacks

    clock = iter(range(1000))  # perf_counter advances by 1 s per call: tokens/s = tokens since the last log
    monkeypatch.setattr(callbacks, "time", types.SimpleNamespace(perf_counter=lambda: float(next(clock))))

    class Recording(LitGPT):
        logged: list = []

        def log(self, name, value, *args, **kwargs):
            if name == "train/tokens_per_sec":
                self.logged.append((self.trainer.global_step, float(value)))
            super().log(name, value, *args, **kwargs)

    x = torch.randint(0, 64, (32, 17))
    loader = DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=4)  # 64 tokens per micro-batch
    module = Recording(model=TINY, pe={"_target_": PE_TARGETS["rope"]}, optim={"warmup_steps": 1})
    trainer = L.Trainer(max_steps=4, accumulate_grad_batches=2, log_every_n_steps=2, accelerator="cpu",
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[callbacks.TokensPerSecond()])
    trainer.fit(module, train_dataloaders=loader)
    assert module.logged == [(2, 2 * 2 * 64.0), (4, 2 * 2 * 64.0)]  # 2 steps x 2 micro-batches x 64 tokens


def test_a_scheme_decides_which_of_its_parameters_are_decayed():
    from torch import nn

    from model.pe.base import PositionEncoding

    class DecaysItsMatrix(PositionEncoding):  # unregistered: test-only
        def __init__(self, config):
            super().__init__(config)
            self.matrix = nn.Parameter(torch.zeros(3, 3))
            self.table = nn.Parameter(torch.zeros(5, 3))

        def decayed_parameters(self):
            return [self.matrix]

    module = LitGPT(model=TINY, pe={"_target_": PE_TARGETS["rope"]}, optim={"weight_decay": 0.1})
    module.model.pe = DecaysItsMatrix(module.config)
    module.trainer = type("T", (), {"max_steps": 10})()  # only max_steps is read
    decay, no_decay = module.configure_optimizers()["optimizer"].param_groups
    ids = lambda group: {id(p) for p in group["params"]}  # noqa: E731
    assert id(module.model.pe.matrix) in ids(decay)
    assert id(module.model.pe.table) in ids(no_decay)  # 2-D, but the scheme did not ask for decay


def test_validation_loss_is_weighted_by_scored_targets():
    """Batches with different numbers of scored targets (answers only, the rest -1): val/loss
    is the summed NLL over all scored targets divided by their count, not a mean of batch means."""
    torch.manual_seed(0)
    module = LitGPT(model=TINY, pe={"_target_": PE_TARGETS["rope"]}).eval()
    x = torch.randint(0, 64, (2, 8))
    y1, y2 = x.clone(), x.clone()
    y1[:, :7] = -1  # 2 scored targets
    y2[:, :1] = -1  # 14 scored targets
    logged = {}
    module.log = lambda name, value, **kw: logged.__setitem__(name, float(value))
    with torch.no_grad():
        for y in (y1, y2):
            module.validation_step((x, y), 0)
        module.on_validation_epoch_end()
        logits = module.model(x)[0].double()
    nll = sum(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-1, reduction="sum")
              for y in (y1, y2))
    assert logged["val/loss"] == pytest.approx((nll / 16).item(), rel=1e-4)


def test_constrained_scheme_parameters_are_projected_after_every_optimizer_step(monkeypatch):
    """KERPLE's forward reads its parameters clamped without writing them (FSDP's flat views
    forbid writes in forward); the module projects them after every optimizer step. A huge
    learning rate drives some below the bound; after each step they are back in range."""
    torch.manual_seed(0)
    x = torch.randint(0, 64, (4, 33))
    loader = DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=2)
    module = LitGPT(model=TINY, pe={"_target_": "model.pe.kerple.KerpleLog"},
                    optim={"warmup_steps": 0, "lr": 10.0, "min_lr": 10.0, "weight_decay": 0.0})
    pe, seen = module.model.pe, []
    project = pe.project
    monkeypatch.setattr(pe, "project", lambda: seen.append(min(pe.r1.min().item(), pe.r2.min().item())) or project())
    trainer = L.Trainer(max_steps=3, accelerator="cpu", precision="32-true", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, loader)
    assert len(seen) == 3  # once per optimizer step
    assert min(seen) < pe.eps  # an unprojected step did leave the range
    assert pe.r1.min() >= pe.eps and pe.r2.min() >= pe.eps


@pytest.mark.parametrize("bar", ["default", "tqdm"])
def test_the_progress_bar_shows_the_loss_read_at_logging_steps_only(bar):
    """Lightning's default bar (Rich where rich is installed, else tqdm) becomes its logging-step
    version: the loss it shows is the one logged at the last logging step (the loss is logged
    without prog_bar, which Lightning reads every batch)."""
    from pelab.callbacks import LOGGED_STEP_BARS, LoggedStepMetrics

    class Shown(L.Callback):
        """What the bar shows once a step's hooks have all run, by the global_step after it."""

        def __init__(self) -> None:
            self.shown, self.loss = {}, {}

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            self.loss[trainer.global_step] = float(outputs["loss"])

        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            self.shown[trainer.global_step] = dict(trainer.progress_bar_callback._shown or {})

        def on_train_end(self, trainer, module) -> None:
            self.on_train_batch_start(trainer, module, None, 0)

    torch.manual_seed(0)
    x = torch.randint(0, 64, (32, 33))
    loader = DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=4)
    module = LitGPT(model=TINY, pe={"_target_": PE_TARGETS["rope"]}, optim={"warmup_steps": 0})
    shown = Shown()
    from lightning.pytorch.callbacks import TQDMProgressBar

    bars = [TQDMProgressBar()] if bar == "tqdm" else []
    trainer = L.Trainer(max_steps=6, accelerator="cpu", precision="32-true", logger=False, callbacks=[shown, *bars],
                        enable_checkpointing=False, enable_model_summary=False, log_every_n_steps=3)
    trainer.fit(module, loader)
    assert isinstance(trainer.progress_bar_callback, LoggedStepMetrics)
    assert type(trainer.progress_bar_callback) in LOGGED_STEP_BARS.values()
    assert all("train/loss" not in shown.shown[step] for step in (1, 2))  # nothing logged yet
    for step in (3, 4, 5):  # the loss of the step that logged (ending at global_step 3) until the next one
        assert shown.shown[step]["train/loss"] == pytest.approx(shown.loss[3])
    assert shown.shown[6]["train/loss"] == pytest.approx(shown.loss[6])
