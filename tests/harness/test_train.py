"""End-to-end: train.py through Hydra, as a user runs it (subprocess) and via the compose API."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import MissingConfigException

from tests.cli import run_python

ROOT = Path(__file__).resolve().parents[2]
# the sweep's schemes: learned (its table stops at L: "n/a" past it), rope (the scaling sweep) and
# alibi (the torchrun evaluation); every scheme trains in tests/harness/test_lit.py
SCHEMES = ["learned", "rope", "alibi"]
PE_PRESETS = sorted(p.stem for p in (ROOT / "conf" / "pe").glob("*.yaml"))  # every pe= choice
FAST = [
    "model.n_layer=2", "model.n_embd=32", "model.n_head=4", "model.block_size=32",
    "data.batch_size=4", "trainer.max_steps=4", "trainer.val_check_interval=2",
    "trainer.limit_val_batches=2", "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false", "optim.warmup_steps=1",
    "eval.extrapolation.multipliers=[1,2,4]", "eval.extrapolation.max_tokens=512",
]


def scheme_of(run_dir: Path) -> str:
    """The scheme of a sweep subdir N-SCHEME-OVERRIDES."""
    return run_dir.name.split("-", 2)[1]


def run_train(args, tmp_path, env=None, timeout=600):
    full_env = {**os.environ, "HYDRA_FULL_ERROR": "1", **(env or {})}
    return run_python(["train.py", *args], cwd=ROOT, env=full_env, timeout=timeout)


def read_metrics(path: Path) -> dict[str, list[float]]:
    metrics: dict[str, list[float]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            for k, v in row.items():
                if v not in ("", None):
                    metrics.setdefault(k, []).append(float(v))
    return metrics


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    # float32: bf16 is emulated on CPUs without it (~9 s of each run here); the single runs below keep bf16-mixed
    proc = run_train(["-m", f"pe={','.join(SCHEMES)}", "logger=csv", f"hydra.sweep.dir={out}", *FAST,
                      "trainer.precision=32-true"], out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, proc


def test_multirun_one_output_dir_per_scheme(sweep):
    out, _ = sweep
    runs = sorted(p for p in out.iterdir() if p.is_dir() and (p / "checkpoints").exists())
    assert len(runs) == len(SCHEMES)
    seen = set()
    for run in runs:
        config = yaml.safe_load((run / "checkpoints" / "config.yaml").read_text())
        scheme = scheme_of(run)
        seen.add(scheme)
        assert config["pe"]["_target_"].startswith(f"model.pe.{scheme}.")
        assert config["model"]["vocab_size"] == 256 and config["model"]["block_size"] == 32
        # W&B identity: one group for the sweep, one run per scheme named by scheme + overrides
        assert config["group"] == f"sweep-{out.parent.name}_{out.name}"
        assert config["run_name"].startswith(f"{scheme}-model.n_layer=2,")
        assert "logger" not in config["run_name"] and f"pe:{scheme}" in config["tags"]
        assert (run / "checkpoints" / "last.ckpt").exists()
        metrics = read_metrics(run / "csv" / "metrics.csv")
        for key in ("train/loss", "val/loss", "val/ppl", "lr", "train/tokens_per_sec"):
            assert key in metrics, (run.name, key, sorted(metrics))
        assert metrics["val/ppl"][-1] == pytest.approx(torch.tensor(metrics["val/loss"][-1]).exp().item(), rel=1e-4)
        assert all(v > 0 for v in metrics["train/tokens_per_sec"])
        assert 3.0 < metrics["val/unigram_loss"][-1] < 3.5  # logged after fit, still flushed
        assert "extrapolation/nonoverlapping/none/ppl@32" in metrics
    assert seen == set(SCHEMES)


def test_sweep_writes_extrapolation_tables_and_compares(sweep, tmp_path):
    from evaluation.extrapolation import read_csv

    out, proc = sweep
    for scheme in SCHEMES:
        rows = read_csv(next(out.glob(f"*-{scheme}-*")) / "extrapolation" / "extrapolation.csv")
        assert [(r.eval_length, r.mode) for r in rows] == [(32, "nonoverlapping"), (64, "nonoverlapping"),
                                                          (128, "nonoverlapping")]
        for r in rows:
            applicable = scheme != "learned" or r.eval_length <= 32
            assert r.ok == applicable, (scheme, r)
            assert r.scheme == scheme and r.train_length == 32
            if r.ok:
                assert r.tokens == 512 // r.eval_length * r.eval_length and 1 < r.ppl < 300
    assert "[extrapolation] pe=alibi scaling=none mode=nonoverlapping train=32 eval=128" in proc.stdout
    report = run_python(["scripts/compare_runs.py", str(out), "--out", str(tmp_path)], cwd=ROOT, timeout=300)
    assert report.returncode == 0, report.stderr
    table = (tmp_path / "comparison.md").read_text()
    for scheme in SCHEMES:
        assert f"| {scheme} |" in table
    assert "| learned | " in table and "n/a" in table


def test_eval_script_sweeps_rope_scaling(sweep, tmp_path):
    from evaluation.extrapolation import read_csv

    out, _ = sweep
    ckpt = next(out.glob("*-rope-*")) / "checkpoints" / "last.ckpt"
    proc = run_python(
        ["scripts/eval_extrapolation.py", f"ckpt={ckpt}", "multipliers=1,4", "mode=nonoverlapping,sliding",
         "stride=16", "max_tokens=256", "rope_scaling=linear,ntk,yarn", f"out={tmp_path}"],
        cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_csv(tmp_path / "extrapolation.csv")
    assert {(r.rope_scaling, r.mode, r.eval_length) for r in rows} == {
        (s, m, n) for s in ("none", "linear", "ntk", "yarn") for m in ("nonoverlapping", "sliding") for n in (32, 128)}
    assert all(r.ok for r in rows)
    by = {(r.rope_scaling, r.mode, r.eval_length): r for r in rows}
    for s in ("linear", "ntk", "yarn"):  # factor = eval/train length = 1 at the train length: identical
        assert by[(s, "nonoverlapping", 32)].ppl == pytest.approx(by[("none", "nonoverlapping", 32)].ppl, rel=1e-6)
        assert by[(s, "nonoverlapping", 128)].ppl != by[("none", "nonoverlapping", 128)].ppl
    assert {r.stride for r in rows if r.mode == "sliding"} == {16}
    assert (tmp_path / "extrapolation.png").exists()


def test_eval_script_under_torchrun_shards_windows_and_gives_the_same_table(sweep, tmp_path):
    from evaluation.extrapolation import read_csv

    out, _ = sweep
    ckpt = next(out.glob("*-alibi-*")) / "checkpoints" / "last.ckpt"
    args = [f"ckpt={ckpt}", "multipliers=1,4", "mode=nonoverlapping,sliding", "max_tokens=2048", "precision=32"]
    tables = {}
    # the one-process reference forks from the test's forkserver (tests/cli.py); torchrun is a real subprocess
    for name, run in (("one", lambda cmd: run_python(cmd, cwd=ROOT, timeout=300)),
                      ("two", lambda cmd: subprocess.run([sys.executable, "-m", "torch.distributed.run",
                                                          "--nproc_per_node=2", *cmd], cwd=ROOT,
                                                         capture_output=True, text=True, timeout=300))):
        proc = run(["scripts/eval_extrapolation.py", *args, f"out={tmp_path / name}"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        tables[name] = read_csv(tmp_path / name / "extrapolation.csv")
    assert [(r.mode, r.eval_length, r.tokens) for r in tables["two"]] == \
        [(r.mode, r.eval_length, r.tokens) for r in tables["one"]]
    assert [r.loss for r in tables["two"]] == pytest.approx([r.loss for r in tables["one"]], rel=1e-6)


def test_eval_script_rejects_unknown_option(sweep):
    proc = run_python(["scripts/eval_extrapolation.py", "ckpt=x", "lenghts=5"], cwd=ROOT, timeout=120)
    assert proc.returncode != 0 and "unknown option 'lenghts'" in proc.stderr and "multipliers" in proc.stderr


def test_checkpoint_from_sweep_rebuilds_its_scheme(sweep):
    from pelab.lit import LitGPT

    out, _ = sweep
    for run in (p for p in out.iterdir() if (p / "checkpoints" / "last.ckpt").exists()):
        module = LitGPT.load_from_checkpoint(run / "checkpoints" / "last.ckpt", map_location="cpu")
        assert scheme_of(run) == module.pe_name


def test_single_run_wandb_goes_offline_by_itself(tmp_path):
    """Default logger (wandb) with no credentials and no WANDB_MODE: no prompt, no hang."""
    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home), "WANDB_MODE": "", "WANDB_API_KEY": "", "NETRC": str(home / ".netrc"),
           "WANDB_CONFIG_DIR": str(home / ".config" / "wandb")}
    proc = subprocess.run(
        [sys.executable, "train.py", "pe=alibi", f"hydra.run.dir={tmp_path / 'run'}", *FAST],
        cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "offline mode" in proc.stdout
    assert "wandb sync" in proc.stdout
    offline_runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 1 and any(offline_runs[0].glob("*.wandb"))
    assert "val loss" in proc.stdout and "unigram baseline" in proc.stdout
    assert str((tmp_path / "run" / "checkpoints").resolve()) in proc.stdout
    # under Hydra's logging each Lightning line appears once (on stdout and in train.log), not
    # also through Lightning's own console handler
    for line in ("GPU available:", "Seed set to 1337", "`Trainer.fit` stopped: `max_steps=4` reached"):
        assert (proc.stdout + proc.stderr).count(line) == 1, (line, proc.stdout, proc.stderr)
        assert line in (tmp_path / "run" / "train.log").read_text()


def compose_config(overrides, output_dir="/nonexistent/pelab-out"):
    """The config train.py gets, without Hydra's runtime (so paths.output_dir is given)."""
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[*overrides, f"paths.output_dir={output_dir}"])


