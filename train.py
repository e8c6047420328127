"""pelab training entry point: compose -> validate -> instantiate -> fit -> report.

    python train.py                                  # tiny model, RoPE, embedded corpus
    python train.py pe=alibi model=small trainer.max_steps=2000
    python train.py -m pe=learned,sinusoidal,rope,alibi,xpos,rope_alibi experiment=pe_ablation
"""

from __future__ import annotations

import math
import netrc
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from pelab.hydra_callbacks import check_writable_dir
from pelab.redact import redact


# Overrides that do not change what is trained stay out of run names and sweep subdirs: an
# exact key, or a whole group given with its dot ("logger."). Never a bare prefix: "pe" is
# the scheme choice only (it leads the name), "pe.base=100" does change the model.
NOT_IN_NAME = (
    "pe", "logger", "logger.", "hydra.", "paths.", "callbacks", "callbacks.", "eval", "eval.",
    "trainer.accelerator", "trainer.devices", "trainer.num_nodes", "trainer.strategy",
    "trainer.enable_progress_bar", "trainer.enable_model_summary", "trainer.enable_checkpointing",
    "trainer.log_every_n_steps", "trainer.val_check_interval", "trainer.limit_val_batches",
    "trainer.num_sanity_val_steps", "data.num_workers", "data.data_dir", "data.tokenize_num_proc",
    "data.val_batch_size", "ckpt_path", "compile", "run_name", "group", "tags", "project",
)
NAME_LIMIT = 128


def name_overrides(overrides) -> list[str]:
    """The command-line overrides that change what is trained, as typed (never a secret)."""
    from pelab.redact import looks_secret, redact_text

    groups = tuple(k for k in NOT_IN_NAME if k.endswith("."))
    kept = []
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key not in NOT_IN_NAME and not key.startswith(groups) and not looks_secret(key):
            kept.append(redact_text(override))
    return kept


def _bounded(text: str) -> str:
    """At most NAME_LIMIT characters; a longer text is cut and keeps a hash of the whole, so
    runs differing only past the cut still get different names."""
    if len(text) <= NAME_LIMIT:
        return text
    import hashlib

    return f"{text[:NAME_LIMIT - 9]}-{hashlib.sha1(text.encode()).hexdigest()[:8]}"  # "-": valid in a dir override


def run_slug(scheme: str, overrides) -> str:
    """The run name as a sweep subdir: one path component that is also a plain Hydra override
    value (Lightning's DDP launcher passes it back as hydra.run.dir=DIR), so '=' -> '_',
    ',' between overrides -> '+', anything else outside [A-Za-z0-9._+-] -> '_'.
    Used by conf/hydra/default.yaml as ${pelab.run_slug:SCHEME,${hydra.overrides.task}}."""
    items = [re.sub(r"[^A-Za-z0-9._+-]", "_", o) for o in name_overrides(overrides)]
    return _bounded("-".join([scheme, "+".join(items)]).rstrip("-"))


OmegaConf.register_new_resolver("pelab.run_slug", run_slug, replace=True)


@dataclass
class RunIdentity:
    """How a run shows up on W&B: one group per sweep/experiment, one named run per scheme."""

    name: str
    group: str | None
    tags: list[str]
    choices: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"run_name": self.name, "group": self.group, "tags": self.tags, "choices": self.choices}


def describe_run(cfg: DictConfig) -> RunIdentity:
    choices: dict[str, str] = {}
    overrides: list[str] = []
    sweep = None
    if HydraConfig.initialized():
        hc = HydraConfig.get()
        choices = {k: str(v) for k, v in hc.runtime.choices.items() if v is not None and not k.startswith("hydra")}
        overrides = name_overrides(hc.overrides.task)
        if hc.mode == RunMode.MULTIRUN:
            sweep = "_".join(Path(hc.sweep.dir).parts[-2:])  # DATE_TIME of the default sweep dir
    scheme = choices.get("pe") or cfg.pe._target_.rsplit(".", 1)[-1]
    name = cfg.run_name or _bounded("-".join([scheme, ",".join(overrides)]).rstrip("-"))
    group = cfg.group or (f"{choices.get('experiment') or 'sweep'}-{sweep}" if sweep else None)
    tags = [f"pe:{scheme}"] + [f"{k}:{choices[k]}" for k in ("model", "data") if k in choices]
    tags += [t for t in cfg.tags if t not in tags]
    return RunIdentity(name=name, group=group, tags=tags, choices={"pe": scheme, **choices})


