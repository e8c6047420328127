"""The timed training paths, each a ``body(clock)`` that trains until ``clock.tick()`` says stop.

- ``reference``: the reference model (benchkit/reference.py) in a plain PyTorch loop;
- ``pelab-loop``: pelab's GPT with learned positions, as ``LitGPT`` builds it, in that same loop;
- any scheme name: ``LitGPT`` fitted by a Lightning ``Trainer`` with conf/'s trainer settings
  and callbacks (minus ``NOT_TIMED_CALLBACKS``), no validation and no checkpointing.

``clock.begin()`` is called once before the first step and ``clock.tick()`` at every step end.
"""

from __future__ import annotations

import torch
from torch import nn

from benchkit import reference
from benchkit.conf import host_memory_setting, lit_module, optim_config, timed_callbacks, trainer_defaults

PELAB_LOOP = "pelab-loop"  # path name: pelab's GPT in the reference's loop
DOCUMENT_EOT = 0  # the separator of the bench's packed documents (token 0 of the random windows)


def path_parts(name: str) -> tuple[str, str | None, dict]:
    """(scheme, packed-document mode or None, model options) of a path name ``SCHEME``,
    ``SCHEME+MODE`` (mode ``mask``: data.document_mask; ``both``: with data.document_positions) or
    ``SCHEME@KEY=VALUE;KEY=VALUE`` (model options as YAML values: ``rope@window_pattern=[128,null]``)."""
    import yaml

    base, _, variant = name.partition("@")
    scheme, _, mode = base.partition("+")
    options = {}
    for item in filter(None, variant.split(";")):
        key, _, value = item.partition("=")
        options[key] = yaml.safe_load(value)
    return scheme, mode or None, options


class Stop(Exception):
    """Raised from a Lightning callback to end ``trainer.fit`` when the clock says stop."""


def batches(vocab_size: int, B: int, T: int, seed: int = 0, doc_length: int | None = None):
    """A DataLoader of endless (x, y) batches cycling over 64 fixed random windows; with
    ``doc_length``, packed documents: a separator at each token with probability 1/doc_length."""
    from torch.utils.data import DataLoader, Dataset

    g = torch.Generator().manual_seed(seed)
    data = torch.randint(1 if doc_length else 0, vocab_size, (64, T + 1), generator=g)
    if doc_length:
        data[torch.rand(data.shape, generator=g) < 1 / doc_length] = DOCUMENT_EOT

    class Windows(Dataset):
        def __len__(self) -> int:
            return 10**12

        def __getitem__(self, i: int):
            w = data[i % len(data)]
            return w[:-1], w[1:]

    return DataLoader(Windows(), batch_size=B, shuffle=False, num_workers=0)


class PelabLoss(nn.Module):
    """pelab's GPT called as the reference loop calls its model: net(x, y) -> loss."""

    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, idx, targets):
        return self.gpt(idx, targets)[1]


def plain_loop_body(model: dict, precision: str, compile_: bool, device: str, B: int, nthreads: int,
                    pelab_model: bool = False):
    """(body, flops per token) of the reference loop, with the reference model or
    (``pelab_model``) pelab's GPT with learned positions: the LightningModule's model without
    the Lightning loop."""
    host_memory_setting()
    torch.manual_seed(0)
    if pelab_model:
        lit = lit_module(model, "learned", False)
        net, fpt = PelabLoss(lit.model).to(device), lit.flops_per_token
    else:
        config = reference.ReferenceConfig.from_model(model)
        net = reference.ReferenceGPT(config).to(device)
        fpt = reference.flops_per_token(net, config)
    optim = optim_config()

    def body(clock) -> None:
        torch.set_num_threads(nthreads)
        run_net = torch.compile(net) if compile_ else net
        opt, sched = reference.configure_optimizer(net, optim, device, 10**9)
        params = list(net.parameters())
        net.train()
        clock.begin()
        for x, y in batches(model["vocab_size"], B, model["block_size"]):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
                loss = run_net(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if clock.tick():
                return

    return body, fpt


def lightning_trainer(precision: str, device: str, callbacks: list, max_steps: int = 10**9):
    """conf/trainer/default.yaml's step settings; the bench stops the fit itself (``Stop``)."""
    import lightning as L

    return L.Trainer(max_steps=max_steps, accelerator=device, devices=1, precision=precision, logger=False,
                     callbacks=callbacks, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                     default_root_dir="/tmp/pelab-bench", **trainer_defaults())


def pelab_body(model: dict, scheme: str, precision: str, compile_: bool, device: str, B: int, nthreads: int,
               doc_length: int | None = None):
    """(body, flops per token) of ``LitGPT`` with ``scheme`` (``SCHEME+MODE``: packed documents
    of ``doc_length`` tokens on average; ``SCHEME@OPTIONS``: other model options) fitted by a
    Lightning Trainer."""
    import lightning as L

    scheme, mode, options = path_parts(scheme)
    documents = {"positions": mode == "both", "mask": True, "eot_token": DOCUMENT_EOT} if mode else None
    lit = lit_module(model | options, scheme, compile_, documents)
    doc_length = doc_length if mode else None

    class StepTimer(L.Callback):
        """Last in the list: a step ends after every other callback's on_train_batch_end."""

        def __init__(self, clock) -> None:
            self.clock = clock

        def on_train_start(self, trainer, pl_module) -> None:
            self.clock.begin()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if self.clock.tick():
                raise Stop

    def body(clock) -> None:
        torch.set_num_threads(nthreads)
        trainer = lightning_trainer(precision, device, timed_callbacks() + [StepTimer(clock)])
        trainer.fit(lit, train_dataloaders=batches(model["vocab_size"], B, model["block_size"], doc_length=doc_length))

    return body, lit.flops_per_token


def path_body(scheme: str | None, job: dict):
    """(body, flops per token) of the reference loop (``scheme`` None), of pelab's model in it
    (``scheme`` PELAB_LOOP) or of pelab with ``scheme``."""
    if scheme is None or scheme == PELAB_LOOP:
        return plain_loop_body(job["model"], job["precision"], job["compile"], job["device"], job["B"],
                               job["nthreads"], pelab_model=scheme == PELAB_LOOP)
    return pelab_body(job["model"], scheme, job["precision"], job["compile"], job["device"], job["B"],
                      job["nthreads"], job.get("doc_length"))
