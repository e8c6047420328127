"""``train.py`` under FSDP on gloo CPU processes, for tests: Lightning refuses FSDP without a GPU,
so this lifts the preset strategy's refusal (``FSDPStrategy.cpu_for_tests``) and gives FSDP the
CPU as its device (``fsdp_worker.CPUDeviceFSDP``), then runs ``train.py`` unchanged with the
arguments given. Lightning starts the other ranks with this same command line (``sys.argv[0]``
stays this file), so they are lifted too. Also the test-only callbacks the FSDP tests add with ``+callbacks.NAME=...``.

    python tests/harness/fsdp_train.py trainer=fsdp trainer.accelerator=cpu trainer.devices=2 ...
"""

import os
import signal
import sys
import threading
import time
from pathlib import Path

import lightning as L
import torch

ROOT = Path(__file__).resolve().parents[2]


class DumpState(L.Callback):
    """When training starts (a resumed run: the checkpoint just loaded), rank zero writes the
    model's weights and AdamW state gathered whole (``torch.distributed.checkpoint.state_dict``,
    keyed by parameter name), the global step and the data module's state to ``path``, then
    every rank stops (``max_steps`` reached)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer, pl_module) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        from pelab.optim import plain_name

        options = StateDictOptions(full_state_dict=True)  # (cpu_offload on a CPU device: a segfault in torch 2.13)
        model, optim = get_state_dict(trainer.strategy.model, trainer.optimizers, options=options)
        if trainer.is_global_zero:
            model = {plain_name(k): v for k, v in model.items()}
            optim = {plain_name(k): v for k, v in optim["state"].items()}
            data = trainer.datamodule.state_dict()
            torch.save({"model": model, "optim": optim, "global_step": trainer.global_step, "data": data}, self.path)
        trainer.should_stop = True


class RecordSharding(L.Callback):
    """When training starts, each rank writes ``PREFIX.RANK.json``: the sizes of its FSDP root's
    shard group and replicate group (hybrid sharding's; 1 without) and its share of the weights."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def on_train_start(self, trainer, pl_module) -> None:
        import json

        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        root = trainer.strategy.model
        replicate = getattr(root, "_inter_node_pg", None)
        local = sum(unit._handle.flat_param.numel() for unit in FSDP.fsdp_modules(root) if unit._handle is not None)
        record = {"shard_group": root.process_group.size(), "replicate_group": replicate.size() if replicate else 1,
                  "local_numel": local, "world": trainer.world_size}
        Path(f"{self.prefix}.{trainer.global_rank}.json").write_text(json.dumps(record))


class KillDuringAsyncSave(L.Callback):
    """SIGKILL every rank in the middle of the asynchronous save of ``step``: its shard files are
    half written, its ``.metadata`` is not. The writer waits until training has finished the
    next step first (the save runs beside training), and writes ``ASYNC`` or ``BLOCKED`` to
    ``marker`` (rank zero) to say whether it did."""

    def __init__(self, step: int, marker: str) -> None:
        self.step, self.marker = step, marker
        self.next_step_done = threading.Event()

    def setup(self, trainer, pl_module, stage: str) -> None:
        from torch.distributed.checkpoint import filesystem

        callback, write = self, filesystem.FileSystemWriter.write_data

        def half_write_then_die(writer, plan, planner):
            if Path(str(writer.path)).name.startswith(f".step{callback.step:06d}.ckpt."):
                overlapped = callback.next_step_done.wait(timeout=30)
                if trainer.is_global_zero:
                    Path(callback.marker).write_text("ASYNC" if overlapped else "BLOCKED")
                write(writer, plan, planner).wait()  # the shards on disk, the save not finished
                for shard in Path(str(writer.path)).glob("*.distcp"):
                    with open(shard, "r+b") as f:
                        f.truncate(max(1, shard.stat().st_size // 2))
                os.kill(os.getpid(), signal.SIGKILL)
            return write(writer, plan, planner)

        filesystem.FileSystemWriter.write_data = half_write_then_die

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step + 1:
            self.next_step_done.set()
            time.sleep(60)  # the writer kills this process meanwhile


def cpu_fsdp() -> None:
    from torch.distributed import fsdp

    from pelab.checkpoint import FSDPStrategy
    from tests.harness.fsdp_worker import CPUDeviceFSDP

    FSDPStrategy.cpu_for_tests = True
    fsdp.FullyShardedDataParallel = CPUDeviceFSDP  # Lightning's _setup_model imports it at each call


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    cpu_fsdp()
    script = ROOT / "train.py"  # run as __main__ with sys.argv untouched (runpy would set argv[0] to it)
    exec(compile(script.read_text(), str(script), "exec"), {"__name__": "__main__", "__file__": str(script)})
