"""Token memmaps and the LightningDataModule.

The token files are built by data/cache.py (``prepare_token_files``).
Training batches are windows of the training stream (data/stream.py): sample ``g`` is a pure
function of (seed, ``data.sampling``, g), where ``g`` counts samples over the whole run, all
ranks together, so every DDP rank sees different text and a run resumed on any number of
ranks continues the exact sequence. Validation uses ``val_windows`` windows
spread evenly over the whole held-out split (every document is represented, not just the
first one), the same in every run.
"""

from __future__ import annotations

import functools
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from data.cache import FORMAT_VERSION, cache_mismatch, prepare_token_files, token_dtype  # noqa: F401
from data.packing import DocumentOptions, check_document_options
from data.stream import GlobalSamples, TrainWindows, check_sampling, load_tokens, splitmix64  # noqa: F401
from data.tokenizers import Tokenizer, cache_dir, get_tokenizer, tokenizer_file, tokenizer_slug


def spread_starts(num_tokens: int, block_size: int, num_windows: int | None) -> np.ndarray:
    """Starts of ``num_windows`` validation windows (block_size inputs + 1 target) spread evenly
    over the whole split, first at 0 and last at the last possible start; never overlapping:
    at most (num_tokens - 1) // block_size windows (None = that many: nearly the whole split).
    A pure function of the split's length, so every run, resume and rank sees the same windows."""
    fit = (num_tokens - 1) // block_size
    count = fit if num_windows is None else min(num_windows, fit)
    if count < 1:
        return np.zeros(0, dtype=np.int64)
    last = num_tokens - 1 - block_size
    # integer arithmetic: exact and platform-independent. Gaps are >= block_size because
    # count <= fit implies last >= (count - 1) * block_size.
    return np.arange(count, dtype=np.int64) * last // max(count - 1, 1)


