"""What the bench reads from conf/ (the files train.py composes) and from pelab itself.

The bench's one import of pelab's training harness is ``HARNESS`` below: the fork server
preloads it and ``lit_module`` builds ``LitGPT`` from it.
"""

from __future__ import annotations

import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HARNESS = "pelab.lit"  # the module that defines LitGPT
VOCABS = {"byte": (256, 1), "gpt2": (50257, 64)}  # vocabulary, pad_vocab_multiple
# conf/callbacks/default.yaml entries left out of the timed fit: they write files or probe the
# model only at validation or at the end of training, none of which happens in the timed steps
NOT_TIMED_CALLBACKS = ("model_checkpoint", "attention_maps", "position_functions", "end_of_training")


def _load(*parts: str) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(ROOT.joinpath("conf", *parts)), resolve=True)


def composed(group: str, option: str) -> dict:
    """conf/GROUP/OPTION.yaml as train.py gets it: composed by Hydra, its defaults list applied."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return OmegaConf.to_container(compose("config", overrides=[f"{group}={option}"])[group], resolve=True)


def model_config(config: str, block_size: int | None) -> dict:
    """conf/model/SIZE.yaml with the vocabulary of ``VOCAB-SIZE``."""
    vocab, _, size = config.partition("-")
    if vocab not in VOCABS or not (ROOT / "conf" / "model" / f"{size}.yaml").is_file():
        raise SystemExit(f"config {config!r}: expected VOCAB-SIZE with VOCAB in {sorted(VOCABS)} and SIZE a "
                         f"file of conf/model/")
    model = composed("model", size)  # its defaults list pulls in conf/model/common
    model["vocab_size"], model["pad_vocab_multiple"] = VOCABS[vocab]
    if block_size:
        model["block_size"] = block_size
    return model


def pe_config(scheme: str, **overrides) -> dict:
    """The scheme's conf/pe file (what train.py uses), or its class with defaults."""
    from model.pe import SCHEMES

    if (ROOT / "conf" / "pe" / f"{scheme}.yaml").is_file():
        pe = composed("pe", scheme)
    else:
        cls = SCHEMES[scheme]
        pe = {"_target_": f"{cls.__module__}.{cls.__qualname__}"}
    return pe | overrides


def optim_config() -> dict:
    return _load("optim", "adamw.yaml") | {"warmup_steps": 10}


def trainer_defaults() -> dict:
    from omegaconf import OmegaConf

    t = OmegaConf.load(ROOT / "conf" / "trainer" / "default.yaml")  # not resolved: it refers to paths.*
    return {"gradient_clip_val": t.gradient_clip_val, "log_every_n_steps": t.log_every_n_steps,
            "accumulate_grad_batches": t.accumulate_grad_batches}


def _callbacks_conf():
    from omegaconf import OmegaConf

    return OmegaConf.load(ROOT / "conf" / "callbacks" / "default.yaml")


def timed_callbacks() -> list:
    """conf/callbacks/default.yaml, instantiated, minus NOT_TIMED_CALLBACKS."""
    import hydra

    cfg = _callbacks_conf()
    return [hydra.utils.instantiate(cfg[name]) for name in cfg if name not in NOT_TIMED_CALLBACKS]


def host_memory_setting() -> None:
    """conf/callbacks/default.yaml's ``host_memory_reuse`` (if there) applied to this process, as
    the Trainer applies it to pelab's paths, so that the plain loops do not re-fault freed memory
    either and the ratios compare code, not glibc's trimming."""
    import hydra

    cfg = _callbacks_conf()
    if "host_memory_reuse" in cfg:
        hydra.utils.instantiate(cfg["host_memory_reuse"]).setup(None, None, "fit")


def lit_module(model: dict, scheme: str, compile_: bool, documents: dict | None = None, **pe_overrides):
    """pelab's LightningModule as train.py builds it, seeded as the reference; ``documents``:
    packed documents (data/packing.py DocumentOptions fields), only when given."""
    import torch

    lit_gpt = importlib.import_module(HARNESS).LitGPT
    torch.manual_seed(0)
    extra = {"documents": documents} if documents else {}
    return lit_gpt(model=model, pe=pe_config(scheme, **pe_overrides), optim=optim_config(), compile=compile_,
                   **extra)
