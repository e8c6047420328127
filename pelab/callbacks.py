"""Lightning callbacks configured from conf/callbacks/."""

from __future__ import annotations

import os
import re
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn


# Dense tensor-core peaks (no 2:4 sparsity), FLOP/s per GPU, by the compute dtype of the matmuls:
# "tf32" is float32 under torch.set_float32_matmul_precision("high"/"medium") (train.py sets
# "high" on CUDA), "fp32" under "highest". NVIDIA's datasheets print the tensor-core rates "with
# sparsity"; the dense rate is half. Sources and the chips' names: docs/gpu.md, "MFU peaks".
DENSE_PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H100 SXM": {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51.2e12},
    "H100 NVL": {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12},
    "H200 SXM": {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "H200 NVL": {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
}


def chip_of(device_name: str) -> str | None:
    """The key of DENSE_PEAK_FLOPS for a ``torch.cuda.get_device_name``, or None. "NVIDIA H200"
    is the SXM part ("NVIDIA H200 NVL" the PCIe one); "NVIDIA H100 80GB HBM3" the SXM H100."""
    name = device_name.lower()
    words = set(re.split(r"[^a-z0-9]+", name))
    if "h100" in words:
        if "nvl" in words:
            return "H100 NVL"
        if "pcie" in words or "hbm2e" in words:
            return "H100 PCIe"
        if "hbm3" in words or "sxm" in words or "sxm5" in words:
            return "H100 SXM"
        return None
    if "h200" in words:  # a word: GH200 (Grace Hopper) is another product
        return "H200 NVL" if "nvl" in words else "H200 SXM"
    if any(w.startswith("a100") for w in words):
        return "A100"
    return None


def compute_of(precision: str) -> str | None:
    """The dtype the matmuls of a ``trainer.precision`` run in: bf16, fp16, tf32 or fp32 (None: 64)."""
    precision = str(precision)
    if precision.startswith("bf16"):
        return "bf16"
    if precision.startswith("16"):
        return "fp16"
    if precision.startswith("32"):
        return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    return None


def device_peak(device: torch.device, precision: str) -> tuple[float, str] | None:
    """(peak FLOP/s, what it is) of one device in the compute dtype of ``precision``, or None
    where no peak is known (CPU, a chip in neither table). DENSE_PEAK_FLOPS first; other chips
    from Lightning's table, which is named in the description since it is not checked here."""
    compute = compute_of(precision)
    if device.type != "cuda" or compute is None:
        return None
    name = torch.cuda.get_device_name(device)
    chip = chip_of(name)
    if chip is not None:
        flops = DENSE_PEAK_FLOPS[chip][compute]
        return flops, f"{flops / 1e12:g} TFLOP/s: {name} as {chip}, dense {compute} (docs/gpu.md, MFU peaks)"
    from lightning.fabric.utilities.throughput import get_available_flops

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(compute, torch.float32)
    flops = get_available_flops(device, dtype)
    if not flops:
        return None
    return float(flops), f"{flops / 1e12:g} TFLOP/s: {name}, {compute}, from Lightning's table (not checked in pelab)"


class TokensPerSecond(L.Callback):
    """Logs ``train/tokens_per_sec`` (summed over ranks) and, where the device's peak is
    known (CUDA), ``train/mfu`` from ``LitGPT.flops_per_token`` against ``device_peak``, the
    dense peak in the compute dtype of the precision; the peak used is printed once.

    Timed between logging steps and excluding validation; the device is synchronised only
    at those steps, so the training step itself is untouched.
    """

    def __init__(self) -> None:
        self._t0: float | None = None
        self._tokens = 0
        self._peak_flops: float | None = None
        self.peak: str | None = None  # the peak used for train/mfu, described
        self._step = 0  # global_step at the previous batch: unchanged while gradients accumulate

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        device = trainer.strategy.root_device
        peak = device_peak(device, str(trainer.precision))
        self._peak_flops, self.peak = peak if peak else (None, None)
        if peak:
            rank_zero_info(f"[pelab] train/mfu peak: {self.peak}")
        elif device.type == "cuda":
            rank_zero_info(f"[pelab] train/mfu not logged: no peak known for {torch.cuda.get_device_name(device)} "
                           f"at precision {trainer.precision} (pelab.callbacks.DENSE_PEAK_FLOPS)")

    def _sync(self, pl_module: L.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def _restart(self, pl_module: L.LightningModule) -> None:
        self._sync(pl_module)
        self._t0, self._tokens = time.perf_counter(), 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._step = trainer.global_step
        self._restart(pl_module)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.training:  # resume timing after an in-fit validation
            self._restart(pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        self._tokens += batch[0].numel()
        stepped, self._step = trainer.global_step != self._step, trainer.global_step
        if not stepped or trainer.global_step % trainer.log_every_n_steps:  # mid-accumulation or not a log step
            return
        self._sync(pl_module)
        elapsed = time.perf_counter() - self._t0
        if self._tokens and elapsed > 0:
            world = trainer.world_size
            pl_module.log("train/tokens_per_sec", self._tokens * world / elapsed, on_step=True, on_epoch=False)
            flops_per_token = getattr(pl_module, "flops_per_token", None)
            if self._peak_flops and flops_per_token:  # per device: this rank's tokens
                mfu = self._tokens * flops_per_token / elapsed / self._peak_flops
                pl_module.log("train/mfu", mfu, on_step=True, on_epoch=False)
        self._t0, self._tokens = time.perf_counter(), 0


class HostMemoryReuse(L.Callback):
    """Keeps freed host memory in the process for the next step (glibc only; elsewhere a no-op).

    glibc's malloc hands large freed blocks back to the kernel (a block over its adaptive mmap
    threshold is unmapped at free; a free top of the heap past the trim threshold is trimmed),
    and the next step's activations fault the same pages in again, zero-filled. Fixed
    thresholds (``mallopt``) make blocks up to ``mmap_threshold_mb`` come from the heap and
    keep up to ``trim_threshold_mb`` of free heap: the steady-state footprint of a training
    loop, which it needs again every step anyway. The setting is per process (DataLoader
    workers forked later inherit it) and is made at ``setup``, before the first step.
    """

    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
    MAX_MMAP_THRESHOLD_MB = 32  # glibc refuses more on 64-bit (HEAP_MAX_SIZE / 2)

    def __init__(self, mmap_threshold_mb: int = 32, trim_threshold_mb: int = 1024) -> None:
        for key, value, top in (("mmap_threshold_mb", mmap_threshold_mb, self.MAX_MMAP_THRESHOLD_MB),
                                ("trim_threshold_mb", trim_threshold_mb, None)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (top and value > top):
                raise ValueError(f"callbacks.host_memory_reuse.{key} must be an integer in [0, {top or 'inf'}] "
                                 f"(MiB), got {value!r}")
        self.mmap_threshold_mb, self.trim_threshold_mb = mmap_threshold_mb, trim_threshold_mb
        self.applied = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.applied = set_malloc_thresholds(self.mmap_threshold_mb << 20, self.trim_threshold_mb << 20)


def set_malloc_thresholds(mmap_threshold: int, trim_threshold: int) -> bool:
    """glibc ``mallopt`` of the two thresholds (bytes); False where the C library is not glibc."""
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)  # the process's own C library
    ok = (libc.mallopt(HostMemoryReuse.M_MMAP_THRESHOLD, mmap_threshold) == 1
          and libc.mallopt(HostMemoryReuse.M_TRIM_THRESHOLD, trim_threshold) == 1)
    if not ok:
        raise RuntimeError(f"glibc mallopt refused mmap_threshold={mmap_threshold}, trim_threshold={trim_threshold}")
    return True


def logging_step(trainer: L.Trainer, stepped: bool = False) -> bool:
    """Whether the optimizer step under way is one Lightning logs: every ``trainer.log_every_n_steps``
    steps (the step after which global_step is a multiple of it) and when the trainer is stopping.
    ``stepped``: asked after that step (``on_train_batch_end``, global_step already counts it)."""
    step = trainer.global_step + (0 if stepped else 1)
    return step % trainer.log_every_n_steps == 0 or trainer.should_stop


class LoggedStepMetrics:
    """For Lightning's progress bars: their metrics read at logging steps only; the step count
    moves every step. Lightning turns every metric logged with ``prog_bar=True`` into a number at
    every batch, logged that step or not (a host sync each), so the training loss is logged
    without it and the bar shows ``SHOWN`` from ``trainer.callback_metrics`` when they are logged.
    ``LitGPT.configure_callbacks`` puts the bar below in place of Lightning's default one."""

    SHOWN = ("train/loss",)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._shown: dict | None = None
        self._step = -1  # global_step at the previous batch: unchanged while gradients accumulate
        self._fresh = True

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._step = trainer.global_step  # a resumed run's or accumulation's first batch is not a step's end

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        stepped, self._step = trainer.global_step != self._step, trainer.global_step
        self._fresh = stepped and logging_step(trainer, stepped=True)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self._fresh = True  # outside training steps (epoch and validation ends) as Lightning shows them

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict:
        if self._fresh or self._shown is None:
            logged = trainer.callback_metrics
            self._shown = {**super().get_metrics(trainer, pl_module),
                           **{name: float(logged[name]) for name in self.SHOWN if name in logged}}
        return self._shown


class LoggedStepProgressBar(LoggedStepMetrics, TQDMProgressBar):
    @classmethod
    def like(cls, bar: TQDMProgressBar) -> LoggedStepProgressBar:
        return cls(refresh_rate=bar.refresh_rate, leave=bar._leave)


class LoggedStepRichProgressBar(LoggedStepMetrics, RichProgressBar):
    @classmethod
    def like(cls, bar: RichProgressBar) -> LoggedStepRichProgressBar:
        return cls(refresh_rate=bar.refresh_rate, leave=bar._leave, theme=bar.theme, console_kwargs=bar._console_kwargs)


# Lightning's default bars (Rich where rich is installed) and their logging-step versions
LOGGED_STEP_BARS = {TQDMProgressBar: LoggedStepProgressBar, RichProgressBar: LoggedStepRichProgressBar}


class NonFiniteError(RuntimeError):
    """Training stopped because the loss or the gradients were NaN/inf."""


class NonFiniteGuard(L.Callback):
    """No update is applied from a non-finite loss or gradient; training stops at the first host
    check after such a step, once more than ``max_skipped_steps`` of them were seen.

    The decision is made on the device, so a step reads nothing on the host: the loss flag
    (every micro-batch) and a fused norm over the gradients give one flag per step, handed to
    the fused AdamW as ``found_inf`` (the hook GradScaler uses): its kernel then leaves the
    parameters, both moments and its step count as they were. The LR schedule and global_step
    still advance. The flags are read on the host (one copy of a few numbers) only at logging
    steps (``trainer.log_every_n_steps``), before any checkpoint is written and when training
    ends; each skipped step is then named, counted, warned about and logged as
    ``train/skipped_steps``. Past the budget it raises ``NonFiniteError`` naming the step, not
    ``trainer.should_stop``: on an exception ModelCheckpoint saves only with
    ``save_on_exception=True`` (off in conf/callbacks/default.yaml), and the check before every
    save refuses to write one after the failure, so the last checkpoint is from before it.

    Every rank decides alike without a collective of its own: under several processes, and under
    a GradScaler, a non-finite loss multiplies the gradient flowing out of it by NaN, so every
    gradient (all-reduced under DDP) is non-finite on every rank, and the message names the loss
    alone. Under a GradScaler (``16-mixed``) the scaler's own ``found_inf`` skips the step. With
    a sharded strategy (FSDP: each rank holds gradient shards) the flag is summed across ranks on
    the device. An optimizer without ``found_inf`` support (not fused) is checked on the host at
    every step, as before, and its gradients dropped.
    """

    def __init__(self, max_skipped_steps: int = 0) -> None:
        if isinstance(max_skipped_steps, bool) or not isinstance(max_skipped_steps, int) or max_skipped_steps < 0:
            raise ValueError(f"callbacks.nonfinite_guard.max_skipped_steps must be an integer >= 0 "
                             f"(bad steps skipped before stopping), got {max_skipped_steps!r}")
        self.max_skipped_steps = max_skipped_steps
        self.skipped_steps = 0
        self._loss_ok: torch.Tensor | None = None
        self._unread: list[tuple[int, torch.Tensor]] = []  # (global step, [loss bad, gradients bad]) on the device
        self._trainer: L.Trainer | None = None
        self._step = -1  # global_step at the previous batch: unchanged while gradients accumulate

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._trainer = trainer

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._step = trainer.global_step  # a resumed run's or accumulation's first batch is not a step's end

    @staticmethod
    def _spreads_loss(trainer: L.Trainer) -> bool:
        """A non-finite loss is carried by the gradients: other ranks, or the GradScaler, see it there."""
        return trainer.world_size > 1 or getattr(trainer.precision_plugin, "scaler", None) is not None

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        ok = torch.isfinite(loss.detach()).all()  # stays on the device: no sync here
        self._loss_ok = ok if self._loss_ok is None else self._loss_ok & ok  # all micro-batches of the step
        if self._spreads_loss(trainer):  # x 1.0 leaves a finite gradient's bits as they are
            loss.register_hook(lambda grad: grad * torch.where(ok, 1.0, float("nan")).to(grad.dtype))

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        device = pl_module.device
        loss_ok = self._loss_ok if self._loss_ok is not None else torch.ones((), dtype=torch.bool, device=device)
        self._loss_ok = None
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if grads and scaler is None:  # a non-finite element makes the total norm non-finite
            grads_ok = torch.nn.utils.get_total_norm(grads, error_if_nonfinite=False).isfinite()
        else:  # the GradScaler checks the gradients itself
            grads_ok = torch.ones((), dtype=torch.bool, device=device)
        bad = torch.stack([~loss_ok.to(device), ~grads_ok.to(device)])
        if trainer.world_size > 1 and sharded_gradients(trainer):  # a shard's NaN is on one rank only
            bad = trainer.strategy.reduce(bad.float(), reduce_op="sum") > 0
        self._unread.append((trainer.global_step, bad))
        if scaler is not None:
            return
        if getattr(optimizer, "_step_supports_amp_scaling", False):  # fused: the kernel skips on the flag
            optimizer.found_inf = bad.any().float()
        elif self._read(trainer):  # no found_inf: decided on the host now
            optimizer.zero_grad(set_to_none=True)  # AdamW skips parameters without a gradient

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        for optimizer in trainer.optimizers:
            vars(optimizer).pop("found_inf", None)  # this step's flag, used
        stepped, self._step = trainer.global_step != self._step, trainer.global_step  # not mid-accumulation
        if not (stepped and logging_step(trainer, stepped=True)):
            return
        self._read(trainer)
        if self.max_skipped_steps:
            pl_module.log("train/skipped_steps", float(self.skipped_steps), on_step=True, on_epoch=False)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._read(trainer)

    def _read(self, trainer: L.Trainer) -> bool:
        """Read the unread flags on the host (one copy; with several processes summed across ranks
        first, every rank reading at the same step); count, warn about or stop at each bad step.
        True if any step was bad."""
        if not self._unread:
            return False
        steps, flags = zip(*self._unread)
        self._unread = []
        flags = torch.stack(flags).float()
        if trainer.world_size > 1 and not sharded_gradients(trainer):  # per rank (sharded: summed every step)
            flags = trainer.strategy.reduce(flags, reduce_op="sum")
        spread = self._spreads_loss(trainer)
        found = False
        for step, (loss_bad, grads_bad) in zip(steps, flags.tolist()):  # the one host read
            loss_bad, grads_bad = loss_bad > 0, grads_bad > 0 and not (spread and loss_bad)
            if loss_bad or grads_bad:
                found = True
                self._skipped(trainer, step, " and ".join(
                    name for name, is_bad in (("loss", loss_bad), ("gradients", grads_bad)) if is_bad))
        if self.max_skipped_steps:  # the count as of now, for the callbacks that read metrics
            trainer.callback_metrics["train/skipped_steps"] = torch.tensor(float(self.skipped_steps))
        return found

    def _skipped(self, trainer: L.Trainer, step: int, what: str) -> None:
        if self.skipped_steps >= self.max_skipped_steps:
            ckpt = getattr(trainer.checkpoint_callback, "last_model_path", "")
            last = f"; the last checkpoint, {ckpt}, is from before it" if ckpt else ""
            raise NonFiniteError(
                f"non-finite {what} at global step {step} (NaN/inf); that update was not applied, training stopped "
                f"at step {trainer.global_step} (the flags are read every trainer.log_every_n_steps="
                f"{trainer.log_every_n_steps} steps and before a checkpoint) and no checkpoint is written after "
                f"it{last}. Skipped so far: {self.skipped_steps} (callbacks.nonfinite_guard.max_skipped_steps="
                f"{self.max_skipped_steps}). Lower optim.lr, raise optim.warmup_steps or keep "
                f"trainer.gradient_clip_val, then resume from the last checkpoint")
        self.skipped_steps += 1
        rank_zero_warn(f"non-finite {what} at global step {step}: update skipped ({self.skipped_steps} of "
                       f"callbacks.nonfinite_guard.max_skipped_steps={self.max_skipped_steps}; read at step "
                       f"{trainer.global_step})")

    def state_dict(self) -> dict[str, Any]:
        # asked first by every checkpoint save, which copies every weight to the host anyway:
        # read now, so the count saved is current and nothing is saved after a failure
        if self._trainer is not None:
            self._read(self._trainer)
        return {"skipped_steps": self.skipped_steps}  # the budget holds across a resume

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))


def sharded_gradients(trainer: L.Trainer) -> bool:
    """True under strategies that shard weights and gradients across ranks (FSDP, model parallel)."""
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    return isinstance(trainer.strategy, (FSDPStrategy, ModelParallelStrategy))


class PreemptionCheckpoint(L.Callback):
    """Save ``last.ckpt`` and exit cleanly when the job is told to stop (SIGTERM: preemption,
    ``scancel``, a cluster's time limit; SIGUSR1 where no one else handles it).

    Lightning already turns SIGTERM into a flag that ends the run at the end of the current
    step, on every rank alike (``SIGTERMException``); this callback only writes the state it
    ends with, through the trainer's checkpoint IO (atomic), where ``resume=auto`` looks. On
    SLURM with auto-requeue Lightning handles SIGUSR1 itself (checkpoint and requeue), so
    SIGUSR1 is taken here only when nothing else is registered for it.
    """

    def __init__(self, filename: str = "last") -> None:
        self.filename = filename

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        import signal
        import threading

        if stage != "fit" or threading.current_thread() is not threading.main_thread():
            return
        if hasattr(signal, "SIGUSR1") and signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None):
            def stop_after_this_step(signum, frame) -> None:
                trainer._signal_connector.received_sigterm = True  # the flag Lightning's SIGTERM handler sets

            signal.signal(signal.SIGUSR1, stop_after_this_step)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        if not isinstance(exception, SIGTERMException):
            return  # a crash (NaN, error) must not overwrite the last good checkpoint
        ckpt = trainer.checkpoint_callback
        dirpath = getattr(ckpt, "dirpath", None) or os.path.join(trainer.default_root_dir, "checkpoints")
        path = os.path.join(dirpath, f"{self.filename}.ckpt")
        trainer.save_checkpoint(path)
        rank_zero_info(f"[pelab] stop signal: saved {path} at step {trainer.global_step}; "
                       f"continue with resume=auto in the same run dir")