class ValidationWindows(Dataset):
    """Validation window i (0..N-1) = tokens from ``starts[i]``: ``num_windows`` windows spread
    evenly over the held-out split (``spread_starts``). Indexed 0..N-1 so a sampler can shard
    them across ranks."""

    def __init__(self, path: Path, dtype: str, block_size: int, num_windows: int | None = None):
        self.path, self.dtype, self.block_size = path, dtype, block_size
        self._tokens: np.ndarray | None = None
        n = len(load_tokens(path, dtype))
        self.starts = spread_starts(n, block_size, num_windows)
        if len(self.starts) < 1:
            raise ValueError(f"{path} holds {n} tokens, fewer than one validation window of {block_size + 1}")

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tokens is None:
            self._tokens = load_tokens(self.path, self.dtype)
        s = int(self.starts[i])
        chunk = torch.from_numpy(self._tokens[s : s + self.block_size + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


class RankShard(Sampler):
    """Indices rank, rank + world, ... of a dataset of ``length``: the ranks validate disjoint
    windows that together are every window exactly once (torch's DistributedSampler pads with
    repeats, which would count some windows twice in the token-weighted mean).

    With ``batch_size``, every rank gets the same number of batches: a rank whose share makes
    one batch fewer than the largest share ends with index ``length``, an ignored window
    (``IgnoredPadding``), in a batch of its own. FSDP gathers parameters in every forward, so a
    rank with an extra batch would wait for the others forever (256 windows, 6 ranks, batches
    of 14: 4 batches on ranks 0-3, 3 on ranks 4-5). The other batches are unchanged."""

    def __init__(self, length: int, rank: int, world: int, batch_size: int | None = None) -> None:
        self.indices = list(range(rank, length, world))
        largest = -(-length // world)  # shares differ by at most one window
        if batch_size is not None and -(-len(self.indices) // batch_size) < -(-largest // batch_size):
            self.indices.append(length)  # this share fills whole batches: the padding is alone in its own

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class IgnoredPadding(Dataset):
    """``dataset`` and one more sample at index ``len(dataset)``: the inputs of sample 0 with
    every target ignored (-1), so it is scored on no token (validation losses are
    token-weighted over scored targets)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset) + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i == len(self.dataset):
            x, y = self.dataset[0]
            return x, torch.full_like(y, -1)
        return self.dataset[i]


class StreamDataModule(L.LightningDataModule):
    """Loaders shared by the data modules: ``train_set`` is indexed by the global sample index
    (data/stream.py), and a run resumed on any number of ranks continues it from the count of
    samples consumed, kept in the checkpoint; ``val_set`` is fixed. Subclasses set both in
    ``setup`` and provide ``batch_size``, ``val_batch_size``, ``num_workers`` and ``train_samples``."""

    samples_consumed: int | None = None  # from the checkpoint (load_state_dict); None: from global_step
    _stream_origin: tuple[int, int, int] | None = None  # (samples consumed, global step, global batch)

    def train_dataloader(self) -> DataLoader:
        """This rank's share of the global stream (data/stream.py), from the samples the run has
        consumed: the count saved in the checkpoint, or, for a checkpoint without one, the global
        step times today's global batch (the same thing unless the global batch changed)."""
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        step = trainer.global_step if trainer is not None else 0
        global_batch = self.batch_size * world * (trainer.accumulate_grad_batches if trainer is not None else 1)
        consumed = self.samples_consumed if self.samples_consumed is not None else step * global_batch
        self._stream_origin = (consumed, step, global_batch)
        sampler = GlobalSamples(consumed, rank, world, self.batch_size, self.train_samples)
        return self._loader(self.train_set, self.batch_size, drop_last=True, sampler=sampler)

    def state_dict(self) -> dict:
        """Saved in every checkpoint: the training samples consumed so far, counted from the global
        step (whole optimiser steps), not from the loader, which workers run ahead of."""
        if self._stream_origin is None or self.trainer is None:
            return {}
        consumed, step, global_batch = self._stream_origin
        return {"samples_consumed": consumed + (self.trainer.global_step - step) * global_batch}

    def load_state_dict(self, state: dict) -> None:
        self.samples_consumed = state.get("samples_consumed")

    def val_dataloader(self) -> DataLoader:
        # Under DDP each rank validates its own share of the windows (N ranks: N times the
        # windows per second, not the same ones N times); val/loss is reduced token-weighted.
        # Every rank runs the same number of batches (RankShard: FSDP would hang otherwise).
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self.trainer is not None else (0, 1)
        if world == 1:
            return self._loader(self.val_set, self.val_batch_size, drop_last=False)
        shard = RankShard(len(self.val_set), rank, world, self.val_batch_size)
        return self._loader(IgnoredPadding(self.val_set), self.val_batch_size, drop_last=False, sampler=shard)

    def _loader(self, dataset: Dataset, batch_size: int, drop_last: bool, sampler=None) -> DataLoader:
        return DataLoader(
            dataset, batch_size=batch_size, shuffle=False, drop_last=drop_last, sampler=sampler,
            num_workers=self.num_workers, persistent_workers=self.num_workers > 0,
            pin_memory=torch.cuda.is_available(),
        )


class TextDataModule(StreamDataModule):
    held_out_text = True  # a held-out split to score perplexity on (synthetic tasks have none)

    def __init__(
        self,
        corpus,
        tokenizer: str = "bytes",
        block_size: int = 256,
        batch_size: int = 16,
        val_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int = 1337,
        data_dir: str | None = None,
        train_samples: int = 2**40,
        tokenize_num_proc: int | None = None,
        val_windows: int | None = 256,
        document_positions: bool = False,
        document_mask: bool = False,
        sampling: str = "random",
    ) -> None:
        super().__init__()
        check_document_options(document_positions, document_mask, corpus)
        check_sampling(sampling)
        self.sampling = sampling
        # prepare_data on global rank 0 only (Lightning's default is local rank 0 of every node):
        # caches sit on a filesystem the nodes share ($PELAB_CACHE, data.data_dir). A node-local
        # data_dir still works: every rank's setup() checks the cache, and the first on a node
        # to find it missing builds it under the cache's lock while the others wait.
        self.prepare_data_per_node = False
        self.document_positions, self.document_mask = document_positions, document_mask
        for key, value, low in (("batch_size", batch_size, 1), ("val_batch_size", val_batch_size, 1),
                                ("num_workers", num_workers, 0), ("tokenize_num_proc", tokenize_num_proc, 1)):
            if value is not None and value < low:
                raise ValueError(f"data.{key} must be >= {low}, got {value!r}")
        tokenizer_file(tokenizer)  # a registered name or an existing tokenizer file, else one line naming data.tokenizer
        if val_windows is not None and (isinstance(val_windows, bool) or not isinstance(val_windows, int)
                                        or val_windows < 1):
            raise ValueError(f"data.val_windows must be a positive integer (windows spread over the held-out "
                             f"split) or null (every non-overlapping window), got {val_windows!r}")
        self.val_windows = val_windows
        self.corpus = corpus
        self.tokenizer_name = tokenizer
        self.block_size, self.batch_size = block_size, batch_size
        self.val_batch_size = val_batch_size or batch_size
        self.num_workers, self.seed, self.train_samples = num_workers, seed, train_samples
        self.tokenize_num_proc = tokenize_num_proc  # tokenizer threads for big corpora (data/cache.py)
        root = Path(data_dir) if data_dir else cache_dir() / "data"
        self.token_dir = root / corpus.cache_name / tokenizer_slug(tokenizer)
        self.meta: dict | None = None
        self.train_set: TrainWindows | None = None
        self.val_set: ValidationWindows | None = None

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """Loaded on first use (gpt2 may fetch its ranks), so building the module reads nothing."""
        return get_tokenizer(self.tokenizer_name)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def documents(self) -> DocumentOptions:
        """``data.document_positions`` / ``document_mask`` and the separator they read (data/packing.py)."""
        separate = getattr(self.corpus, "rows_are_documents", True)
        return DocumentOptions(self.document_positions, self.document_mask,
                               self.tokenizer.eot_token if separate else None)

    def split_path(self, split: str) -> Path:
        return self.token_dir / f"{split}.bin"

    def prepare_data(self) -> None:
        prepare_token_files(self.corpus, self.tokenizer, self.token_dir, self.tokenize_num_proc)

    def setup(self, stage: str | None = None) -> None:
        self.meta = prepare_token_files(self.corpus, self.tokenizer, self.token_dir, self.tokenize_num_proc)
        dtype = self.meta["dtype"]
        self.train_set = TrainWindows(self.split_path("train"), dtype, self.block_size, self.seed, self.sampling)
        self.val_set = ValidationWindows(self.split_path("val"), dtype, self.block_size, self.val_windows)

    def unigram_loss(self, max_tokens: int = 50_000_000) -> float:
        """Cross-entropy (nats) of the train-split unigram distribution on the val split:
        the loss a model with no context would reach. Learning means going well below it.
        Counted on at most ``max_tokens`` of each split, so hub-scale corpora stay quick."""
        meta = self.meta or prepare_token_files(self.corpus, self.tokenizer, self.token_dir)
        train = load_tokens(self.split_path("train"), meta["dtype"])[:max_tokens]
        val = load_tokens(self.split_path("val"), meta["dtype"])[:max_tokens]
        counts = np.bincount(train, minlength=self.vocab_size).astype(np.float64) + 1.0  # add-one smoothing
        logp = np.log(counts / counts.sum())
        return float(-logp[val].mean())


class TextFilesDataModule(TextDataModule):
    """``data=text``: a TextDataModule over the user's files (``data.corpus.TextFilesCorpus``).
    The corpus options sit at ``data.*`` so the command line stays short
    (``data=text data.paths=[corpus/]``); conf/data/text.yaml passes them to ``data.corpus`` by
    interpolation, where they are checked and used. Here they are only recorded."""

    def __init__(
        self,
        corpus,
        paths: list[str] | str,
        text_field: str = "text",
        val_fraction: float = 0.05,
        text_sample_by: str = "document",
        **options,
    ) -> None:
        super().__init__(corpus, **options)  # the TextDataModule options, checked against its signature
        self.paths, self.text_field = paths, text_field
        self.val_fraction, self.text_sample_by = val_fraction, text_sample_by


def build_datamodule(options) -> L.LightningDataModule:
    """The data module of a ``data`` config (train.py and the scripts): every option but
    ``tokens_per_step``, which sets the trainer's gradient accumulation (pelab/batch.py)."""
    import hydra
    from omegaconf import OmegaConf

    values = OmegaConf.to_container(options, resolve=True) if OmegaConf.is_config(options) else dict(options)
    values.pop("tokens_per_step", None)
    return hydra.utils.instantiate(values, _convert_="all")
