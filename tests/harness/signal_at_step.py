"""A test-only callback: sends this process a real signal after a given optimizer step, as a
cluster does on preemption (used by tests/harness/test_preemption.py through +callbacks.signal=...)."""

import os
import signal

import lightning as L


class SignalAtStep(L.Callback):
    def __init__(self, step: int, signum: str = "SIGTERM") -> None:
        self.step, self.signum = step, getattr(signal, signum)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.is_global_zero:
            os.kill(os.getpid(), self.signum)
