"""Run by tests/harness/test_distributed.py: train a few fp32 steps on ``devices`` CPU processes (gloo
DDP through Lightning) with ``batch`` sequences per rank, on windows that make the global
batch of every step the same rows whatever the number of ranks; then validate. Rank zero saves
the parameters and val/loss.   python tests/harness/ddp_worker.py DEVICES BATCH TOKENS.bin OUT.pt"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from data.stream import load_tokens  # noqa: E402
from data.val_windows import ValidationWindows  # noqa: E402
from pelab.datamodule import StreamDataModule  # noqa: E402
from pelab.lit import LitGPT  # noqa: E402

BLOCK, STEPS, GLOBAL_ROWS = 32, 4, 8


class GlobalBatchRows(Dataset):
    """Global sample g = row g (data/stream.py's keying): step s trains on rows s * GLOBAL_ROWS
    onwards whatever the number of ranks."""

    def __init__(self, path: Path) -> None:
        self.tokens = load_tokens(path, "uint16")

    def __len__(self) -> int:
        return STEPS * GLOBAL_ROWS

    def __getitem__(self, g: int):
        start = g * 97 % (len(self.tokens) - BLOCK - 1)
        chunk = torch.from_numpy(self.tokens[start : start + BLOCK + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


class Windows(StreamDataModule):
    def __init__(self, path: Path, batch: int) -> None:
        super().__init__()
        self.path, self.batch_size, self.val_batch_size, self.num_workers = path, batch, 4, 0
        self.train_samples = STEPS * GLOBAL_ROWS

    def setup(self, stage: str) -> None:
        self.train_set = GlobalBatchRows(self.path)
        self.val_set = ValidationWindows(self.path, "uint16", BLOCK, 22)  # 22: the ranks get 11 windows each


def main(devices: int, batch: int, tokens: Path, out: Path) -> None:
    torch.set_num_threads(1)
    L.seed_everything(0)
    module = LitGPT(model={"vocab_size": 256, "block_size": BLOCK, "n_layer": 2, "n_head": 2, "n_embd": 32},
                    pe={"_target_": "model.pe.rope.RoPE"}, optim={"warmup_steps": 1, "lr": 3e-3})
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
                        precision="32-true", max_steps=STEPS, limit_val_batches=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, gradient_clip_val=1.0)
    data = Windows(tokens, batch)
    trainer.fit(module, datamodule=data)
    trainer.limit_val_batches = 1.0
    trainer.validate(module, datamodule=data, verbose=False)
    from evaluation.extrapolation import ExtrapolationConfig, measure

    config = ExtrapolationConfig(multipliers=(1, 4), modes=("nonoverlapping", "sliding"), precision="32")
    result = measure(module.model, load_tokens(tokens, "uint16")[:6000], BLOCK, config,
                     log=lambda _: None, distributed=True)  # every rank, its share of the windows
    rows, by_position = result.rows, result.position_rows
    if trainer.is_global_zero:
        torch.save({"table": [(r.eval_length, r.mode, r.tokens, r.loss) for r in rows],
                    "positions": [(r.eval_length, r.mode, r.start, r.end, r.tokens, r.loss) for r in by_position],
                    "params": {k: v.detach().clone() for k, v in module.state_dict().items()},
                    "val_loss": float(trainer.callback_metrics["val/loss"]),
                    "val_batches": int(trainer.num_val_batches[0])}, out)
    if torch.distributed.is_initialized():  # stop gloo's threads before exit: left running, they can abort it
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
