"""Helpers shared by the scripts: import path, option values, checkpoints and run configs."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the checkout is the application: model/, data/ are not installed
    sys.path.insert(0, str(ROOT))


def join_torchrun_group(device) -> bool:
    """Under ``torchrun`` (WORLD_SIZE > 1): join its process group (NCCL on CUDA, else gloo),
    one GPU per local rank, and return True; a plain ``python`` start returns False."""
    import atexit
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    import torch
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    atexit.register(dist.destroy_process_group)  # the backend's threads stopped before exit (else it may abort)
    return True


def checked_checkpoint(path) -> Path:
    """``ckpt=PATH`` checked to be a readable pelab checkpoint (not truncated, not a foreign file)
    before any data is read; load it with ``pelab.checkpoint.load_lit_gpt``."""
    from pelab.checkpoint import CheckpointError, check_tokenizer, read_checkpoint

    ckpt = Path(str(path))
    try:
        check_tokenizer(read_checkpoint(ckpt, key="ckpt"), f"ckpt={ckpt}")  # and its tokenizer unchanged since
    except CheckpointError as e:
        raise SystemExit(str(e)) from None
    return ckpt


def path_option(check: str, key: str, value, *args, **kwargs) -> Path:
    """``key=value`` through data/paths.py's ``check`` (output_folder, output_file: exists or can
    be created, right kind, writable, not the command's own input), before anything is read; a
    refusal is the script's one line."""
    import data.paths

    return path_option_of(getattr(data.paths, check), key, value, *args, **kwargs)