def validate_config(cfg: DictConfig) -> None:
    """Fail early, naming the key, the bad value and what is allowed, before data or compute
    is spent. Types come from the consumers' annotations (pelab/config.py), ranges and
    combinations are checked here and in GPTConfig, OptimConfig and the schemes."""
    import lightning as L
    from hydra.utils import get_class

    from data.tokenizers import TOKENIZERS
    from evaluation.extrapolation import ExtrapolationConfig
    from model.config import GPTConfig
    from model.lit import OptimConfig
    from model.pe.schedule import check_randomize_to, nope_layers, split_schedule
    from pelab.config import ConfigError, check_options, describe, fail, matches, require

    def plain(node) -> dict:
        return OmegaConf.to_container(node, resolve=True)

    def target(section: str, values: dict):
        try:
            return get_class(values["_target_"])
        except Exception as err:  # noqa: BLE001 - a missing or unimportable _target_
            raise ConfigError(f"{section}._target_={values.get('_target_')!r} is not an importable class: "
                              f"{err}") from None

    def build(section: str, fn, *args, **kwargs):
        """Run a constructor's own checks; its ValueError becomes a ConfigError (clean CLI message)
        that names the section."""
        try:
            return fn(*args, **kwargs)
        except ConfigError:
            raise
        except ValueError as err:
            raise ConfigError(str(err) if str(err).startswith(section) else f"{section}: {err}") from None

    top = {"seed": int, "compile": bool, "project": str, "run_name": str | None, "group": str | None,
           "tags": list[str]}
    for key, hint in top.items():
        value = cfg.get(key)
        value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        if key in cfg and not matches(value, hint):
            fail(key, value, describe(hint))

    model_values = plain(cfg.model)
    check_options("model", model_values, GPTConfig)  # unknown keys before GPTConfig(**) sees them
    model = GPTConfig(**{"vocab_size": 1, **model_values})

    optim_values = plain(cfg.optim)
    check_options("optim", optim_values, OptimConfig)
    optim = OptimConfig(**optim_values)

    pe_values, schedule = split_schedule(plain(cfg.pe))
    check_options("pe", pe_values, target("pe", pe_values), ignore=("config",))
    pe = build("pe", hydra.utils.instantiate(pe_values, _partial_=True), model)
    build("pe", check_randomize_to, schedule.get("randomize_to"), model.block_size, pe.max_positions)
    if build("pe", nope_layers, model.n_layer, schedule.get("nope_every")) and not (pe.uses_rotate or pe.uses_bias):
        raise ConfigError(f"pe.nope_every={schedule['nope_every']} needs a scheme that acts inside attention "
                          f"(rotation or bias); pe={pe.name} only adds to the embeddings")
    if pe.max_positions is not None and model.block_size > pe.max_positions:
        raise ConfigError(
            f"model.block_size={model.block_size} exceeds the {pe.max_positions} positions of "
            f"pe={pe.name}; raise pe.max_positions or lower model.block_size"
        )

    data = plain(cfg.data)
    corpus = data.pop("corpus", None)
    check_options("data", data, target("data", data))
    if isinstance(corpus, dict):
        corpus_class = target("data.corpus", corpus)
        check_options("data.corpus", corpus, corpus_class)
        build("data.corpus", corpus_class, **{k: v for k, v in corpus.items() if not k.startswith("_")})
    for key, low in (("batch_size", 1), ("val_batch_size", 1), ("val_windows", 1), ("num_workers", 0),
                     ("tokenize_num_proc", 1)):
        if data.get(key) is not None:
            require(data[key] >= low, f"data.{key}", data[key], f">= {low}")
    if "tokenizer" in data:
        require(data["tokenizer"] in TOKENIZERS, "data.tokenizer", data["tokenizer"], f"one of {', '.join(TOKENIZERS)}")
    if "block_size" in data:
        require(data["block_size"] == model.block_size, "data.block_size", data["block_size"],
                f"model.block_size={model.block_size} (set model.block_size; data follows it)")

    trainer = plain(cfg.trainer)
    check_options("trainer", trainer, L.Trainer)
    max_steps = trainer.get("max_steps", -1)
    if not (max_steps > 0 or (max_steps == -1 and optim.decay_steps)):
        fail("trainer.max_steps", max_steps, "> 0 (it sets the LR schedule's length; -1 only with optim.decay_steps)")
    devices = trainer.get("devices")
    require(devices >= 1 or devices == -1 if isinstance(devices, int) else
            not isinstance(devices, str) or re.fullmatch(r"auto|-1|\d+|(\d+,)+\d*", devices.replace(" ", "")),
            "trainer.devices", devices, "an integer >= 1, -1 (all), 'auto', or device ids as a list or '0,1'")
    for key in ("accumulate_grad_batches", "log_every_n_steps", "num_nodes"):
        if trainer.get(key) is not None:
            require(trainer[key] >= 1, f"trainer.{key}", trainer[key], ">= 1")
    for key in ("gradient_clip_val", "limit_val_batches"):
        if trainer.get(key) is not None:
            require(trainer[key] >= 0, f"trainer.{key}", trainer[key], ">= 0 or null")
    interval = trainer.get("val_check_interval")
    if isinstance(interval, (int, float)):
        require(interval > 0, "trainer.val_check_interval", interval, "> 0 (steps, or a fraction of an epoch)")

    extrapolation = plain(cfg.eval.extrapolation) if cfg.get("eval") else {}
    enabled = extrapolation.pop("enabled", False)
    require(isinstance(enabled, bool), "eval.extrapolation.enabled", enabled, "true or false")
    held_out_text = getattr(target("data", data), "held_out_text", True)
    if enabled and not held_out_text:
        raise ConfigError(f"eval.extrapolation.enabled=true needs held-out text, and data={data['_target_']} "
                          f"(a synthetic task) has none: set eval.extrapolation.enabled=false (accuracy vs "
                          f"length runs from eval.tasks)")
    tasks = plain(cfg.eval.tasks) if cfg.get("eval") and cfg.eval.get("tasks") else {}
    if tasks.pop("enabled", False):
        if held_out_text:
            raise ConfigError("eval.tasks.enabled=true needs a synthetic task: data=synthetic data.task=...")
        from evaluation.tasks import TaskEvalConfig

        build("eval.tasks", TaskEvalConfig.from_dict, {"precision": str(cfg.trainer.precision), **tasks})
    if enabled:
        # precision mirrors trainer.precision (checked above), which may be an int
        check_options("eval.extrapolation", extrapolation, ExtrapolationConfig, ignore=("precision",))
        for key in ("stride", "max_tokens", "tokens_per_batch", "q_chunk"):
            if extrapolation.get(key) is not None:
                require(extrapolation[key] >= 1, f"eval.extrapolation.{key}", extrapolation[key], ">= 1")
        build("eval.extrapolation", ExtrapolationConfig.from_dict, extrapolation)
    if cfg.ckpt_path:  # readable, a pelab checkpoint, of this run's scheme and model (model/checkpoint.py)
        from model.checkpoint import check_resume
        check_resume(cfg.ckpt_path, cfg)


