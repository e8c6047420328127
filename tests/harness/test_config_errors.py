"""Bad configurations fail before any data is read or compute spent, with a message naming the
key, the bad value and what is allowed, and leave nothing behind.

In-process: Hydra's compose API, then train.train() (its validation runs first; data
preparation and fitting are booby-trapped). A few real `python train.py` runs prove the CLI.
"""

import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException

from tests.cli import run_python

ROOT = Path(__file__).resolve().parents[2]

# (overrides, text the message must contain: key, bad value, what is allowed)
CASES = [
    # wrong types
    ("model.n_layer=two", ["model.n_layer must be an integer, got 'two'"]),
    ("model.n_layer=true", ["model.n_layer must be an integer, got True"]),
    ("model.bias=yes", ["model.bias must be true or false, got 'yes'"]),
    ("trainer.max_steps=1.5", ["trainer.max_steps must be an integer, got 1.5"]),
    ("optim.lr=fast", ["optim.lr must be a number, got 'fast'"]),
    ("optim.betas=[0.9]", ["optim.betas must be [a number, a number], got [0.9]"]),
    ("pe.base=abc", ["pe.base must be a number, got 'abc'"]),
    ("seed=abc", ["seed must be an integer, got 'abc'"]),
    ("eval.extrapolation.enabled=maybe", ["eval.extrapolation.enabled must be true or false, got 'maybe'"]),
    # ranges
    ("model.dropout=1.5", ["model.dropout must be in [0, 1), got 1.5"]),
    ("model.block_size=0", ["model.block_size must be a positive integer, got 0"]),
    ("optim.lr=-1", ["optim.lr must be > 0, got -1"]),
    ("optim.min_lr=1.0", ["optim.min_lr must be in (0, optim.lr=0.001], got 1.0"]),
    ("optim.warmup_steps=-5", ["optim.warmup_steps must be an integer >= 0, got -5"]),
    ("pe.base=1", ["pe.base must be > 1, got 1"]),
    ("pe.rotary_fraction=0", ["pe.rotary_fraction must be in (0, 1], got 0"]),
    ("data.batch_size=0", ["data.batch_size must be >= 1, got 0"]),
    ("data.val_batch_size=0", ["data.val_batch_size must be >= 1, got 0"]),  # not silently batch_size
    ("data.corpus.val_fraction=0.7", ["data.corpus.val_fraction must be in (0, 0.5), got 0.7"]),
    ("data.tokenizer=words", ["data.tokenizer must be one of", "bytes", "gpt2", "got 'words'"]),
    ("eval.extrapolation.stride=0", ["eval.extrapolation.stride must be >= 1, got 0"]),
    ("eval.extrapolation.modes=[slide]", ["eval.extrapolation", "['slide']", "nonoverlapping, sliding"]),
    ("trainer.max_steps=0", ["trainer.max_steps must be > 0", "got 0"]),
    ("trainer.precision=17", ["trainer.precision must be one of", "'bf16-mixed'", "got 17"]),
    ("trainer.devices=0", ["trainer.devices must be an integer >= 1", "'auto'", "got 0"]),
    ("trainer.accumulate_grad_batches=0", ["trainer.accumulate_grad_batches must be >= 1, got 0"]),
    # unknown keys (with "+": Hydra's struct mode lets them through to us)
    ("+model.n_layers=4", ["model.n_layers=4 is not an option of model", "n_layer, n_head"]),
    ("+pe.foo=1", ["pe.foo=1 is not an option of pe (RoPE); valid options: base, rotary_fraction"]),
    ("pe=alibi +pe.base=5", ["pe.base=5 is not an option of pe (ALiBi); valid options: (none)"]),
    ("+optim.momentum=0.9", ["optim.momentum=0.9 is not an option of optim", "betas"]),
    ("+data.corpus.foo=1", ["data.corpus.foo=1 is not an option of data.corpus", "val_fraction"]),
    ("+trainer.max_step=5", ["trainer.max_step=5 is not an option of trainer", "max_steps"]),
    # impossible combinations
    ("pe=learned +pe.nope_every=2", ["pe.nope_every=2 needs a scheme that acts inside attention",
                                     "pe=learned only adds to the embeddings"]),
    ("pe=fox +pe.nope_every=2", ["pe.nope_every=2 needs a scheme that acts inside attention through positions",
                                 "pe=fox gates every layer's attention from its input"]),
    ("pe=rope +pe.rotate_v=true", ["pe.rotate_v=True is not an option of pe (RoPE); valid options: base"]),
    ("pe=rope_dd pe.rotate_v=maybe", ["pe.rotate_v must be true or false, got 'maybe'"]),
    ("pe=rope_dd pe.step=relu", ["pe.step must be one of softplus, linear", "got 'relu'"]),
    ("pe=rope_dd +pe.nope_every=2", ["pe.nope_every=2 needs a scheme that acts inside attention through positions",
                                     "pe=rope_dd turns every layer's q and k by angles of its input"]),
    ("pe.nope_every=0", ["pe.nope_every must be null or an integer >= 1", "got 0"]),
    ("pe=t5 pe.nope_every=1", ["pe.nope_every=1 makes all 4 layers NoPE layers, so pe=t5's parameters would never "
                               "be used"]),
    ("data=synthetic eval.tasks.enabled=maybe", ["eval.tasks.enabled must be auto (on for data=synthetic), true or "
                                                 "false, got 'maybe'"]),
    ("eval.positions=randomized", ["eval.positions=randomized evaluates a model trained with pe.randomize_to=N",
                                   "pe.randomize_to is null"]),
    ("eval.probe.rows=0", ["eval.probe.rows must be an integer >= 1, got 0"]),
    ("data=synthetic data.curriculum_batches=10 data.curriculum_start=4",
     ["data.curriculum_start must be null or an integer in [11, data.block_size=256], got 4"]),
    ("data.tokens_per_step=1000", ["data.tokens_per_step=1000 is not a whole number of micro-batches",
                                   "= 4096 tokens; allowed: a multiple of 4096, e.g. 4096"]),
    ("data.tokens_per_step=8192 trainer.accumulate_grad_batches=2",
     ["data.tokens_per_step=8192 and trainer.accumulate_grad_batches=2 both given"]),
    ("resume=yes", ["resume must be null or auto, got 'yes'"]),
    # data=text forwards its data-module options to TextDataModule: still checked by name and type
    ("data=text data.paths=[a.txt] +data.batch_sise=4", ["data.batch_sise=4 is not an option of data",
                                                        "text_field", "batch_size", "val_windows"]),
    ("data=text data.paths=[a.txt] data.batch_size=two", ["data.batch_size must be an integer, got 'two'"]),
    ("eval.tasks.enabled=true", ["eval.tasks.enabled=true needs a synthetic task: data=synthetic"]),
    ("experiment=task_ablation eval.tasks.samples=0", ["eval.tasks.samples must be an integer >= 1, got 0"]),
    ("pe.randomize_to=100", ["pe.randomize_to must be null or an integer >= model.block_size=256", "got 100"]),
    ("pe=learned +pe.randomize_to=512", ["pe.randomize_to=512 exceeds the 256 positions of the scheme"]),
    ("model.n_head=5", ["model.n_embd must be divisible by model.n_head=5, got 128"]),
    ("model.n_embd=12 model.n_head=4", ["model.n_embd / model.n_head must be even, got 3"]),
    ("pe=learned pe.max_positions=16", ["model.block_size=256 exceeds the 16 positions of pe=learned",
                                        "raise pe.max_positions or lower model.block_size"]),
    ("pe=rope_alibi pe.bias_heads=9", ["pe.bias_heads must be in [1, n_head=4] or null, got 9"]),
    ("data.block_size=512", ["data.block_size must be model.block_size=256", "got 512"]),
    ("trainer.max_steps=-1", ["trainer.max_steps must be > 0", "-1 only with optim.decay_steps", "got -1"]),
    ("trainer.devices=abc", ["trainer.devices must be an integer >= 1, -1 (all), 'auto', or device ids as a list "
                             "or '0,1', got 'abc'"]),
    # eval.* runs after the training, and is checked before it
    ("eval.extrapolation.rope_scaling=[bogus]", ["eval.extrapolation.rope_scaling must be a list of null, linear, "
                                                 "ntk, dynamic_ntk, yarn, llama3, got ['bogus']"]),
    ("eval.extrapolation.rope_scaling_factor=0.5", ["eval.extrapolation.rope_scaling_factor must be null",
                                                    "a finite number >= 1, got 0.5"]),
    ("eval.extrapolation.q_chunk=0", ["eval.extrapolation.q_chunk must be >= 1, got 0"]),
    # positions scaled in training (pe.scaling) and init_from (context extension)
    ("pe=alibi pe.scaling.kind=yarn", ["pe.scaling.kind must be one of none, linear for pe=alibi, got 'yarn'"]),
    ("pe=t5 pe.scaling.kind=linear", ["pe.scaling.kind must be none: pe=t5 has no positions to scale, got 'linear'"]),
    ("pe.scaling.kind=linear pe.scaling.factor=0.5", ["pe.scaling.factor must be a finite number >= 1", "got 0.5"]),
    ("pe.scaling.kind=ntk pe.scaling.factor=-2", ["pe.scaling.factor must be a finite number >= 1", "got -2"]),
    ("pe.scaling.kind=yarn pe.scaling.original_length=512", ["pe.scaling.original_length must be null or an integer "
                                                             "in [1, model.block_size=256]", "got 512"]),
    ("pe.scaling.kind=longrope pe.scaling.factor=2 pe.scaling.short_factor=[1,1] pe.scaling.long_factor=[1,1]",
     ["pe.scaling.short_factor and long_factor must be lists of 16 factors", "got 2 and 2"]),
    ("pe.scaling.kind=linear pe.scaling.beta_fast=8", ["pe.scaling.beta_fast must be 32.0: pe.scaling.kind=linear "
                                                       "reads factor, original_length, got 8"]),
    ("pe.scaling.kind=yarn pe.scaling.factor=4 eval.extrapolation.rope_scaling=[null,ntk]",
     ["eval.extrapolation.rope_scaling must be [null]", "pe.scaling.kind=yarn", "got [None, 'ntk']"]),
    ("data=synthetic eval.tasks.rope_scaling=[bogus]", ["eval.tasks.rope_scaling must be a list of null, linear, "
                                                        "ntk, dynamic_ntk, yarn, llama3, got ['bogus']"]),
    ("data=synthetic pe.scaling.kind=linear pe.scaling.factor=2 eval.tasks.rope_scaling=[null,ntk]",
     ["eval.tasks.rope_scaling must be [null]", "pe.scaling.kind=linear", "got [None, 'ntk']"]),
    ("init_from=/nonexistent/base.ckpt", ["init_from=/nonexistent/base.ckpt does not exist"]),
    ("ckpt_path=/nonexistent/last.ckpt", ["ckpt_path=/nonexistent/last.ckpt does not exist"]),
    ("model.attn_temperature=llama4", ["model.attn_temperature must be none, log_length, logn or ssmax for pe=rope with no "
                                       "NoPE layer", "got 'llama4'"]),
    ("model.attn_temperature=cosine", ["model.attn_temperature must be one of 'none', 'log_length', 'logn', 'llama4', "
                                       "'ssmax', got 'cosine'"]),
    ("eval.extrapolation.max_tokens=0", ["eval.extrapolation.max_tokens must be >= 1, got 0"]),
    # block options (model/config.py)
    ("model.norm=bogus", ["model.norm must be one of 'layernorm', 'rmsnorm', got 'bogus'"]),
    ("model.mlp=relu", ["model.mlp must be one of 'gelu', 'swiglu', got 'relu'"]),
    ("model.n_kv_head=3", ["model.n_kv_head must be null or a divisor of model.n_head=4, got 3"]),
    ("model.qk_norm=maybe", ["model.qk_norm must be true or false, got 'maybe'"]),
    ("+model.qknorm=true", ["model.qknorm=True is not an option of model", "qk_norm, n_kv_head"]),
    # callbacks are built before any data is read, by their own constructors
    ("callbacks.host_memory_reuse.mmap_threshold_mb=64", ["callbacks.host_memory_reuse.mmap_threshold_mb must be "
                                                          "an integer in [0, 32]", "got 64"]),
    ("callbacks.attention_maps.every_n_validations=0", ["callbacks.attention_maps", "every_n_validations must be "
                                                        ">= 1, got 0"]),
    ("+callbacks.nonfinite_guard.max_skiped_steps=1", ["callbacks.nonfinite_guard.max_skiped_steps=1 is not an "
                                                       "option of callbacks.nonfinite_guard", "max_skipped_steps"]),
    ("+callbacks.extra._target_=pelab.callbacks.NoSuchCallback", ["callbacks.extra._target_=",
                                                                  "is not an importable class"]),
    # issue 32 (third list): a string for the scaling block, the probe's lengths, a stride past every length
    ("pe.scaling=yarn", ["pe.scaling must be a mapping of kind, factor, original_length", "got 'yarn'"]),
    ("eval.probe.lengths=[0]", ["eval.probe.lengths must be positive integers, got [0]"]),
    ("eval.probe.multipliers=abc", ["eval.probe.multipliers must be a list of numbers, got 'abc'"]),
    ("eval.probe.multipliers=[0.5,-1]", ["eval.probe.multipliers must be positive numbers, got [0.5, -1]"]),
    ("eval.extrapolation.modes=[sliding] eval.extrapolation.stride=100000",
     ["eval.extrapolation.stride must be null (half the eval length) or at most the longest eval length, 4096",
      "got 100000"]),
    # issue 51 (fourth list): refusals that came after the compute (tests/harness/test_refusals_before_compute.py)
    ("pe=cope model.attention=flex", ["model.attention=flex cannot add pe=cope's terms of the attention scores"]),
    ("model.attention=flex trainer.accelerator=cpu", ["model.attention=flex has no backward on cpu"]),
    ("eval.streaming.enabled=true eval.streaming.sinks=256", ["eval.streaming.sinks must be less than the training "
                                                              "length 256", "got 256"]),
]

