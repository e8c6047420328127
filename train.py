"""pelab training entry point: compose -> validate -> instantiate -> fit -> report.

    python train.py                                  # tiny model, RoPE, embedded corpus
    python train.py pe=alibi model=small trainer.max_steps=2000
    python train.py -m pe=learned,sinusoidal,rope,alibi,xpos,rope_alibi experiment=pe_ablation
"""

from __future__ import annotations

import math
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict

from pelab.batch import accumulation_for, describe_batch
from pelab.hydra_callbacks import check_writable_dir
from pelab.run import build_loggers, describe_run, finish_loggers, save_run_id, wandb_run_id  # also registers the run_slug resolver
from pelab.redact import redact


def validate_config(cfg: DictConfig) -> None:
    """Fail early, naming the key, the bad value and what is allowed, before data or compute
    is spent. Types come from the consumers' annotations (pelab/config.py), ranges and
    combinations are checked here and in GPTConfig, OptimConfig and the schemes."""
    import lightning as L
    from hydra.utils import get_class

    from data.tokenizers import TOKENIZERS
    from evaluation.extrapolation import ExtrapolationConfig
    from model.config import GPTConfig
    from pelab.optim import OptimConfig
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
    if data.pop("tokens_per_step", None) is not None and cfg.trainer.get("accumulate_grad_batches", 1) != 1:
        raise ConfigError(f"data.tokens_per_step={cfg.data.tokens_per_step} and trainer.accumulate_grad_batches="
                          f"{cfg.trainer.accumulate_grad_batches} both given: tokens_per_step sets the accumulation; "
                          f"keep one of them")
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
    if cfg.ckpt_path:  # readable, a pelab checkpoint, of this run's scheme and model (pelab/checkpoint.py)
        from pelab.checkpoint import check_resume
        check_resume(cfg.ckpt_path, cfg)


def build_callbacks(cfg: DictConfig) -> list:
    return [hydra.utils.instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c and "_target_" in c]


def resume_from_run_dir(cfg: DictConfig, output_dir: Path) -> bool:
    """``resume=auto``: set ``ckpt_path`` to the newest checkpoint of the run dir and say so
    (True), or start fresh when the dir has none (a first start and a restart are one command)."""
    from pelab.checkpoint import newest_checkpoint
    from pelab.config import ConfigError, fail

    resume = cfg.get("resume")
    if resume is None:
        return False
    if resume != "auto":
        fail("resume", resume, "null or auto")
    if cfg.ckpt_path:
        raise ConfigError(f"resume=auto and ckpt_path={cfg.ckpt_path} both given: resume=auto picks the newest "
                          f"checkpoint of the run dir itself; keep one of them")
    newest = newest_checkpoint(output_dir)
    if newest is None:
        print(f"[pelab] resume=auto: no checkpoint in {output_dir}, starting fresh", flush=True)
        return False
    cfg.ckpt_path = str(newest)
    print(f"[pelab] resume=auto: continuing from {newest}", flush=True)
    return True


def train(cfg: DictConfig) -> float | None:
    import warnings

    import lightning as L
    import torch

    # config.yaml is written into the checkpoint dir on purpose, before the first checkpoint.
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")

    from data.datamodule import build_datamodule
    from pelab.lit import LitGPT
    from pelab.loggers import SafeWandbLogger

    output_dir = Path(cfg.paths.output_dir)
    resuming = resume_from_run_dir(cfg, output_dir)
    validate_config(cfg)
    identity = describe_run(cfg)
    check_writable_dir(output_dir)  # Hydra checked its run dir; paths.output_dir may point elsewhere
    with open_dict(cfg):  # record how the run appears on W&B in its saved config
        cfg.run_name, cfg.group, cfg.tags = identity.name, identity.group, identity.tags

    L.seed_everything(cfg.seed, workers=True)
    if torch.cuda.is_available():
        torch.set_float32_matmul_precision("high")

    datamodule = build_datamodule(cfg.data)
    with open_dict(cfg):
        cfg.model.vocab_size = datamodule.vocab_size
    module = LitGPT(model=cfg.model, pe=cfg.pe, optim=cfg.optim, compile=cfg.compile)

    run_id = wandb_run_id(output_dir, resuming)
    loggers = build_loggers(cfg, identity, run_id)
    trainer = hydra.utils.instantiate(cfg.trainer, logger=loggers or False, callbacks=build_callbacks(cfg))
    if cfg.data.get("tokens_per_step") is not None:
        trainer.accumulate_grad_batches = accumulation_for(cfg.data.tokens_per_step, cfg.data.batch_size,
                                                           cfg.model.block_size, trainer.num_devices, trainer.num_nodes)
        with open_dict(cfg):
            cfg.trainer.accumulate_grad_batches = trainer.accumulate_grad_batches  # saved as it ran
    if trainer.is_global_zero:
        print(describe_batch(cfg.data.batch_size, cfg.model.block_size, trainer.num_devices, trainer.num_nodes,
                             trainer.accumulate_grad_batches), flush=True)

    resolved = redact(OmegaConf.to_container(cfg, resolve=True))  # saved and logged: no secrets
    if trainer.is_global_zero:
        ckpt_dir = output_dir / "checkpoints"
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(OmegaConf.create(resolved), ckpt_dir / "config.yaml")  # resolved, next to checkpoints
        save_run_id(output_dir, run_id)  # a restart with resume=auto continues this W&B run
    for logger in loggers:
        logger.log_hyperparams({"config": resolved, **identity.as_dict()})

    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    except BaseException:
        for logger in loggers:
            if isinstance(logger, SafeWandbLogger):
                logger.finish(exit_code=1)  # the next job of a sweep must not log into this run
        raise

    metrics = trainer.callback_metrics
    val_loss = float(metrics["val/loss"]) if "val/loss" in metrics else None
    if trainer.is_global_zero:
        lines = [f"[pelab] run {identity.name!r} finished at step {trainer.global_step}"]
        if val_loss is not None:
            line = f"[pelab] val loss {val_loss:.4f} (ppl {math.exp(val_loss):.2f})"
            if "val/unigram_loss" in metrics:  # evaluation/end_of_training.py
                baseline = float(metrics["val/unigram_loss"])
                line += f"; unigram baseline {baseline:.4f} (ppl {math.exp(baseline):.2f})"
            lines.append(line)
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