def wandb_reachable(timeout: float = 3.0) -> bool:
    url = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def wandb_has_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_offline_reason() -> str | None:
    """Why a W&B run cannot go online from here (no credentials, no route), or None."""
    if not wandb_has_credentials():
        return "no W&B credentials (WANDB_API_KEY or `wandb login`)"
    if not wandb_reachable():
        return "W&B server unreachable"
    return None


def build_loggers(cfg: DictConfig, identity: RunIdentity) -> list:
    from lightning.pytorch.loggers import WandbLogger

    loggers = []
    for key, logger_cfg in (cfg.get("logger") or {}).items():
        if logger_cfg is None or "_target_" not in logger_cfg:
            continue
        extra = {}
        if issubclass(hydra.utils.get_class(logger_cfg._target_), WandbLogger):
            extra = {"name": identity.name, "group": identity.group, "tags": identity.tags}
            mode = os.environ.get("WANDB_MODE", "")
            if mode not in ("offline", "disabled") and not logger_cfg.get("offline"):
                why = wandb_offline_reason()
                if why:
                    print(f"[pelab] {why}: logging to W&B in offline mode", flush=True)
                    extra["offline"] = True
            os.environ.setdefault("WANDB_SILENT", "true")
        loggers.append(hydra.utils.instantiate(logger_cfg, **extra))
    return loggers


def finish_loggers(loggers: list) -> list[str]:
    """Flush file loggers and close the W&B run, saying where each went."""
    from lightning.pytorch.loggers import WandbLogger

    from pelab.loggers import SafeWandbLogger

    lines = []
    for logger in loggers:
        if isinstance(logger, SafeWandbLogger):
            lines.append(logger.finish())
        elif isinstance(logger, WandbLogger):  # Lightning's own, if configured
            logger.experiment.finish()
        else:
            logger.save()  # flush what was logged after fit (extrapolation, unigram baseline)
            lines.append(f"[pelab] {type(logger).__name__}: {getattr(logger, 'log_dir', None) or logger.save_dir}")
    return [line for line in lines if line]


def build_callbacks(cfg: DictConfig) -> list:
    return [hydra.utils.instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c and "_target_" in c]


