"""pelab training entry point: compose -> validate -> build -> fit -> evaluate -> summary.

    python train.py                                  # tiny model, RoPE, embedded corpus
    python train.py pe=alibi model=small trainer.max_steps=2000
    python train.py -m pe=learned,sinusoidal,rope,alibi,xpos,rope_alibi experiment=pe_ablation
"""

from __future__ import annotations

import os
from pathlib import Path

import hydra
from omegaconf import DictConfig, open_dict

import pelab.run  # noqa: F401 - registers the run_slug resolver conf/hydra uses, before Hydra composes


def train(cfg: DictConfig) -> float | None:
    import torch

    from pelab.batch import set_accumulation
    from pelab.checkpoint import load_init_weights, resume_from_run_dir
    from pelab.config import build
    from pelab.hydra_callbacks import check_output_folders
    from pelab.lit import LitGPT
    from pelab.loggers import build_loggers, closed_on_failure
    from pelab.run import emulated_bf16_notice, name_run, save_run, summary, wandb_run_id
    from pelab.validate import validate_config

    # validate: every option, before any data is read; builds the data module, scheme and callbacks
    output_dir = Path(cfg.paths.output_dir)
    resuming = resume_from_run_dir(cfg, output_dir)
    checked = validate_config(cfg)
    check_output_folders(cfg)  # paths.output_dir and the checkpoints' folder, writable
    identity = name_run(cfg)

    # build
    if torch.cuda.is_available():
        torch.set_float32_matmul_precision("high")
    datamodule = checked.datamodule
    with open_dict(cfg):
        cfg.model.vocab_size = datamodule.vocab_size
    documents = getattr(datamodule, "documents", None)  # packed documents (data/packing.py); none for synthetic tasks
    module = LitGPT(model=cfg.model, pe=cfg.pe, optim=cfg.optim, compile=cfg.compile, position=checked.position,
                    documents=vars(documents) if documents else None, eval_documents=cfg.eval.get("documents"))
    if checked.init_state is not None:  # init_from: weights only; optimizer, schedule, step and data start fresh
        load_init_weights(module.model, checked.init_state, cfg.init_from)
    run_id = wandb_run_id(output_dir, resuming)
    loggers = build_loggers(cfg, identity, run_id)
    trainer = build("trainer", hydra.utils.instantiate, cfg.trainer, logger=loggers or False,
                    callbacks=checked.callbacks)  # Lightning's own device checks, as one line
    set_accumulation(trainer, cfg)
    if trainer.is_global_zero and (notice := emulated_bf16_notice(trainer)):
        print(notice)
    save_run(cfg, trainer, output_dir, run_id, loggers, identity)

    # fit, then evaluate: conf/callbacks' end_of_training runs when fit ends, under every strategy
    with closed_on_failure(loggers):
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    return summary(trainer, identity, output_dir, loggers)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    return train(cfg)


if __name__ == "__main__":
    # The checkout is the application (model/, data/ are not installed): the processes a launcher
    # starts (submitit, SLURM jobs) import from it wherever they run.
    root, path = str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")
    if root not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, path) if p)
    main()