def path_option_of(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with its ``data.paths.PathError`` (a path option, a full disk) as the
    script's one line."""
    from data.paths import PathError

    try:
        return fn(*args, **kwargs)
    except PathError as e:
        raise SystemExit(str(e)) from None


def required(cfg, key: str, what: str):
    """``cfg[key]``, or one line saying it is required (its value in conf/scripts is ``???``)."""
    from omegaconf import OmegaConf

    if OmegaConf.is_missing(cfg, key):
        raise SystemExit(f"{key}={what} is required (--help lists the options)")
    return cfg[key]


def load_run_config(ckpt: Path, needed_for: str):
    """The resolved config train.py saved beside the checkpoint (``checkpoints/config.yaml``)."""
    from omegaconf import OmegaConf

    path = ckpt.parent / "config.yaml"
    if not path.is_file():
        raise SystemExit(f"{path} not found: the run's resolved config (written by train.py) tells {needed_for}")
    return OmegaConf.load(path)


def log_to_new_wandb_run(logged, out: Path, **init) -> None:
    """One W&B run holding an evaluation's tables and charts (``logged``: an evaluation.results.Logged
    or a list of them); offline (and said so) when the server cannot be reached or there are no
    credentials, as train.py does."""
    import os

    import wandb

    from pelab.loggers import log_to_wandb, wandb_offline_reason

    why = "WANDB_MODE=offline" if os.environ.get("WANDB_MODE") == "offline" else wandb_offline_reason()
    try:  # the results are already on disk: a W&B failure must not turn into a failed command
        run = wandb.init(dir=str(out), mode="offline" if why else "online", **init)
        for one in logged if isinstance(logged, list) else [logged]:
            log_to_wandb(one, run)
        run.finish()
    except Exception as err:  # noqa: BLE001 - whatever W&B raises
        print(f"[pelab] W&B logging failed: {type(err).__name__}: {err}; the results are in {out}", file=sys.stderr)
        return
    print(f"[pelab] W&B offline run in {out / 'wandb'} ({why}; upload later with wandb sync)" if why
          else f"[pelab] W&B run: {run.url}")


def run_eval_block(cfg, name: str) -> dict:
    """``eval.<name>`` as the run saved it; a run saved before that block existed gets
    conf/eval/default.yaml's, at the run's trainer.precision."""
    from omegaconf import OmegaConf

    saved = cfg.get("eval", {}).get(name)
    if saved is None:
        tree = OmegaConf.create({"eval": OmegaConf.load(ROOT / "conf" / "eval" / "default.yaml"),
                                 "trainer": {"precision": cfg.trainer.precision}})
        saved = tree.eval[name]
    return OmegaConf.to_container(saved, resolve=True)


def evaluate_checkpoint(ckpt: Path, cfg, options: dict, device, out: str | None = None, log_wandb: bool = False,
                        seed: int | None = None) -> dict:
    """The probes ``options`` (probe blocks by name) enables, on the checkpoint, through the runner
    train.py uses (pelab/evaluate.py), so the files are the same. Under torchrun every rank scores
    its share of a sharded probe. Files go to ``out``, else RUN_DIR/<probe>/eval-<ckpt>-<time>/
    (earlier results are never overwritten); ``log_wandb``: one W&B run per probe in the run's
    group. ``seed``: the task samples' seed (default the run's). Returns {name: Outcome}."""
    import torch

    from data.cache import check_cache_folder
    from evaluation.registry import PROBES, enabled_probes
    from pelab.checkpoint import load_lit_gpt, read_checkpoint
    from pelab.datamodule import build_datamodule
    from pelab.evaluate import run_evaluations, subject_of

    datamodule = build_datamodule(cfg.data)  # reads nothing yet
    if hasattr(datamodule, "token_dir"):  # the token cache's folder, as train.py checks it
        path_option_of(check_cache_folder, datamodule.token_dir, "data.data_dir", cfg.data.get("data_dir"))
    if not enabled_probes(options, getattr(datamodule, "held_out_text", True)):
        raise SystemExit(f"nothing to evaluate: no probe of eval.{{{','.join(n for n in options if n in PROBES)}}} is "
                         f"enabled for this run's data (data._target_={cfg.data.get('_target_')}; extrapolation needs "
                         f"held-out text, tasks a synthetic task)")
    distributed = join_torchrun_group(device)
    if distributed and device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    rank_zero = not distributed or torch.distributed.get_rank() == 0
    module = load_lit_gpt(ckpt, map_location=device)
    module.model.to(device)
    if getattr(datamodule, "held_out_text", True):
        if rank_zero:  # a full disk while the token cache is built: its one line
            path_option_of(datamodule.prepare_data)
        if distributed:
            torch.distributed.barrier()  # the other ranks read the cache rank zero prepared
        datamodule.setup("validate")
    stamp = time.strftime("%Y%m%d-%H%M%S")

    def where(probe) -> Path:
        return Path(out) if out else ckpt.parent.parent / probe.output / f"eval-{ckpt.stem}-{stamp}"

    def note(config) -> str | None:
        return f"precision={precision_ran(config.precision, device)}" if hasattr(config, "precision") else None

    subject = subject_of(module, datamodule, distributed=distributed, rank_zero=rank_zero, seed=seed)
    step = read_checkpoint(ckpt, "ckpt").get("global_step", 0)  # the files say which model they score
    outcomes = run_evaluations(subject, options, where, step, rank_zero=rank_zero, note=note)
    for name, outcome in outcomes.items():
        if "md" in outcome.paths:
            print(outcome.paths["md"].read_text())
        if log_wandb:
            given = {k: v for k, v in options[name].items() if k != "enabled"}
            log_to_new_wandb_run([logged for logged, _ in outcome.reports], outcome.paths["csv"].parent,
                                 project=cfg.get("project", "pelab"), group=cfg.get("group"), job_type="eval",
                                 name=f"{cfg.get('run_name') or module.pe_name}-{name}",
                                 config={"ckpt": str(ckpt), **({} if seed is None else {"seed": seed}), **given})
    return outcomes


# --- option values -------------------------------------------------------------------------------
# Every script checks its options (as Hydra read them, scripts/_cli.py) with these, before any
# checkpoint or data is read: a bad value ends in one line naming the option, the value as typed
# and what is allowed.

def shown(value) -> str:
    """``value`` as it was typed: ``1,0`` for the list [1, 0], ``null`` for None."""
    if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig":
        return ",".join(shown(v) for v in value)
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def bad_value(key: str, value, allowed: str):
    raise SystemExit(f"{key}={shown(value)!r} is not valid: expected {allowed}")


def given(cfg, key: str) -> bool:
    """Whether ``key`` was given: the evaluation scripts' keys default to ``???`` (the run's value)."""
    from omegaconf import OmegaConf

    return key in cfg and not OmegaConf.is_missing(cfg, key)


def split_list(text: str) -> list[str]:
    """A comma-separated text key's items (bench's ``configs``, ``schemes``): ``a,b`` or ``[a,b]``."""
    return [v.strip() for v in str(text).strip("[]").split(",") if v.strip()]


def items(value) -> list:
    """A list option's items; one value is a list of one (``mode=sliding``)."""
    return list(value) if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig" else [value]


def is_null(value) -> bool:
    return value is None or isinstance(value, str) and value.strip().lower() in ("null", "none")


def integer(key: str, value, minimum: int | None = None, allowed: str | None = None) -> int:
    """``value`` as an int (>= ``minimum``)."""
    allowed = allowed or ("an integer" if minimum is None else f"an integer >= {minimum}")
    if not isinstance(value, int) or isinstance(value, bool) or minimum is not None and value < minimum:
        bad_value(key, value, allowed)
    return value


def number(key: str, value, minimum: float | None = None, maximum: float | None = None,
           above: float | None = None, allowed: str | None = None) -> float:
    """``value`` as a finite float, >= ``minimum``, <= ``maximum``, > ``above`` where given."""
    bounds = [f">= {minimum:g}" if minimum is not None else "", f"> {above:g}" if above is not None else "",
              f"<= {maximum:g}" if maximum is not None else ""]
    allowed = allowed or " and ".join(["a finite number", *filter(None, bounds)]).replace(" and ", " ", 1)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        bad_value(key, value, allowed)
    x = float(value)
    if not (math.isfinite(x) and (minimum is None or x >= minimum) and (maximum is None or x <= maximum)
            and (above is None or x > above)):
        bad_value(key, value, allowed)
    return x


def numbers(key: str, value, parse, allowed: str) -> list:
    """A list (``1,2,4`` or ``[1,2,4]``), each item ``parse(key, item)`` (``integer`` or ``number``
    with their bounds); a bad item names the whole value and ``allowed``."""
    try:
        return [parse(key, item) for item in items(value)]
    except SystemExit:
        bad_value(key, value, allowed)


def eval_lengths(cfg, example_multipliers: str) -> dict:
    """``multipliers=`` and ``lengths=`` given together replace the run's eval lengths: both checked,
    at least one length in all (an empty dict when neither is given)."""
    if not given(cfg, "multipliers") and not given(cfg, "lengths"):
        return {}
    options = {"multipliers": numbers("multipliers", cfg.multipliers if given(cfg, "multipliers") else [],
                                      lambda k, v: number(k, v, above=0),
                                      f"positive numbers, e.g. {example_multipliers}"),
               "lengths": numbers("lengths", cfg.lengths if given(cfg, "lengths") else [],
                                  lambda k, v: integer(k, v, minimum=1), "positive integers, e.g. 300,1000")}
    if not options["multipliers"] + options["lengths"]:
        bad_value("multipliers", cfg.get("multipliers"), "at least one eval length (or lengths=...)")
    return options


def rope_scaling_options(cfg) -> dict:
    """``rope_scaling=`` (the plain model always scored beside them) and ``rope_scaling_factor=``."""
    from model.pe.rope_scaling import ROPE_SCALINGS

    options: dict = {}
    if given(cfg, "rope_scaling"):
        options["rope_scaling"] = [None] + [choice("rope_scaling", s, ROPE_SCALINGS)
                                            for s in items(cfg.rope_scaling) if not is_null(s)]
    if given(cfg, "rope_scaling_factor"):
        value = cfg.rope_scaling_factor
        options["rope_scaling_factor"] = None if is_null(value) else number(
            "rope_scaling_factor", value, minimum=1, allowed="a finite number >= 1, or null (eval length / training "
                                                            "length)")
    return options


def flag(key: str, value) -> bool:
    """true or false (also as text: bench's comma-separated ``compile=false,true``)."""
    word = str(value).strip().lower()
    if word not in ("true", "false", "1", "0", "yes", "no"):
        bad_value(key, value, "true or false")
    return word in ("true", "1", "yes")


def choice(key: str, value, choices) -> str:
    if str(value) not in choices:
        bad_value(key, value, "one of " + ", ".join(choices))
    return str(value)


def device_arg(value):
    """``device=``: cpu, cuda or cuda:N (a GPU this machine has); None: cuda when available."""
    import torch

    if value is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    value, allowed = str(value), "cpu, cuda or cuda:N"
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        bad_value("device", value, allowed)
    if device.type not in ("cpu", "cuda"):
        bad_value("device", value, allowed)
    if device.type == "cuda" and not torch.cuda.is_available():
        bad_value("device", value, f"cpu: torch {torch.__version__} sees no CUDA GPU on this machine")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        bad_value("device", value, f"cpu, cuda or cuda:N with N < {torch.cuda.device_count()} (the GPUs here)")
    return device


# trainer.precision values the evaluation scripts run (evaluation/sweep.py autocast): autocast
# for the 16-bit ones, float32 otherwise. float64 is not one: the model's weights stay float32.
EVAL_PRECISIONS = ("bf16-mixed", "16-mixed", "32-true", "32")


def precision_ran(precision, device) -> str:
    """What an evaluation at ``precision`` computes in, for the results' title: e.g.
    ``bf16-mixed (bfloat16 autocast)``, ``32 (float32)``."""
    import torch

    from evaluation.sweep import autocast

    context = autocast(precision, device)
    dtype = str(context.fast_dtype).removeprefix("torch.") + " autocast" if isinstance(context, torch.autocast) \
        else "float32"
    return f"{precision} ({dtype})"