def run_extrapolation(cfg: DictConfig, module, datamodule, loggers: list, output_dir: Path, step: int) -> list:
    """The extrapolation table of the trained model: CSV/PNG/markdown on disk, W&B table and chart."""
    from data.datamodule import load_tokens
    from evaluation.extrapolation import ExtrapolationConfig, evaluate_extrapolation, log_to_wandb, save_results
    from pelab.loggers import log_results

    options = OmegaConf.to_container(cfg.eval.extrapolation, resolve=True)
    config = ExtrapolationConfig.from_dict(options)
    tokens = load_tokens(datamodule.split_path("val"), datamodule.meta["dtype"])
    rows = evaluate_extrapolation(module.model, tokens, cfg.model.block_size, config)
    paths = save_results(rows, output_dir / "extrapolation", title=f"pe={module.pe_name}, trained at {cfg.model.block_size}")
    log_results(loggers, log_to_wandb, rows, paths["png"],
                {f"extrapolation/{r.mode}/{r.rope_scaling}/ppl@{r.eval_length}": r.ppl for r in rows if r.ok}, step)
    print(f"[pelab] extrapolation table: {paths['csv']} (+ .png, .md)", flush=True)
    return rows


def train(cfg: DictConfig) -> float | None:
    import warnings

    import lightning as L
    import torch

    # config.yaml is written into the checkpoint dir on purpose, before the first checkpoint.
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")

    from model.lit import LitGPT
    from pelab.loggers import SafeWandbLogger

    validate_config(cfg)
    identity = describe_run(cfg)
    output_dir = Path(cfg.paths.output_dir)
    check_writable_dir(output_dir)  # Hydra checked its run dir; paths.output_dir may point elsewhere
    with open_dict(cfg):  # record how the run appears on W&B in its saved config
        cfg.run_name, cfg.group, cfg.tags = identity.name, identity.group, identity.tags

    L.seed_everything(cfg.seed, workers=True)
    if torch.cuda.is_available():
        torch.set_float32_matmul_precision("high")

    datamodule = hydra.utils.instantiate(cfg.data)
    with open_dict(cfg):
        cfg.model.vocab_size = datamodule.vocab_size
    module = LitGPT(model=cfg.model, pe=cfg.pe, optim=cfg.optim, compile=cfg.compile)

    loggers = build_loggers(cfg, identity)
    trainer = hydra.utils.instantiate(cfg.trainer, logger=loggers or False, callbacks=build_callbacks(cfg))

    resolved = redact(OmegaConf.to_container(cfg, resolve=True))  # saved and logged: no secrets
    if trainer.is_global_zero:
        ckpt_dir = output_dir / "checkpoints"
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(OmegaConf.create(resolved), ckpt_dir / "config.yaml")  # resolved, next to checkpoints
    for logger in loggers:
        logger.log_hyperparams({"config": resolved, **identity.as_dict()})

    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    except BaseException:
        for logger in loggers:
            if isinstance(logger, SafeWandbLogger):
                logger.finish(exit_code=1)  # the next job of a sweep must not log into this run
        raise

    val_loss = trainer.callback_metrics.get("val/loss")
    val_loss = float(val_loss) if val_loss is not None else None
    if trainer.is_global_zero:
        if cfg.eval.extrapolation.enabled:
            run_extrapolation(cfg, module, datamodule, loggers, output_dir, trainer.global_step)
        if cfg.eval.get("tasks") and cfg.eval.tasks.get("enabled"):
            from evaluation.tasks import run_task_evaluation

            run_task_evaluation(cfg, module, datamodule, loggers, output_dir, trainer.global_step)
        baseline = datamodule.unigram_loss()
        for logger in loggers:
            logger.log_metrics({"val/unigram_loss": baseline}, step=trainer.global_step)
        lines = [f"[pelab] run {identity.name!r} finished at step {trainer.global_step}"]
        if val_loss is not None:
            lines.append(f"[pelab] val loss {val_loss:.4f} (ppl {math.exp(val_loss):.2f}); "
                         f"unigram baseline {baseline:.4f} (ppl {math.exp(baseline):.2f})")
        lines.append(f"[pelab] outputs: {output_dir.resolve()}")
        ckpt = trainer.checkpoint_callback
        if ckpt is not None and ckpt.last_model_path:
            lines.append(f"[pelab] checkpoints: {Path(ckpt.dirpath).resolve()} (+ resolved config.yaml)")
        lines += finish_loggers(loggers)
        print("\n".join(lines), flush=True)
    return val_loss


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    return train(cfg)


if __name__ == "__main__":
    main()