# Refused by Hydra while composing (struct mode, unknown group option): its own messages.
COMPOSE_CASES = [
    ("model.n_layers=4", ConfigCompositionException, ["model.n_layers", "+model.n_layers=4"]),
    ("pe=rotary", MissingConfigException, ["pe/rotary", "alibi", "learned", "rope", "rope_alibi", "xpos"]),
    ("model=huge", MissingConfigException, ["model/huge", "tiny", "small", "gpt2"]),
]


def compose_config(overrides, output_dir):
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[*overrides, f"paths.output_dir={output_dir}"])


def listing(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else []


@pytest.fixture
def no_work(monkeypatch, cache_root):
    """Any data preparation or fitting fails the test; the token cache must stay as it was."""
    import lightning as L

    import pelab.datamodule

    def forbidden(*args, **kwargs):
        pytest.fail("data was read or compute spent for a bad config")

    monkeypatch.setattr(pelab.datamodule, "prepare_token_files", forbidden)
    monkeypatch.setattr(L.Trainer, "fit", forbidden)
    before = listing(cache_root)
    yield
    assert listing(cache_root) == before


def test_there_are_at_least_25_bad_configs():
    assert len(CASES) + len(COMPOSE_CASES) >= 25


@pytest.mark.parametrize("overrides,expected", CASES, ids=[c[0] for c in CASES])
def test_bad_config_is_refused_before_any_work(overrides, expected, tmp_path, no_work):
    from pelab.config import ConfigError
    from train import train

    out = tmp_path / "out"
    cfg = compose_config(overrides.split() + ["logger=csv"], out)
    with pytest.raises(ConfigError) as err:
        train(cfg)
    message = str(err.value)
    for text in expected:
        assert text in message, message
    assert not out.exists()  # no checkpoints dir, no config.yaml, no logs


@pytest.mark.parametrize("overrides,error,expected", COMPOSE_CASES, ids=[c[0] for c in COMPOSE_CASES])
def test_bad_config_is_refused_while_composing(overrides, error, expected, tmp_path):
    with pytest.raises(error) as err:
        compose_config(overrides.split(), tmp_path / "out")
    for text in expected:
        assert text in str(err.value), str(err.value)


# one error of each route through the real command line (a 12 s process each): pelab's validation
# and Hydra's composition; every message itself is checked in-process above (CASES, COMPOSE_CASES)
@pytest.mark.parametrize("overrides,expected", [
    ("model.dropout=1.5", "model.dropout must be in [0, 1), got 1.5"),
    ("pe=rotary", "Could not find 'pe/rotary'"),
])
def test_cli_reports_bad_config_in_one_message(overrides, expected, tmp_path):
    """The real command line: non-zero exit, the message on stderr, no traceback, nothing written."""
    run, cache = tmp_path / "run", tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    proc = run_python(["train.py", *overrides.split(), f"hydra.run.dir={run}"], cwd=ROOT,
                      env={**env, "PELAB_CACHE": str(cache)}, timeout=300)
    assert proc.returncode != 0
    assert expected in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (run / "checkpoints").exists() and not any(run.glob("wandb")) and not cache.exists()


@pytest.mark.parametrize("overrides", [
    [],
    ["data=wikitext103", "model=gpt2"],  # a hub corpus must not inherit the embedded corpus's options
    ["data=gutenberg_gpt2"],
    ["experiment=pe_ablation"],
    ["experiment=task_ablation"],
    ["experiment=rnope_swa"],
    ["experiment=gemma3_like"],
    ["experiment=gptoss_like"],
    ["experiment=pope_indirect_indexing", "pe=pope"],
    ["experiment=cope_counting", "pe=cope"],
    ["experiment=copy_ordering", "pe=learned", "pe.max_positions=512"],
    ["experiment=task_ablation", "+hybrid=rnope_swa"],  # a hybrid layout on a task
    *[["experiment=task_ablation2", f"data.task={task}"]  # every task of its documented sweep trains at 128
      for task in ("state_tracking", "graphwalks", "babilong", "multi_query")],
    ["experiment=task_ablation", "eval.tasks.rope_scaling=[null,linear,ntk,yarn]"],  # a task under PI, NTK, YaRN
    ["experiment=fox_loss_by_position", "pe=fox"],
    ["experiment=stick_breaking"],
    ["experiment=swan_like"],
    ["experiment=gemma4_like"],
    ["experiment=olmo3_like"],
    ["experiment=sink_gate_xsa", "output_variant=gate_elementwise", "hybrid=rnope_swa"],
    ["eval.streaming.enabled=true", "eval.streaming.cache_positions=[reindexed,absolute]"],
    ["data=synthetic", "data.task=flipflop", "eval.extrapolation.enabled=false"],
    ["trainer.devices=auto"],
    ["trainer.devices='0,1'"],  # a string: Lightning's device-id list form
    ["trainer.devices=[0,1]"],
    ["eval.extrapolation.rope_scaling=[null,linear,ntk,dynamic_ntk,yarn]", "eval.extrapolation.rope_scaling_factor=2"],
    ["eval.extrapolation.modes=[sliding]", "eval.extrapolation.stride=4096"],  # the longest length: one window
    ["eval.extrapolation.modes=[nonoverlapping]", "eval.extrapolation.stride=100000"],  # no sliding: unused
    *[[f"pe={path.stem}"] for path in sorted((ROOT / "conf" / "pe").glob("*.yaml"))],  # every shipped scheme
    ["data._target_=data.datamodule.TextDataModule"],  # a user's data yaml written before the module moved
])
def test_shipped_configs_pass_validation(overrides, tmp_path):
    from pelab.validate import validate_config

    validate_config(compose_config(overrides, tmp_path / "out"))


@pytest.mark.parametrize("overrides,raise_in,message", [
    ("model.n_head=5", "model", "model.n_embd must be divisible by model.n_head=5, got 128"),
    ("pe.base=1", "pe", "pe.base must be > 1, got 1"),
    ("pe.base=1", "pe-type", "pe: base must be a float"),
])
def test_plain_errors_of_model_constructors_become_one_line_config_errors(overrides, raise_in, message, tmp_path,
                                                                          monkeypatch, no_work):
    """model/ raises plain ValueError/TypeError (no harness import there): the harness shows them
    as the ConfigError users see, message unchanged (a TypeError that names no key gets its section)."""
    import functools

    import model.config
    import model.pe.rope
    from pelab.config import ConfigError
    from train import train

    if raise_in == "model":
        real = model.config.GPTConfig.__post_init__

        def post_init(self, *init_vars):  # GPTConfig's InitVars (model.sinks, the old spelling)
            if self.n_head == 5:
                raise ValueError(message)
            real(self, *init_vars)

        monkeypatch.setattr(model.config.GPTConfig, "__post_init__", post_init)
    else:
        error = ValueError(message) if raise_in == "pe" else TypeError("base must be a float")

        @functools.wraps(model.pe.rope.RoPE.__init__)  # keeps the signature the option check reads
        def init(self, *args, **kwargs):
            raise error

        monkeypatch.setattr(model.pe.rope.RoPE, "__init__", init)
    with pytest.raises(ConfigError) as err:
        train(compose_config(overrides.split() + ["logger=csv"], tmp_path / "out"))
    assert str(err.value) == message and type(err.value) is ConfigError
    assert not (tmp_path / "out").exists()


def refused(overrides, tmp_path) -> str | None:
    """validate_config's one-line ConfigError for ``overrides``, or None when the run passes."""
    from pelab.config import ConfigError
    from pelab.validate import validate_config

    try:
        validate_config(compose_config(overrides, tmp_path / "out"))
    except ConfigError as err:
        return str(err)
    return None
