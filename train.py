"""pelab training entry point: compose -> validate -> instantiate -> fit -> report.

    python train.py                                  # tiny model, RoPE, embedded corpus
    python train.py pe=alibi model=small trainer.max_steps=2000
    python train.py -m pe=learned,sinusoidal,rope,alibi,xpos,rope_alibi experiment=pe_ablation
"""

from __future__ import annotations

import math
import netrc
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict


# Overrides that do not change what is trained stay out of run names.
NOT_IN_NAME = ("pe", "experiment", "hydra.", "logger", "trainer.enable_", "trainer.devices", "data.num_workers",
               "ckpt_path")


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
        overrides = [o for o in hc.overrides.task if not o.split("=")[0].lstrip("+~").startswith(NOT_IN_NAME)]
        if hc.mode == RunMode.MULTIRUN:
            sweep = "_".join(Path(hc.sweep.dir).parts[-2:])  # DATE_TIME of the default sweep dir
    scheme = choices.get("pe") or cfg.pe._target_.rsplit(".", 1)[-1]
    name = cfg.run_name or "-".join([scheme, ",".join(overrides)]).rstrip("-")[:128]
    group = cfg.group or (f"{choices.get('experiment') or 'sweep'}-{sweep}" if sweep else None)
    tags = [f"pe:{scheme}"] + [f"{k}:{choices[k]}" for k in ("model", "data") if k in choices]
    tags += [t for t in cfg.tags if t not in tags]
    return RunIdentity(name=name, group=group, tags=tags, choices={"pe": scheme, **choices})


def validate_config(cfg: DictConfig) -> None:
    """Fail early, with the bad value and the valid range, before data or compute is spent."""
    from model.config import GPTConfig
    from model.lit import OptimConfig

    model_cfg = GPTConfig(**{"vocab_size": 1, **OmegaConf.to_container(cfg.model, resolve=True)})
    OptimConfig(**OmegaConf.to_container(cfg.optim, resolve=True))
    pe = hydra.utils.instantiate(cfg.pe, _partial_=True)(model_cfg)
    if pe.max_positions is not None and model_cfg.block_size > pe.max_positions:
        raise ValueError(
            f"model.block_size={model_cfg.block_size} exceeds the {pe.max_positions} positions of "
            f"pe={pe.name}; raise pe.max_positions or lower model.block_size"
        )
    if cfg.get("eval") and cfg.eval.extrapolation.enabled:
        from evaluation.extrapolation import ExtrapolationConfig

        ExtrapolationConfig.from_dict(OmegaConf.to_container(cfg.eval.extrapolation, resolve=True))
    max_steps = cfg.trainer.get("max_steps", -1)
    if (max_steps is None or max_steps <= 0) and not cfg.optim.get("decay_steps"):
        raise ValueError(f"trainer.max_steps must be > 0 (got {max_steps}): it sets the LR schedule's length")
    if cfg.ckpt_path and not Path(cfg.ckpt_path).is_file():
        raise FileNotFoundError(f"ckpt_path={cfg.ckpt_path} does not exist")


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
    loggers = []
    for key, logger_cfg in (cfg.get("logger") or {}).items():
        if logger_cfg is None or "_target_" not in logger_cfg:
            continue
        extra = {}
        if logger_cfg._target_.endswith("WandbLogger"):
            extra = {"name": identity.name, "group": identity.group, "tags": identity.tags}
            mode = os.environ.get("WANDB_MODE", "")
            if mode not in ("offline", "disabled") and not logger_cfg.get("offline"):
                why = wandb_offline_reason()
                if why:
                    print(f"[pelab] {why}: logging to W&B in offline mode", flush=True)
                    extra["offline"] = True
            os.environ.setdefault("WANDB_SILENT", "true")
            Path(logger_cfg.save_dir).mkdir(parents=True, exist_ok=True)
        loggers.append(hydra.utils.instantiate(logger_cfg, **extra))
    return loggers


def finish_loggers(loggers: list) -> list[str]:
    """Close the W&B run and say where an offline run lives and how to upload it."""
    lines = []
    for logger in loggers:
        if type(logger).__name__ != "WandbLogger":
            logger.save()  # flush what was logged after fit (extrapolation, unigram baseline)
            lines.append(f"[pelab] {type(logger).__name__}: {logger.log_dir}")
            continue
        import wandb

        run = logger.experiment
        run_dir = Path(run.dir).parent
        offline = run.settings._offline
        wandb.finish()
        if offline:
            lines.append(f"[pelab] W&B offline run: {run_dir}  (upload later: wandb sync {run_dir})")
        else:
            lines.append(f"[pelab] W&B run: {run.url}")
    return lines


def build_callbacks(cfg: DictConfig) -> list:
    return [hydra.utils.instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c and "_target_" in c]


def run_extrapolation(cfg: DictConfig, module, datamodule, loggers: list, output_dir: Path, step: int) -> list:
    """The extrapolation table of the trained model: CSV/PNG/markdown on disk, W&B table and chart."""
    from data.datamodule import load_tokens
    from evaluation.extrapolation import ExtrapolationConfig, evaluate_extrapolation, log_to_wandb, save_results

    options = OmegaConf.to_container(cfg.eval.extrapolation, resolve=True)
    config = ExtrapolationConfig.from_dict(options)
    tokens = load_tokens(datamodule.split_path("val"), datamodule.meta["dtype"])
    rows = evaluate_extrapolation(module.model, tokens, cfg.model.block_size, config)
    paths = save_results(rows, output_dir / "extrapolation", title=f"pe={module.pe_name}, trained at {cfg.model.block_size}")
    for logger in loggers:
        if type(logger).__name__ == "WandbLogger":
            log_to_wandb(rows, logger.experiment, png=paths["png"])
        else:
            logger.log_metrics({f"extrapolation/{r.mode}/{r.rope_scaling}/ppl@{r.eval_length}": r.ppl
                                for r in rows if r.ok}, step=step)
    print(f"[pelab] extrapolation table: {paths['csv']} (+ .png, .md)", flush=True)
    return rows


def train(cfg: DictConfig) -> float | None:
    import warnings

    import lightning as L
    import torch

    # config.yaml is written into the checkpoint dir on purpose, before the first checkpoint.
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")

    from model.lit import LitGPT

    validate_config(cfg)
    identity = describe_run(cfg)
    output_dir = Path(cfg.paths.output_dir)
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

    resolved = OmegaConf.to_container(cfg, resolve=True)
    if trainer.is_global_zero:
        ckpt_dir = output_dir / "checkpoints"
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(OmegaConf.create(resolved), ckpt_dir / "config.yaml")  # resolved, next to checkpoints
    for logger in loggers:
        logger.log_hyperparams({"config": resolved, **identity.as_dict()})

    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    except BaseException:
        if any(type(logger).__name__ == "WandbLogger" for logger in loggers):
            import wandb

            wandb.finish(exit_code=1)  # the next job of a sweep must not log into this run
        raise

    val_loss = trainer.callback_metrics.get("val/loss")
    val_loss = float(val_loss) if val_loss is not None else None
    if trainer.is_global_zero:
        if cfg.eval.extrapolation.enabled:
            run_extrapolation(cfg, module, datamodule, loggers, output_dir, trainer.global_step)
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
