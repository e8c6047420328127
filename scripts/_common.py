"""Helpers shared by the scripts: import path, key=value arguments, run configs."""

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


def describe_options(allowed: dict[str, str]) -> str:
    return "\n".join(f"  {k:20s} {help}" for k, help in allowed.items())


def parse_key_values(argv: list[str], allowed: dict[str, str]) -> dict[str, str]:
    """``key=value`` arguments (Hydra style); unknown keys fail with the list of valid ones."""
    values = {}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep:
            raise SystemExit(f"expected key=value, got {arg!r}; keys: {', '.join(allowed)}")
        if key not in allowed:
            raise SystemExit(f"unknown option {key!r}; valid options:\n{describe_options(allowed)}")
        values[key] = value
    return values


def checkpoint_arg(args: dict[str, str], allowed: dict[str, str]) -> Path:
    """The required ``ckpt=PATH``, checked to be a readable pelab checkpoint (not truncated, not a
    foreign file) before any data is read; load it with ``pelab.checkpoint.load_lit_gpt``."""
    if "ckpt" not in args:
        raise SystemExit(f"ckpt=PATH is required; options:\n{describe_options(allowed)}")
    from pelab.checkpoint import CheckpointError, read_checkpoint

    ckpt = Path(args["ckpt"])
    try:
        read_checkpoint(ckpt, key="ckpt")
    except CheckpointError as e:
        raise SystemExit(str(e)) from None
    return ckpt


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

    from evaluation.registry import PROBES, enabled_probes
    from pelab.checkpoint import load_lit_gpt
    from pelab.datamodule import build_datamodule
    from pelab.evaluate import run_evaluations, subject_of

    datamodule = build_datamodule(cfg.data)  # reads nothing yet
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
        if rank_zero:
            datamodule.prepare_data()
        if distributed:
            torch.distributed.barrier()  # the other ranks read the cache rank zero prepared
        datamodule.setup("validate")
    stamp = time.strftime("%Y%m%d-%H%M%S")

    def where(probe) -> Path:
        return Path(out) if out else ckpt.parent.parent / probe.output / f"eval-{ckpt.stem}-{stamp}"

    def note(config) -> str | None:
        return f"precision={precision_ran(config.precision, device)}" if hasattr(config, "precision") else None

    subject = subject_of(module, datamodule, distributed=distributed, rank_zero=rank_zero, seed=seed)
    outcomes = run_evaluations(subject, options, where, rank_zero=rank_zero, note=note)
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


def split_list(value: str) -> list[str]:
    return [v.strip() for v in value.strip("[]").split(",") if v.strip()]


# --- option values -------------------------------------------------------------------------------
# Every script parses its key=value options with these, before any checkpoint or data is read:
# a bad value ends in one line naming the option, the value given and what is allowed.

def bad_value(key: str, value: str, allowed: str):
    raise SystemExit(f"{key}={value!r} is not valid: expected {allowed}")


def is_null(value: str) -> bool:
    return value.strip().lower() in ("null", "none")


def integer(key: str, value: str, minimum: int | None = None, allowed: str | None = None) -> int:
    """``value`` as an int (>= ``minimum``)."""
    allowed = allowed or ("an integer" if minimum is None else f"an integer >= {minimum}")
    try:
        number = int(value)
    except ValueError:
        bad_value(key, value, allowed)
    if minimum is not None and number < minimum:
        bad_value(key, value, allowed)
    return number


def number(key: str, value: str, minimum: float | None = None, maximum: float | None = None,
           above: float | None = None, allowed: str | None = None) -> float:
    """``value`` as a finite float, >= ``minimum``, <= ``maximum``, > ``above`` where given."""
    bounds = [f">= {minimum:g}" if minimum is not None else "", f"> {above:g}" if above is not None else "",
              f"<= {maximum:g}" if maximum is not None else ""]
    allowed = allowed or " and ".join(["a finite number", *filter(None, bounds)]).replace(" and ", " ", 1)
    try:
        x = float(value)
    except ValueError:
        bad_value(key, value, allowed)
    if not (math.isfinite(x) and (minimum is None or x >= minimum) and (maximum is None or x <= maximum)
            and (above is None or x > above)):
        bad_value(key, value, allowed)
    return x


def numbers(key: str, value: str, parse, allowed: str) -> list:
    """A comma-separated list (``1,2,4`` or ``[1,2,4]``), each item ``parse(key, item)`` (``integer``
    or ``number`` with their bounds); a bad item names the whole value and ``allowed``."""
    try:
        return [parse(key, item) for item in split_list(value)]
    except SystemExit:
        bad_value(key, value, allowed)


def eval_lengths(args: dict[str, str], example_multipliers: str) -> dict:
    """``multipliers=`` and ``lengths=`` given together replace the run's eval lengths: both parsed,
    at least one length in all (an empty dict when neither is given)."""
    if "multipliers" not in args and "lengths" not in args:
        return {}
    options = {"multipliers": numbers("multipliers", args.get("multipliers", ""), lambda k, v: number(k, v, above=0),
                                      f"positive numbers, e.g. {example_multipliers}"),
               "lengths": numbers("lengths", args.get("lengths", ""), lambda k, v: integer(k, v, minimum=1),
                                  "positive integers, e.g. 300,1000")}
    if not options["multipliers"] + options["lengths"]:
        bad_value("multipliers", args.get("multipliers", ""), "at least one eval length (or lengths=...)")
    return options


ROPE_SCALING_HELP = {
    "rope_scaling": "linear, ntk, dynamic_ntk, yarn and/or llama3 (rotary schemes take all, alibi linear; evaluated "
                    "next to the plain model; refused for a model trained with pe.scaling)",
    "rope_scaling_factor": "fixed scaling factor (default: eval length / training length)",
}


def rope_scaling_options(args: dict[str, str]) -> dict:
    """``rope_scaling=`` (the plain model always scored beside them) and ``rope_scaling_factor=``."""
    from model.pe.rope_scaling import ROPE_SCALINGS

    options: dict = {}
    if "rope_scaling" in args:
        options["rope_scaling"] = [None] + [choice("rope_scaling", s, ROPE_SCALINGS)
                                            for s in split_list(args["rope_scaling"]) if s.lower() != "none"]
    if "rope_scaling_factor" in args:
        value = args["rope_scaling_factor"]
        options["rope_scaling_factor"] = None if is_null(value) else number(
            "rope_scaling_factor", value, minimum=1, allowed="a finite number >= 1, or null (eval length / training "
                                                            "length)")
    return options


def flag(key: str, value: str) -> bool:
    word = value.strip().lower()
    if word not in ("true", "false", "1", "0", "yes", "no"):
        bad_value(key, value, "true or false")
    return word in ("true", "1", "yes")


def choice(key: str, value: str, choices) -> str:
    if value not in choices:
        bad_value(key, value, "one of " + ", ".join(choices))
    return value


def device_arg(value: str | None):
    """``device=``: cpu, cuda or cuda:N (a GPU this machine has); None: cuda when available."""
    import torch

    if value is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    allowed = "cpu, cuda or cuda:N"
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
