"""Run by tests/harness/test_rank_zero_check.py: pelab's TextFilesDataModule over a folder of text
files on 2 gloo CPU processes (DDP through Lightning), 2 training steps. Each rank counts what
its prepare_data and setup do to the corpus files (``data.corpus.file_stats`` calls, ``os.stat``
of a path inside the corpus folder) and writes them, with the tokens its datasets read, to
OUT/rank{R}.json.

    python tests/harness/rank_check_worker.py CORPUS CACHE OUT MODE[,MODE...]
    MODE: shared (one cache folder), local (a cache folder per rank, as node-local disks are),
    fail (rank 0's check raises in setup; last). Several modes run one after another in the same
    2 processes (one start of Python, torch and gloo), each writing OUT/MODE/rank{R}.json (a mode
    named twice: MODE, MODE.2)."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402

import data.corpus  # noqa: E402
from data.corpus import TextFilesCorpus  # noqa: E402
from pelab.datamodule import TextFilesDataModule  # noqa: E402
from pelab.lit import LitGPT  # noqa: E402

BLOCK = 32


class Counts:
    """file_stats calls and os.stat calls on corpus paths, counted while ``on``."""

    def __init__(self, corpus: Path) -> None:
        self.corpus, self.on, self.file_stats, self.stats = str(corpus.resolve()), False, 0, 0
        real_file_stats, real_stat = data.corpus.file_stats, os.stat

        def file_stats(paths):
            self.file_stats += self.on
            return real_file_stats(paths)

        def stat(path, *args, **kwargs):
            if self.on and os.path.abspath(os.fspath(path)).startswith(self.corpus):
                self.stats += 1
            return real_stat(path, *args, **kwargs)

        data.corpus.file_stats, os.stat = file_stats, stat

    def counting(self, method):
        def counted(*args, **kwargs):
            self.on = True
            try:
                return method(*args, **kwargs)
            finally:
                self.on = False

        return counted


def main(corpus: Path, cache: Path, out: Path, modes: str) -> None:
    torch.set_num_threads(1)
    counts, seen = Counts(corpus), []
    for mode in modes.split(","):
        seen.append(mode)
        folder = out / (mode if seen.count(mode) == 1 else f"{mode}.{seen.count(mode)}")
        folder.mkdir(parents=True, exist_ok=True)
        counts.file_stats = counts.stats = 0
        run(corpus, cache, folder, mode, counts)
    if torch.distributed.is_initialized():  # stop gloo's threads before exit: left running, they can abort it
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def run(corpus: Path, cache: Path, out: Path, mode: str, counts: Counts) -> None:
    L.seed_everything(0)
    rank = int(os.environ.get("LOCAL_RANK", 0))  # set by Lightning's launcher for the second process
    data_dir = cache / f"node{rank}" if mode == "local" else cache
    dm = TextFilesDataModule(TextFilesCorpus([str(corpus)]), paths=[str(corpus)], tokenizer="bytes",
                             block_size=BLOCK, batch_size=2, data_dir=str(data_dir), val_windows=8)
    if mode == "fail" and rank == 0:  # prepare_data does nothing; the check in setup raises
        dm.prepare_data = lambda: None
        dm.check_cache = lambda: (_ for _ in ()).throw(OSError("the corpus folder went away"))
    dm.prepare_data, dm.setup = counts.counting(dm.prepare_data), counts.counting(dm.setup)
    module = LitGPT(model={"vocab_size": 256, "block_size": BLOCK, "n_layer": 1, "n_head": 2, "n_embd": 16},
                    pe={"_target_": "model.pe.rope.RoPE"}, optim={"warmup_steps": 1, "lr": 3e-3})
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", precision="32-true", max_steps=2,
                        limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0)
    try:
        trainer.fit(module, datamodule=dm)
    except Exception as err:  # noqa: BLE001 - the test reads what each rank raised
        (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({"error": f"{type(err).__name__}: {err}"}))
        raise SystemExit(1) from None
    x, y = dm.train_set[0]
    vx, _ = dm.val_set[0]
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({
        "file_stats": counts.file_stats, "corpus_stats": counts.stats, "step": trainer.global_step,
        "train_tokens": dm.meta["splits"]["train"]["num_tokens"], "sample0": x.tolist() + y[-1:].tolist(),
        "val0": vx.tolist(), "data_dir": str(data_dir)}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])
