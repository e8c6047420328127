"""Every option checked before any data is read or compute spent.

A bad value fails with one line naming the key, the value and what is allowed. Unknown keys
and types come from the consumers' signatures (``check_options``); ranges are checked by the
constructors that consume them (GPTConfig, OptimConfig, the schemes, the data modules and
corpora, ExtrapolationConfig, TaskEvalConfig, the callbacks), which are built here. This
module holds the rules that tie sections together, and returns what it built so that
train.py builds nothing twice.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import hydra
import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from data.cache import check_cache_folder
from data.packing import MODES as DOCUMENT_MODES
from evaluation.extrapolation import ExtrapolationConfig
from evaluation.registry import PROBES, enabled_probes
from model.attention import AttentionRequest, resolve
from model.config import GPTConfig
from model.temperature import check_init_temperature
from model.pe.scaling import scaling_of
from pelab.checkpoint import check_init_from, check_resume, init_state
from pelab.checkpoint.mesh import check_mesh
from pelab.config import (ConfigError, build, check_options, describe, fail, matches, plain, require,
                          target_class)
from pelab.datamodule import build_datamodule, data_options
from pelab.hf_import import PREFIX as HF_PREFIX, check_hf_init
from pelab.lit import COMPUTE_DTYPES, Position, build_position, model_config, position_options
from pelab.loggers import check_log_model
from pelab.optim import OptimConfig

TOP_LEVEL = {"seed": int, "compile": bool, "init_from": str | None, "project": str, "run_name": str | None, "group": str | None,
             "tags": list[str]}
DEVICE_IDS = re.compile(r"auto|-1|\d+|(\d+,)+\d*")  # Lightning's string forms: 'auto', '-1', '2', '0,1'


@dataclass
class Checked:
    """What validation built, handed on as it is."""

    datamodule: L.LightningDataModule
    position: Position
    callbacks: list
    init_state: dict | None = None  # init_from's weights (None: none, or a resumed run's own checkpoint)


def validate_config(cfg: DictConfig) -> Checked:
    for key, need in (plain(cfg.get("requires")) or {}).items():  # an experiment's mandatory keys (drope: init_from)
        require(OmegaConf.select(cfg, key) is not None, key, OmegaConf.select(cfg, key), need)
    for key, hint in TOP_LEVEL.items():
        if key in cfg and not matches(plain(cfg.get(key)), hint):
            fail(key, plain(cfg.get(key)), describe(hint))
    # vocab_size comes from the tokenizer, loaded once the config has passed; no check depends on it
    model = model_config({"vocab_size": 1, **plain(cfg.model)})
    check_init = check_hf_init if str(cfg.get("init_from")).startswith(HF_PREFIX) else check_init_from
    init = build("init_from", check_init, cfg.init_from, cfg) if cfg.get("init_from") else None
    if init:  # ssmax's s_h are weights: both runs have them or neither
        build("model.attn_temperature", check_init_temperature, model.attn_temperature,
              init["hyper_parameters"]["model"].get("attn_temperature", "none"), cfg.init_from)
    resolve_original_length(cfg, init["hyper_parameters"]["model"]["block_size"] if init else model.block_size)
    optim_values = plain(cfg.optim)
    check_options("optim", optim_values, OptimConfig)
    optim = OptimConfig(**optim_values)
    pe = plain(cfg.pe)
    position_options(pe)  # the scheme is built last (seeded); its options are checked before any work
    datamodule = build_data(cfg, model)
    check_documents(cfg, datamodule)
    check_trainer(plain(cfg.trainer), optim)
    check_evaluation(cfg, datamodule)
    callbacks = build_callbacks(cfg)
    for name, node in (cfg.get("logger") or {}).items():
        if node and "_target_" in node:
            check_options(f"logger.{name}", plain(node), target_class(f"logger.{name}", plain(node)))
            check_log_model(f"logger.{name}.log_model", plain(node).get("log_model"), plain(cfg.trainer))
    if cfg.ckpt_path:  # readable, a pelab checkpoint, of this run's scheme and model
        build("ckpt_path", check_resume, cfg.ckpt_path, cfg)
    L.seed_everything(cfg.seed, workers=True)  # the scheme below takes its initial weights from the seed
    position = build_position(pe, model)
    check_attention(cfg, model, position, datamodule)
    # a resumed fine-tune (resume=auto) restores its own checkpoint, not the weights it started from
    state = build("init_from", init_state, init, position.scheme, cfg.init_from) if init and not cfg.ckpt_path else None
    return Checked(datamodule, position, callbacks, state)


def resolve_original_length(cfg: DictConfig, source_length: int) -> None:
    """``pe.scaling.original_length`` null = the length the weights were trained at (init_from's
    model.block_size, else this run's), written into the config so the checkpoint records it."""
    scaling = cfg.pe.get("scaling")
    if scaling is not None and not OmegaConf.is_dict(scaling):  # e.g. pe.scaling=yarn for pe.scaling.kind=yarn
        build("pe.scaling", scaling_of, plain(scaling), source_length)
    if scaling is not None and scaling.get("kind", "none") != "none" and scaling.get("original_length") is None:
        with open_dict(cfg):
            cfg.pe.scaling.original_length = source_length


def build_data(cfg: DictConfig, model: GPTConfig) -> L.LightningDataModule:
    data = data_options(cfg.data)  # a yaml of its own may still name a former _target_
    if data.pop("tokens_per_step", None) is not None and cfg.trainer.get("accumulate_grad_batches", 1) != 1:
        raise ConfigError(f"data.tokens_per_step={cfg.data.tokens_per_step} and trainer.accumulate_grad_batches="
                          f"{cfg.trainer.accumulate_grad_batches} both given: tokens_per_step sets the accumulation; "
                          f"keep one of them")
    corpus = data.get("corpus")
    check_options("data", {k: v for k, v in data.items() if k != "corpus"}, target_class("data", data))
    if isinstance(corpus, dict):
        check_options("data.corpus", corpus, target_class("data.corpus", corpus))
    if "block_size" in data:
        require(data["block_size"] == model.block_size, "data.block_size", data["block_size"],
                f"model.block_size={model.block_size} (set model.block_size; data follows it)")
    datamodule = build("data", build_datamodule, data)  # reads no data (a tokenizer file is read, as a check)
    if hasattr(datamodule, "token_dir"):  # the token cache's folder: writable, or holding a built cache
        build("data.data_dir", check_cache_folder, datamodule.token_dir, "data.data_dir", data.get("data_dir"))
    return datamodule


def training_device(accelerator) -> torch.device | None:
    """The device Lightning trains on for ``trainer.accelerator`` ("auto": CUDA where there is
    one, else MPS, else the CPU); None for another kind (Lightning checks it itself)."""
    name = {"gpu": "cuda"}.get(str(accelerator), str(accelerator))
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    return torch.device(name) if name in ("cpu", "cuda", "mps") else None


def check_attention(cfg: DictConfig, model: GPTConfig, position: Position, datamodule: L.LightningDataModule) -> None:
    """``model.attention`` resolved for the request a training step makes (``GPT.request``:
    device, compute dtype, dropout, autograd, documents, normaliser, windows): a named backend
    that refuses it (flex on a CPU, or with CoPE's terms of the scores) fails now, not at the
    first forward after the data is read."""
    trainer = plain(cfg.trainer)
    device = training_device(trainer.get("accelerator", "auto"))
    if device is None:
        return
    dtype = COMPUTE_DTYPES.get(str(trainer.get("precision", "32")).split("-")[0], torch.float32)
    request = AttentionRequest.of_model(model, position.scheme, device, dtype, training=True, grad=True,
                                        documents=bool(getattr(datamodule, "document_mask", False)))
    build("model.attention", resolve, model.attention, request)


def check_documents(cfg: DictConfig, datamodule: L.LightningDataModule) -> None:
    """Packed documents (data/packing.py): per-document positions exclude randomized ones, and
    ``eval.documents`` other than none needs document separators in the held-out text too."""
    if getattr(datamodule, "document_positions", False) and (cfg.pe.get("randomize_to") is not None):
        raise ConfigError(f"data.document_positions=true and pe.randomize_to={cfg.pe.randomize_to} both set the "
                          f"training positions; keep one of them")
    evaluation = plain(cfg.get("eval")) or {}
    mode = evaluation.get("documents")
    require(mode is None or mode in DOCUMENT_MODES, "eval.documents", mode,
            f"null (as the run trained) or one of {', '.join(DOCUMENT_MODES)}")
    modes = (evaluation.get("extrapolation") or {}).get("documents")  # may list several
    modes = [mode, *(modes if isinstance(modes, list) else [modes])]
    mode = next((m for m in modes if m not in (None, "none")), None)
    corpus = getattr(datamodule, "corpus", None)
    if mode is not None and not (getattr(datamodule, "held_out_text", True)
                                 and getattr(corpus, "rows_are_documents", True)):
        what = (f"data corpus {getattr(corpus, 'cache_name', corpus)} has none (rows_are_documents: false)"
                if corpus is not None else f"data={cfg.data._target_} (a synthetic task) has none")
        raise ConfigError(f"eval.documents={mode} needs documents separated in the token stream, and {what}; "
                          f"set eval.documents=none or null")


def check_trainer(trainer: dict, optim: OptimConfig) -> None:
    """Lightning's Trainer checks its options only when built, after the data: checked here."""
    check_options("trainer", trainer, L.Trainer)
    max_steps = trainer.get("max_steps", -1)
    if not (max_steps > 0 or (max_steps == -1 and optim.decay_steps)):
        fail("trainer.max_steps", max_steps, "> 0 (it sets the LR schedule's length; -1 only with optim.decay_steps)")
    devices = trainer.get("devices")
    require(devices >= 1 or devices == -1 if isinstance(devices, int) else
            not isinstance(devices, str) or DEVICE_IDS.fullmatch(devices.replace(" ", "")),
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
    strategy = trainer.get("strategy")
    if isinstance(strategy, dict) and strategy.get("device_mesh") is not None:  # trainer=hsdp: the mesh covers the world
        check_mesh(strategy["device_mesh"], trainer.get("num_nodes") or 1, trainer.get("devices"))


def check_evaluation(cfg: DictConfig, datamodule: L.LightningDataModule) -> None:
    """``eval.*``, run when fit ends, checked now rather than after the training: which probes
    run (``enabled_probes``, the rule the runner follows) and the options of each."""
    evaluation = plain(cfg.get("eval")) or {}
    held_out_text = getattr(datamodule, "held_out_text", True)
    running = build("eval", enabled_probes, evaluation, held_out_text)
    for name, probe in PROBES.items():  # asked for by name, yet off (``Probe.runs``): said, not skipped silently
        if (evaluation.get(name) or {}).get("enabled") is True and name not in running and probe.needs == "text":
            print(f"[pelab] eval.{name}.enabled=true is skipped: it scores held-out text and this run's data "
                  f"(a synthetic task) has none; eval.tasks scores a synthetic run", flush=True)
    if str(evaluation.get("positions", "sequential")) == "randomized" and (cfg.get("pe") or {}).get("randomize_to") is None:
        raise ConfigError("eval.positions=randomized evaluates a model trained with pe.randomize_to=N (positions drawn "
                          "from [0, N)), and pe.randomize_to is null: set it, or eval.positions=sequential")
    configs = {}
    for name, options in running.items():
        section = f"eval.{name}"
        # precision mirrors trainer.precision (checked with the trainer), which may be an int
        check_options(section, options, PROBES[name].config, ignore=("precision",))
        if "precision" in options:
            options["precision"] = str(options["precision"])
        configs[name] = build(section, PROBES[name].config.from_dict, options)
    extrapolation = configs.get("extrapolation")
    trained = ((plain(cfg.pe) or {}).get("scaling") or {}).get("kind", "none")
    for name in ("extrapolation", "tasks"):  # the probes that score with evaluation-time RoPE scaling
        probe = configs.get(name)
        if probe and trained != "none" and any(s is not None for s in probe.rope_scaling):
            fail(f"eval.{name}.rope_scaling", evaluation[name]["rope_scaling"],
                 f"[null] when pe.scaling.kind={trained}: the trained scaling applies to every evaluation, and "
                 f"another one on top is refused")
    if configs.get("tasks") is not None and getattr(datamodule, "task", None) is not None:  # eval.tasks.f1 vs the task
        build("eval.tasks", configs["tasks"].check_task, datamodule.task)
    if extrapolation:
        check_stride(extrapolation, cfg.model.block_size)
    streaming = configs.get("streaming")
    if streaming:  # the probe's own rule for its cache's window (evaluate_streaming), at this run's length
        build("eval.streaming", streaming.window_of, cfg.model.block_size)


def check_stride(config: ExtrapolationConfig, train_length: int, key: str = "eval.extrapolation.stride") -> None:
    """A sliding stride longer than every eval length scores no window: the table would come out
    empty after the training. (Longer than some lengths only: those rows say "skipped".)"""
    if "sliding" not in config.modes or config.stride is None:
        return
    lengths = config.eval_lengths(train_length)
    require(config.stride <= max(lengths), key, config.stride,
            f"null (half the eval length) or at most the longest eval length, {max(lengths)} (eval lengths "
            f"{', '.join(map(str, lengths))} at a training length of {train_length}): sliding windows advance by "
            f"the stride and score its last tokens")


def build_callbacks(cfg: DictConfig) -> list:
    callbacks = []
    for name, node in (cfg.get("callbacks") or {}).items():
        if node and "_target_" in node:
            section = f"callbacks.{name}"
            check_options(section, plain(node), target_class(section, plain(node)))
            callbacks.append(build(section, hydra.utils.instantiate, node))
    return callbacks