def test_unknown_scheme_lists_valid_choices():
    with pytest.raises(MissingConfigException) as err:
        compose_config(["pe=rotary"])
    message = str(err.value)
    assert "pe/rotary" in message
    for scheme in PE_PRESETS:
        assert scheme in message


@pytest.mark.parametrize("scheme", PE_PRESETS)
def test_every_scheme_config_builds(scheme):
    import hydra

    from model.config import GPTConfig
    from model.pe import SCHEMES as REGISTRY

    from omegaconf import OmegaConf

    from pelab.lit import position_options

    cfg = compose_config([f"pe={scheme}"])
    # schedule and scaling belong to the model; resolved: a preset reads model.block_size
    options, _ = position_options(OmegaConf.to_container(cfg.pe, resolve=True))
    pe = hydra.utils.instantiate(options, _partial_=True)(GPTConfig(vocab_size=256, **cfg.model))
    presets = {"hope": "rope", "rope_half_truncated": "rope", "rope_frayed": "rope"}  # rope with options set
    assert type(pe) is REGISTRY[presets.get(scheme, scheme)]


@pytest.mark.parametrize("override,message", [
    ("model.n_head=5", "divisible by model.n_head=5"),
    ("optim.min_lr=1.0", "optim.min_lr must be in (0, optim.lr=0.001], got 1.0"),
    ("trainer.max_steps=-1", "trainer.max_steps must be > 0"),
    ("pe=rope_alibi pe.bias_heads=9", "pe.bias_heads must be in"),
])
def test_bad_config_fails_before_any_work(override, message):
    from pelab.validate import validate_config

    cfg = compose_config(override.split())
    with pytest.raises(ValueError) as err:
        validate_config(cfg)
    assert message in str(err.value)


