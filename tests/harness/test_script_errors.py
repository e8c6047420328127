"""Bad input to the scripts and to a sweep's launcher (issue 32 §4, the third list) ends in one line
naming the option, the bad value and what is allowed, before a checkpoint or any data is read.

The scripts' ``main`` runs in-process (their option parsing comes first); one real command line
per kind of failure proves the user sees that line and no traceback.
"""

import functools
import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.cli import run_python

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
sys.path.insert(0, str(ROOT / "scripts"))


@functools.cache
def script(name: str):
    """scripts/<name>.py as a module (its main not run)."""
    spec = importlib.util.spec_from_file_location(f"pelab_script_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def no_checkpoint_read(monkeypatch):
    """Reading or loading a checkpoint fails the test: options are checked first."""
    import pelab.checkpoint

    def forbidden(*args, **kwargs):
        pytest.fail("a checkpoint was read for a bad option")

    monkeypatch.setattr(pelab.checkpoint, "read_checkpoint", forbidden)
    monkeypatch.setattr(pelab.checkpoint, "load_lit_gpt", forbidden)


# (script, option, the message: option, value given, what is allowed)
CASES = [
    ("eval_extrapolation", "lengths=abc", "lengths='abc' is not valid: expected positive integers, e.g. 300,1000"),
    ("eval_extrapolation", "multipliers=two", "multipliers='two' is not valid: expected positive numbers"),
    ("eval_extrapolation", "multipliers=1,0", "multipliers='1,0' is not valid: expected positive numbers"),
    ("eval_extrapolation", "stride=half", "stride='half' is not valid: expected an integer >= 1, or null"),
    ("eval_extrapolation", "device=gpu", "device='gpu' is not valid: expected cpu, cuda or cuda:N"),
    ("eval_extrapolation", "precision=bf17", "precision='bf17' is not valid: expected one of bf16-mixed, 16-mixed, "
                                             "32-true, 32"),
    ("eval_extrapolation", "mode=slide", "mode='slide' is not valid: expected one of nonoverlapping, sliding"),
    ("eval_extrapolation", "wandb=maybe", "wandb='maybe' is not valid: expected true or false"),
    ("sample", "tokens=ten", "tokens='ten' is not valid: expected an integer >= 1"),
    ("sample", "tokens=-5", "tokens='-5' is not valid: expected an integer >= 1"),
    ("sample", "top_k=-3", "top_k='-3' is not valid: expected an integer >= 0 (0 = all tokens)"),
    ("sample", "device=gpu", "device='gpu' is not valid: expected cpu, cuda or cuda:N"),
    ("sample", "prompt=", "prompt='' is not valid: expected text to continue"),
    ("sample", "temperature=-1", "temperature='-1' is not valid: expected a finite number >= 0 (0 = greedy"),
    ("sample", "temperature=nan", "temperature='nan' is not valid: expected a finite number >= 0"),
    ("sample", "top_p=0", "top_p='0' is not valid: expected a finite number > 0 and <= 1"),
    ("eval_tasks", "precision=bf17", "precision='bf17' is not valid: expected one of bf16-mixed"),
    ("eval_tasks", "depths=0,2", "depths='0,2' is not valid: expected numbers in [0, 1]"),
    ("eval_tasks", "samples=many", "samples='many' is not valid"),
    ("eval_tasks", "device=gpu", "device='gpu' is not valid: expected cpu, cuda or cuda:N"),
]


@pytest.mark.parametrize("name,option,message", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_bad_script_option_is_one_line_before_the_checkpoint_is_read(name, option, message, no_checkpoint_read):
    with pytest.raises(SystemExit) as exit_:
        script(name).main(["ckpt=run/checkpoints/last.ckpt", option])
    assert str(exit_.value.code) == message or str(exit_.value.code).startswith(message), exit_.value.code
    assert "\n" not in str(exit_.value.code)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message for a machine without a GPU")
def test_device_cuda_without_a_gpu_says_so(no_checkpoint_read):
    with pytest.raises(SystemExit) as exit_:
        script("sample").main(["ckpt=x", "device=cuda"])
    assert str(exit_.value.code).startswith("device='cuda' is not valid: expected cpu: torch")
    assert "sees no CUDA GPU" in str(exit_.value.code)


def test_good_options_parse_to_the_values_given():
    """The other side: what a user may give is taken as given (0 = greedy, top_k 0 = all, null stride)."""
    from _cli import command_line

    sample = script("sample").parse_options(command_line("sample", [
        "ckpt=x", "temperature=0", "top_k=0", "tokens=7", "prompt= ", "cache=false", "top_p=1"], ""))
    assert (sample["temperature"], sample["top_k"], sample["tokens"], sample["prompt"], sample["cache"],
            sample["top_p"]) == (0.0, 0, 7, " ", False, 1.0)
    assert sample["device"].type in ("cpu", "cuda")
    given = script("eval_extrapolation").parse_options(command_line("eval_extrapolation", [
        "ckpt=x", "multipliers=[1,2.5]", "lengths=300", "mode=sliding", "stride=null", "precision=32",
        "documents=none,train", "rope_scaling=none,yarn", "rope_scaling_factor=2"], ""))
    assert given == {"multipliers": [1.0, 2.5], "lengths": [300], "modes": ["sliding"], "stride": None,
                     "precision": "32", "documents": ["none", None], "rope_scaling": [None, "yarn"],
                     "rope_scaling_factor": 2.0}


@pytest.fixture
def old_run(tmp_path) -> Path:
    """RUN_DIR/checkpoints/last.ckpt of a run (tests/fixtures: rope, model.block_size=256)."""
    ckpt_dir = tmp_path / "run" / "checkpoints"
    ckpt_dir.mkdir(parents=True)
    shutil.copy(FIXTURES / "main-b42b955-rope.ckpt", ckpt_dir / "last.ckpt")
    shutil.copy(FIXTURES / "main-b42b955-rope.yaml", ckpt_dir / "config.yaml")
    return ckpt_dir / "last.ckpt"


def test_sliding_stride_past_every_eval_length_is_refused_before_the_model_loads(old_run, monkeypatch):
    """eval.extrapolation.stride=100000 used to train (or load), then skip every length: an empty table."""
    import pelab.checkpoint

    monkeypatch.setattr(pelab.checkpoint, "load_lit_gpt", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exit_:
        script("eval_extrapolation").main([f"ckpt={old_run}", "mode=sliding", "stride=100000", "multipliers=1,2"])
    # eval lengths 1 x 256 and 2 x 256: a stride of at most 512 scores a window
    assert str(exit_.value.code) == ("stride must be null (half the eval length) or at most the longest eval length, "
                                     "512 (eval lengths 256, 512 at a training length of 256): sliding windows "
                                     "advance by the stride and score its last tokens, got 100000")


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "32-true", "32", "64-true"])
def test_results_title_says_what_the_precision_computed_in(precision):
    """The title written above the table names the dtype the evaluation's matmuls ran in: measured
    here by a matmul under the evaluation's own autocast context."""
    from _common import precision_ran

    from evaluation.sweep import autocast

    device = torch.device("cpu")
    with autocast(precision, device):
        ran = (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
    expected = str(ran).removeprefix("torch.") + (" autocast" if ran != torch.float32 else "")
    assert precision_ran(precision, device) == f"{precision} ({expected})"


def test_compare_runs_given_a_lightning_metrics_csv_says_what_it_reads(tmp_path):
    """A Lightning CSVLogger file passed by name used to end in a TypeError inside evaluation/."""
    metrics = tmp_path / "run" / "csv" / "metrics.csv"
    metrics.parent.mkdir(parents=True)
    metrics.write_text("epoch,step,train/loss,val/loss\n0,9,5.5,\n0,9,,5.4\n")
    with pytest.raises(SystemExit) as exit_:
        script("compare_runs").main([str(metrics), "--out", str(tmp_path / "report")])
    message = str(exit_.value.code)
    assert message.startswith(f"{metrics} is not a results table (a Lightning CSVLogger metrics file): its columns "
                              f"are epoch, step, train/loss, val/loss, and extrapolation.csv needs scheme, "), message
    assert f"give the run or sweep directory ({tmp_path / 'run'})" in message
    assert not (tmp_path / "report").exists()


def compose_sweep(*overrides):
    import train  # noqa: F401 - registers the resolvers of the sweep subdir
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        return compose("config", overrides=list(overrides), return_hydra_config=True)


def test_slurm_launcher_without_srun_is_refused_and_with_srun_accepted(tmp_path, monkeypatch):
    """submitit decides whether SLURM is here by finding srun on PATH; a fake srun makes it so."""
    from pelab.config import ConfigError
    from pelab.launch_check import check_launcher

    slurm = compose_sweep("hydra/launcher=slurm")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError) as err:
        check_launcher(slurm)
    assert str(err.value).startswith("hydra/launcher=slurm submits each job through submitit's slurm executor, "
                                     "which cannot run on this machine (SLURM's srun is not on PATH")
    assert "hydra/launcher=submitit_local" in str(err.value)
    check_launcher(compose_sweep("hydra/launcher=submitit_local"))  # runs anywhere
    check_launcher(compose_sweep())  # Hydra's basic launcher
    srun = tmp_path / "srun"
    srun.write_text("#!/bin/sh\n")
    srun.chmod(0o755)
    check_launcher(slurm)


def test_cli_reports_bad_launcher_and_bad_script_option_in_one_line(tmp_path):
    """The real command lines: non-zero exit, the line on stderr, no traceback, nothing written."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if not (Path(p) / "srun").exists())
    sweep = tmp_path / "sweep"
    proc = run_python(["train.py", "-m", "hydra/launcher=slurm", f"hydra.sweep.dir={sweep}"],
                      cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "hydra/launcher=slurm submits each job through submitit's slurm executor" in proc.stderr
    assert not sweep.exists()
    proc = run_python(["scripts/sample.py", "ckpt=x", "tokens=ten"], cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 1 and proc.stderr == "tokens='ten' is not valid: expected an integer >= 1\n"


def compose_evaluate(*overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        return compose("scripts/evaluate", overrides=list(overrides))


@pytest.mark.parametrize("override,message", [
    ("eval.extrapolation.q_chunk=0", "eval.extrapolation.q_chunk must be >= 1, got 0"),
    ("eval.sweep.q_chunk=0", "eval.extrapolation.q_chunk must be >= 1, got 0"),  # read by every sweep block
    ("eval.probe.enabled=maybe", "eval.probe.enabled must be true or false, got 'maybe'"),
    ("eval.tasks.enabled=true", "eval.tasks.enabled=true needs a synthetic task: data=synthetic data.task=..."),
    ("wandb=maybe", "wandb='maybe' is not valid: expected true or false"),
])
def test_evaluate_checks_its_options_before_the_checkpoint_is_read(old_run, no_checkpoint_read, override, message):
    overrides = [f"ckpt={old_run}", override]
    with pytest.raises(SystemExit) as exit_:
        script("evaluate").evaluate(compose_evaluate(*overrides), overrides)
    assert str(exit_.value.code) == message


def test_evaluate_puts_overrides_on_the_runs_own_eval_section(old_run):
    """The run's saved blocks, a shared key reaching the keys that read it, a key given itself winning."""
    from omegaconf import OmegaConf

    overrides = [f"ckpt={old_run}", "eval.sweep.q_chunk=512", "eval.tasks.q_chunk=64", "eval.probe.enabled=false"]
    run = OmegaConf.load(old_run.parent / "config.yaml")
    section = script("evaluate").eval_section(run, compose_evaluate(*overrides), overrides)
    assert section["extrapolation"]["q_chunk"] == 512 and section["tasks"]["q_chunk"] == 64
    assert section["probe"]["q_chunk"] == 256 and section["probe"]["enabled"] is False  # its own q_chunk
    assert section["extrapolation"]["max_tokens"] == run.eval.extrapolation.max_tokens  # as the run saved it
    assert section["extrapolation"]["enabled"] is True and run.eval.extrapolation.enabled is False  # conf/eval's


def test_evaluate_command_line_refuses_an_unknown_key_in_one_line(tmp_path):
    proc = run_python([str(ROOT / "scripts" / "evaluate.py"), "ckpt=x.ckpt", "eval.extrapolation.multiplierz=[1]"],
                      cwd=tmp_path, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("unknown option 'eval.extrapolation.multiplierz' "
                                  "(eval.extrapolation.multiplierz=[1]); valid options of eval.extrapolation: "
                                  "enabled, multipliers, lengths,"), proc.stderr
    assert proc.stderr.count("\n") == 1 and not list(tmp_path.iterdir())  # nothing written, no outputs/


# ------------------------------------------------------------------ the one command line (scripts/_cli.py)
SCRIPTS = sorted(p.stem for p in (ROOT / "conf" / "scripts").glob("*.yaml"))


def test_every_script_has_its_config_and_every_script_its_keys():
    """conf/scripts/<name>.yaml is scripts/<name>.py's; the scripts without one take train.py's tree
    (prepare_data.py) or keep their flags (compare_runs.py)."""
    without = {p.stem for p in (ROOT / "scripts").glob("[!_]*.py")} - set(SCRIPTS)
    assert without == {"prepare_data", "compare_runs"}, without


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_lists_every_key_with_its_line_and_an_unknown_key_is_one_line(name, capsys, no_checkpoint_read):
    from omegaconf import OmegaConf

    from _cli import compose

    tree = OmegaConf.to_container(compose(name), resolve=False)
    keys = list(tree)
    assert script(name).main(["--help"]) in (0, {}, None)
    printed = capsys.readouterr().out
    assert printed.startswith(script(name).__doc__.strip().splitlines()[0])
    for key in keys:
        if isinstance(tree[key], dict):  # a block (evaluate.py's eval): its keys, by sub-block
            assert f"  {key}.KEY: {', '.join(k for k, v in tree[key].items() if not isinstance(v, dict))}" in printed
            continue
        (line,) = [line for line in printed.splitlines() if line.startswith(f"  {key} ")]
        assert len(line.split(None, 1)) == 2, line  # the key, then its help
    with pytest.raises(SystemExit) as exit_:
        script(name).main(["nonsense_key=1"])
    message = str(exit_.value.code)
    assert message == f"unknown option 'nonsense_key' (nonsense_key=1); valid options: {', '.join(keys)}"


def test_values_read_as_the_commands_typed_before_hydra():
    from _cli import command_line

    cfg = command_line("sample", ["prompt=It's one, (two) = ${three}", "tokens=7", "cache=false"], "")
    assert (cfg.prompt, cfg.tokens, cfg.cache) == ("It's one, (two) = ${three}", 7, False)  # text: as typed
    cfg = command_line("eval_extrapolation", ["ckpt=a.ckpt", "multipliers=1,2.5", "mode=sliding", "stride=null"], "")
    assert (list(cfg.multipliers), cfg.mode, cfg.stride, cfg.ckpt) == ([1, 2.5], "sliding", None, "a.ckpt")
    assert OmegaConfMissing(cfg, "lengths")  # not given: the run's
    cfg = command_line("bench", ["variants=window_pattern=[256,null],window=256", "eval=false", "schemes=rope,alibi"], "")
    assert (cfg.variants, cfg.eval, cfg.schemes) == ("window_pattern=[256,null],window=256", False, "rope,alibi")
    cfg = command_line("eval_rolling", ["data=docs.jsonl", "max_length=64"], "")  # not the training tree's groups
    assert (cfg.data, cfg.max_length) == ("docs.jsonl", 64)
    with pytest.raises(SystemExit, match=r"^tokens=range\(1,3\): a sweep; a script runs once"):
        command_line("sample", ["tokens=range(1,3)"], "")
    with pytest.raises(SystemExit, match=r"^expected key=value, got 'oops'; keys: ckpt, prompt"):
        command_line("sample", ["oops"], "")


def OmegaConfMissing(cfg, key) -> bool:
    from omegaconf import OmegaConf

    return OmegaConf.is_missing(cfg, key)


def test_eval_scripts_run_evaluate_with_their_probe_alone(old_run, monkeypatch):
    """eval_extrapolation.py's keys land on evaluate.py's eval.extrapolation, on top of the run's
    block; every other probe is off; ckpt, device and out pass through."""
    from _cli import script as loaded

    seen = {}

    def record(ckpt, run, options, device, out, log_wandb, seed):
        seen.update(ckpt=ckpt, options=options, device=device.type, out=out, wandb=log_wandb)
        return {}

    monkeypatch.setattr(loaded("evaluate"), "evaluate_checkpoint", record)
    assert script("eval_extrapolation").main([f"ckpt={old_run}", "multipliers=1,2", "mode=nonoverlapping,sliding",
                                              "stride=64", "device=cpu", "out=somewhere"]) == 0
    options = seen["options"]
    assert [name for name, block in options.items() if isinstance(block, dict) and block.get("enabled") is True] == \
        ["extrapolation"]
    block = options["extrapolation"]
    assert (block["multipliers"], block["lengths"], block["modes"], block["stride"]) == \
        ([1.0, 2.0], [], ["nonoverlapping", "sliding"], 64)
    assert block["max_tokens"] == OmegaConf_load(old_run).eval.extrapolation.max_tokens  # the run's
    assert (seen["ckpt"], seen["device"], seen["out"], seen["wandb"]) == (old_run, "cpu", "somewhere", False)


def test_eval_tasks_passes_its_seed_and_names_its_own_keys(monkeypatch):
    """seed=0 (falsy) reaches evaluate.py; an error evaluate.py raises about eval.tasks.samples says samples."""
    from _cli import command_line
    from _cli import script as loaded

    evaluate, seen = loaded("evaluate"), []

    def fake_main(overrides):
        seen.extend(overrides)
        raise SystemExit("eval.tasks.samples must be an integer >= 1, got 0; eval.tasks.enabled stays")

    monkeypatch.setattr(evaluate, "main", fake_main)
    cfg = command_line("eval_tasks", ["ckpt=x.ckpt", "seed=0", "samples=3"], "")
    with pytest.raises(SystemExit) as exit_:
        evaluate.probe_alone("tasks", cfg, {"samples": 3})
    assert str(exit_.value.code) == "samples must be an integer >= 1, got 0; eval.tasks.enabled stays"
    assert seen[:3] == ["ckpt='x.ckpt'", "device=null", "out=null"] and "seed=0" in seen
    assert "eval.tasks.enabled=true" in seen and "eval.extrapolation.enabled=false" in seen
    assert "eval.tasks.samples=3" in seen


def OmegaConf_load(ckpt):
    from omegaconf import OmegaConf

    return OmegaConf.load(ckpt.parent / "config.yaml")


def test_consolidate_refuses_a_file_before_writing(old_run, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        script("consolidate").main([f"ckpt={old_run}", f"out={tmp_path / 'full.ckpt'}"])
    assert str(exit_.value.code) == (f"ckpt='{old_run}' is not valid: expected a sharded checkpoint directory "
                                     f"(trainer=fsdp); a file is one checkpoint already")
    assert not (tmp_path / "full.ckpt").exists()


def test_a_plain_folder_given_as_ckpt_is_not_a_checkpoint_not_a_half_written_one(tmp_path):
    """A folder with no sharded checkpoint's file in it used to read as "a half-written sharded
    checkpoint"; one that has some of them (a save cut short) still does."""
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "readme.txt").write_text("not weights")
    with pytest.raises(SystemExit) as exit_:
        script("export_hf").main([f"ckpt={folder}", f"out={tmp_path / 'hf'}"])
    assert str(exit_.value.code) == (f"ckpt={folder} is a folder but not a checkpoint (no meta.pt, .metadata or "
                                     "shard file in it): expected a .ckpt file or a sharded checkpoint directory "
                                     "written by train.py (RUN_DIR/checkpoints/*.ckpt)")
    (folder / "__0_0.distcp").write_bytes(b"shard")
    with pytest.raises(SystemExit, match=r"is a half-written sharded checkpoint \(no \.metadata or meta\.pt"):
        script("export_hf").main([f"ckpt={folder}", f"out={tmp_path / 'hf'}"])
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("under", ["", "x/y"])
def test_gpu_check_refuses_an_out_that_is_a_file_or_under_one_before_anything_starts(tmp_path, monkeypatch, under):
    import gpucheck.steps

    monkeypatch.setattr(gpucheck.steps, "all_steps", lambda *a, **k: pytest.fail("steps built for a bad out="))
    blocker = tmp_path / "report.md"
    blocker.write_text("mine")
    out = blocker / under if under else blocker
    with pytest.raises(SystemExit) as exit_:
        script("gpu_check").main([f"out={out}"])
    where = f": {blocker} above it is" if under else " is"
    assert str(exit_.value.code) == (f"out={out}{where} a file, not a folder; give out= a new folder, or an existing "
                                     "folder this user can write, for the report")
    assert blocker.read_text() == "mine"


def test_compare_runs_refuses_an_ignore_key_no_run_has_naming_the_nearest(tmp_path):
    from tests.evaluation.test_compare_runs import seed_run

    sweep = tmp_path / "multirun"
    for seed in (1, 2):
        seed_run(sweep, f"{seed}-alibi", "alibi", seed, {64: 4.0 + seed})
    for key, near in (("data.sed", "data.seed"), ("pe.bse", "pe._target_"), ("trainer", "trainer.")):
        with pytest.raises(SystemExit) as exit_:
            script("compare_runs").main([str(sweep), "--out", str(tmp_path / "report"), "--ignore", key])
        message = str(exit_.value.code)
        assert message.startswith(f"--ignore {key}: no compared run's config has this key; nearest keys: "), message
        assert near in message.split("nearest keys: ")[1] and message.endswith("(a whole group: PREFIX. with the dot)")
    assert not (tmp_path / "report").exists()
    # a key and a group that the runs have are taken
    assert script("compare_runs").main([str(sweep), "--out", str(tmp_path / "report"), "--ignore", "data.task",
                                        "--ignore", "trainer."]) == 0