def test_the_scheme_is_built_once_per_run(tmp_path, monkeypatch):
    """Validation builds the scheme (its checks need it built) and train.py trains that one."""
    import functools

    import lightning as L

    import model.pe.rope
    from train import train

    built, fitted = [], []
    real = model.pe.rope.RoPE.__init__

    @functools.wraps(real)
    def counting(self, *args, **kwargs):
        built.append(self)
        real(self, *args, **kwargs)

    monkeypatch.setattr(model.pe.rope.RoPE, "__init__", counting)
    monkeypatch.setattr(L.Trainer, "fit", lambda self, module, **kwargs: fitted.append(module))
    train(compose_config(["logger=csv", *TINY_RUN], output_dir=tmp_path / "out"))
    assert len(built) == 1 and fitted[0].model.pe is built[0]


def test_default_config_is_the_documented_one():
    cfg = compose_config([])
    assert cfg.pe._target_ == "model.pe.rope.RoPE"
    assert cfg.trainer.precision == "bf16-mixed"
    assert "wandb" in cfg.logger
    assert cfg.data.corpus._target_ == "data.corpus.GutenbergCorpus"


def test_ddp_on_two_cpu_processes_writes_artefacts_once(tmp_path):
    """The multi-device path under Hydra: gloo DDP, rank-zero-only checkpoints and evaluation."""
    run = tmp_path / "ddp"
    proc = run_train(["trainer.accelerator=cpu", "trainer.devices=2", "trainer.strategy=ddp", "logger=csv",
                      f"hydra.run.dir={run}", *FAST, "trainer.precision=32-true"], tmp_path,
                     env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "MEMBER: 2/2" in proc.stderr + proc.stdout
    assert proc.stdout.count("[pelab] extrapolation table") == 1
    assert (run / "checkpoints" / "last.ckpt").exists() and (run / "extrapolation" / "extrapolation.csv").exists()
    metrics = read_metrics(run / "csv" / "metrics.csv")
    assert "val/loss" in metrics and "train/tokens_per_sec" in metrics


def test_resume_from_checkpoint_continues(sweep, tmp_path):
    out, _ = sweep
    ckpt = next(out.glob("*-alibi-*")) / "checkpoints" / "last.ckpt"
    args = [a for a in FAST if not a.startswith("trainer.max_steps")]
    proc = run_train(["pe=alibi", "logger=csv", f"ckpt_path={ckpt}", "trainer.max_steps=6",
                      f"hydra.run.dir={tmp_path}", *args], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "finished at step 6" in proc.stdout
    steps = read_metrics(tmp_path / "csv" / "metrics.csv")["step"]
    assert min(steps) >= 4  # nothing re-trained from step 0
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 6


# --- run names, W&B failures, secrets, output dir --------------------------------------------

TINY_RUN = ["model.n_layer=1", "model.n_embd=32", "model.block_size=32", "data.batch_size=2", "trainer.max_steps=2",
            "trainer.val_check_interval=2", "trainer.limit_val_batches=2", "eval.extrapolation.enabled=false",
            "~callbacks.attention_maps", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]


def test_run_name_keeps_every_override_that_changes_training():
    from pelab.run import name_overrides

    given = ["pe=rope", "pe.base=100", "+pelican=1", "experiment=pe_ablation", "trainer.max_steps=5",
             "logger=csv", "logger.wandb.offline=true", "trainer.devices=2", "trainer.enable_progress_bar=false",
             "data.num_workers=2", "ckpt_path=x.ckpt", "~callbacks.attention_maps", "+secret_token=abc",
             "hydra.verbose=true"]
    # "pe" is the scheme choice only: not a prefix of pe.base or of pelican
    assert name_overrides(given) == ["pe.base=100", "+pelican=1", "experiment=pe_ablation", "trainer.max_steps=5"]


def test_long_run_names_stay_distinct_and_dirs_stay_valid_override_values():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from pelab.run import run_slug

    common = [f"+option_{i}=value" for i in range(20)]
    a, b = run_slug("rope", [*common, "seed=1"]), run_slug("rope", [*common, "seed=2"])
    assert a != b and max(len(a), len(b)) <= 128
    parser = OverridesParser.create()
    assert parser.parse_override(f"ckpt_path=multirun/0-{a}/last.ckpt").value() == f"multirun/0-{a}/last.ckpt"
    slug = run_slug("rope", ["pe.base=100", "optim.betas=[0.9,0.99]", "data.data_dir=/x/y"])
    assert slug == "rope-pe.base_100+optim.betas__0.9_0.99_"  # data_dir: not in names
    assert parser.parse_override(f"hydra.run.dir=multirun/0-{slug}").value() == f"multirun/0-{slug}"


def test_swept_pe_option_reaches_run_names_and_sweep_dirs(tmp_path):
    """Two values of a swept pe option give two W&B names and two sweep subdirs."""
    out = tmp_path / "sweep"
    proc = run_train(["-m", "pe=rope", "pe.base=100,10000", "logger=csv", f"hydra.sweep.dir={out}", *TINY_RUN], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = sorted(p for p in out.iterdir() if p.is_dir())
    assert [r.name.split("+")[0] for r in runs] == ["0-rope-pe.base_100", "1-rope-pe.base_10000"]
    names = [yaml.safe_load((r / "checkpoints" / "config.yaml").read_text())["run_name"] for r in runs]
    assert [n.split(",")[0] for n in names] == ["rope-pe.base=100", "rope-pe.base=10000"]
    assert all("model.n_layer=1" in n and "logger" not in n and "callbacks" not in n for n in names)
    assert [yaml.safe_load((r / "checkpoints" / "config.yaml").read_text())["pe"]["base"] for r in runs] == [100, 10000]


def fit_tiny(logger, steps: int):
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from pelab.lit import LitGPT

    x = torch.randint(0, 64, (64, 17), generator=torch.Generator().manual_seed(0))
    module = LitGPT(model=dict(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16),
                    pe={"_target_": "model.pe.rope.RoPE"}, optim={"warmup_steps": 1})
    trainer = L.Trainer(max_steps=steps, logger=logger, log_every_n_steps=1, accelerator="cpu", limit_val_batches=0,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=4))
    return trainer


def test_wandb_failing_mid_run_is_reported_once_and_training_goes_on(tmp_path, monkeypatch, capsys):
    import re

    import wandb

    from pelab.loggers import SafeWandbLogger

    calls = []
    real_log = wandb.sdk.wandb_run.Run.log

    def flaky_log(self, data, *args, **kwargs):
        calls.append(data)
        if len(calls) > 2:  # W&B works for two steps, then the disk fills up
            raise OSError("No space left on device")
        return real_log(self, data, *args, **kwargs)

    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log", flaky_log)
    logger = SafeWandbLogger(project="pelab-test", save_dir=str(tmp_path), offline=True)
    assert fit_tiny(logger, steps=6).global_step == 6
    err = capsys.readouterr().err
    assert err.count("W&B logging failed") == 1, err
    assert re.search(r"\[pelab\] W&B logging failed at step \d+: OSError: No space left on device; "
                     r"training continues, W&B logging disabled for this run", err), err
    assert len(calls) == 3  # nothing reached W&B after the failure
    logger.log_metrics({"val/unigram_loss": 3.0}, step=6)
    logger.log_hyperparams({"config": {"a": 1}})
    assert len(calls) == 3 and "W&B logging failed" not in capsys.readouterr().err
    assert "incomplete" in logger.finish()


def test_wandb_that_cannot_start_does_not_stop_training(tmp_path, capsys):
    from pelab.loggers import SafeWandbLogger

    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a W&B dir under a regular file cannot be created, even by root
    logger = SafeWandbLogger(project="pelab-test", save_dir=str(blocker / "wandb"), offline=True)
    assert fit_tiny(logger, steps=3).global_step == 3
    err = capsys.readouterr().err
    assert err.count("W&B logging failed") == 1 and "training continues" in err, err


def test_secrets_reach_no_file_and_no_output(tmp_path):
    import uuid

    key, token = f"wandbkey{uuid.uuid4().hex}", f"tok{uuid.uuid4().hex}"
    run = tmp_path / "run"
    proc = run_train([f"+secret_token={token}", f"hydra.run.dir={run}", *TINY_RUN], tmp_path,
                     env={"WANDB_API_KEY": key, "WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert any(run.glob("wandb/offline-run-*/*.wandb"))  # the W&B run (config, command line) is in there
    files = [f for f in run.rglob("*") if f.is_file()]
    for secret in (key, token):
        assert secret not in proc.stdout + proc.stderr
        assert not [f for f in files if secret.encode() in f.read_bytes()]
    assert yaml.safe_load((run / "checkpoints" / "config.yaml").read_text())["secret_token"] == "***"
    assert "+secret_token=***" in (run / ".hydra" / "overrides.yaml").read_text()


@pytest.mark.parametrize("blocked_by", ["a regular file", "a read-only directory"])
def test_unwritable_output_dir_fails_before_any_work(tmp_path, blocked_by):
    parent = tmp_path / "parent"
    if blocked_by == "a regular file":
        parent.write_text("")
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes through permission bits; the regular-file case covers root")
        parent.mkdir()
        parent.chmod(0o500)
    run, cache = parent / "run", tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    proc = run_python(["train.py", f"hydra.run.dir={run}", "logger=csv"], cwd=ROOT,
                      env={**env, "PELAB_CACHE": str(cache)}, timeout=300)
    assert proc.returncode != 0
    assert f"output directory {run}" in proc.stderr and "hydra.run.dir=PATH" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not run.exists() and not cache.exists()  # no data prepared


def test_unwritable_paths_output_dir_is_refused_by_train(tmp_path, monkeypatch):
    import pelab.datamodule
    from train import train

    monkeypatch.setattr(pelab.datamodule.TextDataModule, "setup", lambda *a: pytest.fail("data was read"))
    (tmp_path / "a-file").write_text("")
    cfg = compose_config(["logger=csv"], output_dir=tmp_path / "a-file" / "out")
    with pytest.raises(ValueError, match="output directory .*a-file/out cannot be created"):
        train(cfg)


def test_scripts_wandb_failure_keeps_the_results(tmp_path, monkeypatch, capsys):
    import wandb

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from _common import log_to_new_wandb_run

    from evaluation.extrapolation import loggable

    def broken_init(*args, **kwargs):
        raise OSError("read-only file system")

    monkeypatch.setattr(wandb, "init", broken_init)
    log_to_new_wandb_run(loggable([], tmp_path / "none.png"), tmp_path)  # no exception
    assert "[pelab] W&B logging failed: OSError: read-only file system" in capsys.readouterr().err


def test_task_ablation_trains_and_writes_the_accuracy_table(tmp_path):
    """experiment=task_ablation end to end: a synthetic task, no perplexity harness, the
    accuracy-vs-length table at the end (one row per length x passkey depth)."""
    out = tmp_path / "run"
    proc = run_train(["experiment=task_ablation", f"hydra.run.dir={out}", "logger=csv",
                      "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=64",
                      "data.batch_size=4", "data.val_samples=8", "trainer.max_steps=3", "trainer.val_check_interval=3",
                      "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
                      "~callbacks.attention_maps", "eval.tasks.samples=4", "eval.tasks.multipliers=[1,2]",
                      "eval.tasks.depths=[0.0,1.0]"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out / "tasks" / "tasks.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted((int(r["eval_length"]), float(r["depth"])) for r in rows) == [(64, 0.0), (64, 1.0), (128, 0.0),
                                                                               (128, 1.0)]
    assert all(r["status"] == "ok" and int(r["samples"]) == 4 and 0.0 <= float(r["accuracy"]) <= 1.0 for r in rows)
    assert not (out / "extrapolation").exists()
