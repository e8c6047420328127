"""The LightningDataModules: the data of data/ wired to the Trainer.

Training batches are windows of the training stream (data/stream.py): sample ``g`` is a pure
function of (seed, ``data.sampling``, g), where ``g`` counts samples over the whole run, all
ranks together, so every DDP rank sees different text and a run resumed on any number of
ranks continues the exact sequence. Validation uses ``val_windows`` windows spread evenly
over the whole held-out split (data/val_windows.py), the same in every run. The token files
are built by data/cache.py (``prepare_token_files``); synthetic tasks by data/synthetic.py.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import hydra
import lightning as L
import numpy as np
import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, Dataset

from data.cache import prepare_token_files, with_offsets
from data.lock import LOCK_TIMEOUT, check_timeout
from data.packing import DocumentOptions, check_document_options
from data.shards import token_source, with_part_offsets
from data.stream import GlobalSamples, TrainWindows, check_sampling, load_tokens
from data.synthetic import DEPTH_TASKS, VOCAB_SIZE, Task, TaskName, TaskSamples
from data.tokenizers import Tokenizer, cache_dir, get_tokenizer, tokenizer_file, tokenizer_slug
from data.val_windows import IgnoredPadding, RankShard, ValidationWindows
from model.config import require

#: The ``_target_`` a run config saved beside older checkpoints gives its data module, and the
#: class it names now: evaluating such a run builds the same data.
FORMER_TARGETS = {
    "data.datamodule.TextDataModule": "pelab.datamodule.TextDataModule",
    "data.datamodule.TextFilesDataModule": "pelab.datamodule.TextFilesDataModule",
    "data.synthetic.SyntheticDataModule": "pelab.datamodule.SyntheticDataModule",
}


def build_datamodule(options) -> L.LightningDataModule:
    """The data module of a ``data`` config (train.py and the scripts): every option but
    ``tokens_per_step``, which sets the trainer's gradient accumulation (pelab/batch.py)."""
    values = data_options(options)
    values.pop("tokens_per_step", None)
    return hydra.utils.instantiate(values, _convert_="all")


def data_options(options) -> dict:
    """A ``data`` config as a plain dict, resolved, its ``_target_`` in today's spelling."""
    values = OmegaConf.to_container(options, resolve=True) if OmegaConf.is_config(options) else dict(options)
    target = values.get("_target_")
    if target in FORMER_TARGETS:
        values["_target_"] = FORMER_TARGETS[target]
    return values


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
        lock_timeout: float = LOCK_TIMEOUT,
    ) -> None:
        super().__init__()
        check_document_options(document_positions, document_mask, corpus)
        self.lock_timeout = check_timeout(lock_timeout)  # seconds to wait for another builder of the cache
        check_sampling(sampling)
        self.sampling = sampling
        # prepare_data on global rank 0 only (Lightning's default is local rank 0 of every node):
        # caches sit on a filesystem the nodes share ($PELAB_CACHE, data.data_dir). Rank 0's check
        # is the only one that reads the corpus files; setup() hands its verdict to the others
        # (``cache_for_this_rank``). A node-local data_dir still works: a rank whose meta.json is
        # not the one rank 0 found valid checks the cache itself, and the first on a node to find
        # it missing builds it under the cache's lock while the others wait.
        self.prepare_data_per_node = False
        self._prepared: dict | None = None  # prepare_data's checked cache, for this process's next setup()
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

    def split_path(self, split: str):
        """The split's tokens as ``load_tokens`` reads them: its ``.bin``, or a sharded cache's parts
        (data/shards.py ``token_source``; known once ``setup`` has read the manifest)."""
        return token_source(self.token_dir, self.meta, split)

    def check_cache(self) -> dict:
        """The cache's metadata after checking it against the corpus files (and building it when
        missing or stale): data/cache.py ``prepare_token_files``."""
        return prepare_token_files(self.corpus, self.tokenizer, self.token_dir, self.tokenize_num_proc,
                                   lock_timeout=self.lock_timeout)

    def prepare_data(self) -> None:
        self._prepared = self.check_cache()

    def setup(self, stage: str | None = None) -> None:
        self.meta = self.cache_for_this_rank()
        dtype = self.meta["dtype"]
        self.train_set = TrainWindows(self.split_path("train"), dtype, self.block_size, self.seed, self.sampling)
        self.val_set = ValidationWindows(self.split_path("val"), dtype, self.block_size, self.val_windows)

    def cache_for_this_rank(self) -> dict:
        """The checked cache, read by one process only: global rank 0 uses prepare_data's check
        (or checks now) and broadcasts its verdict, the sha256 of the meta.json it found valid
        (or its error, so the others do not wait for a broadcast that never comes); another rank
        opens the cache from its own meta.json when it is that one, stat-ing no corpus file, and
        otherwise (a node-local data_dir) checks it itself. Alone (no trainer, one process):
        prepare_data's check, else a check now."""
        checked, self._prepared = self._prepared, None
        trainer = self.trainer
        if trainer is None or trainer.world_size == 1:
            return checked if checked is not None else self.check_cache()
        if trainer.global_rank == 0:
            try:
                meta = checked if checked is not None else self.check_cache()
                verdict = ("valid", meta_digest(self.token_dir))
            except BaseException as err:
                trainer.strategy.broadcast(("failed", f"{type(err).__name__}: {err}"), src=0)
                raise
            trainer.strategy.broadcast(verdict, src=0)
            return meta
        kind, value = trainer.strategy.broadcast(None, src=0)
        if kind == "failed":
            raise RuntimeError(f"global rank 0 could not prepare the token cache {self.token_dir}: {value}")
        meta = opened_if_same(self.token_dir, value)
        return meta if meta is not None else self.check_cache()

    def unigram_loss(self, max_tokens: int = 50_000_000) -> float:
        """Cross-entropy (nats) of the train-split unigram distribution on the val split:
        the loss a model with no context would reach. Learning means going well below it.
        Counted on at most ``max_tokens`` of each split, so hub-scale corpora stay quick."""
        meta = self.meta or prepare_token_files(self.corpus, self.tokenizer, self.token_dir)
        train = load_tokens(token_source(self.token_dir, meta, "train"), meta["dtype"])[:max_tokens]
        val = load_tokens(token_source(self.token_dir, meta, "val"), meta["dtype"])[:max_tokens]
        counts = np.bincount(train, minlength=self.vocab_size).astype(np.float64) + 1.0  # add-one smoothing
        logp = np.log(counts / counts.sum())
        return float(-logp[val].mean())


def meta_digest(token_dir: Path) -> str | None:
    """sha256 of a cache's meta.json (None: there is none)."""
    try:
        return hashlib.sha256((Path(token_dir) / "meta.json").read_bytes()).hexdigest()
    except FileNotFoundError:
        return None


def opened_if_same(token_dir: Path, digest: str | None) -> dict | None:
    """The cache's metadata from its meta.json, read as it is (no corpus file touched), when that
    file's sha256 is ``digest`` (what global rank 0 checked); else None."""
    path = Path(token_dir) / "meta.json"
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return None
    if digest is None or hashlib.sha256(text).hexdigest() != digest:
        return None
    meta = json.loads(text)
    sharded = "parts" in meta["splits"]["train"]  # data/shards.py's manifest; else one .bin per split
    return with_part_offsets(meta, token_dir) if sharded else with_offsets(meta, token_dir)


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


class SyntheticDataModule(StreamDataModule):
    """Training samples of ``block_size``: sample g of the ``train`` stream for the run's global
    sample g (the loader, its resume and the checkpointed count are ``StreamDataModule``'s, as
    for text); ``val_samples`` fixed validation samples (the ``val`` stream: the same in every
    run, resume and rank).

    There is no held-out text to score perplexity on (niah's haystack is the corpus, but its
    score is retrieval): ``held_out_text`` is False, ``split_path`` refuses with a message, and
    the end of training skips perplexity; ``evaluation/tasks.py`` measures accuracy against
    length (and depth) instead. ``unigram_loss`` is the
    answer-token baseline (see there), so the end-of-run report needs no special case."""

    held_out_text = False

    def __init__(
        self,
        task: TaskName = "passkey",  # a Literal: the config check names the choices before any work
        block_size: int = 128,
        batch_size: int = 32,
        val_batch_size: int | None = None,
        val_samples: int = 256,
        num_workers: int = 0,
        seed: int = 1337,
        train_samples: int = 2**40,
        key_length: int = 5,
        depth: float | None = None,
        num_pairs: int = 8,
        num_queries: int = 4,
        p_ignore: float = 0.8,
        num_vars: int = 3,
        num_tokens: int = 16,
        max_offset: int = 5,
        num_needles: int = 4,
        num_chains: int = 1,
        num_hops: int = 4,
        group: str = "S5",
        walk_depth: int = 2,
        max_answer: int = 6,
        qa: int = 1,
        num_facts: int = 4,
        num_common: int = 3,
        block_length: int = 5,
        query_length: int = 2,
        num_ops: int = 4,
        alpha: float = 2.0,
        curriculum_batches: int = 0,
        curriculum_start: int | None = None,
    ) -> None:
        super().__init__()
        self.task = Task(task, key_length=key_length, num_pairs=num_pairs, num_queries=num_queries, p_ignore=p_ignore,
                         num_vars=num_vars, num_tokens=num_tokens, max_offset=max_offset, num_needles=num_needles,
                         num_chains=num_chains, num_hops=num_hops, group=group, walk_depth=walk_depth,
                         max_answer=max_answer, qa=qa, num_facts=num_facts, num_common=num_common,
                         block_length=block_length, query_length=query_length, num_ops=num_ops, alpha=alpha)
        require(isinstance(block_size, int) and block_size >= self.task.min_length, "data.block_size", block_size,
                f"an integer >= {self.task.min_length} (the shortest {task} sample with these options)")
        for key, value, low in (("batch_size", batch_size, 1), ("val_samples", val_samples, 1),
                                ("num_workers", num_workers, 0), ("seed", seed, 0), ("train_samples", train_samples, 1)):
            require(isinstance(value, int) and value >= low, f"data.{key}", value, f"an integer >= {low}")
        require(val_batch_size is None or (isinstance(val_batch_size, int) and val_batch_size >= 1),
                "data.val_batch_size", val_batch_size, "an integer >= 1 or null (= data.batch_size)")
        if depth is not None:
            require(self.task.has_depth, "data.depth", depth,
                    f"null for data.task={task} (only {', '.join(DEPTH_TASKS)} have a depth)")
            require(isinstance(depth, (int, float)) and 0 <= depth <= 1, "data.depth", depth,
                    "a number in [0, 1] or null (a random depth per sample)")
        require(isinstance(curriculum_batches, int) and curriculum_batches >= 0, "data.curriculum_batches",
                curriculum_batches, "an integer >= 0 (0: every training sample is block_size long)")
        start = curriculum_start if curriculum_start is not None else max(self.task.min_length, block_size // 8)
        require(isinstance(start, int) and self.task.min_length <= start <= block_size, "data.curriculum_start",
                curriculum_start, f"null or an integer in [{self.task.min_length}, data.block_size={block_size}]")
        self.curriculum_batches, self.curriculum_start = curriculum_batches, start
        self.block_size, self.batch_size = block_size, batch_size
        self.val_batch_size = val_batch_size or batch_size
        self.val_samples, self.num_workers, self.seed = val_samples, num_workers, seed
        self.train_samples, self.depth = train_samples, depth
        self.meta = None  # no token files (TextDataModule's meta describes them)
        self.train_set: TaskSamples | None = None
        self.val_set: TaskSamples | None = None

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    def curriculum_length(self, index: int) -> int:
        """Training length of global sample ``index``: the same for a whole batch, growing linearly
        from ``curriculum_start`` to ``block_size`` over the first ``curriculum_batches`` batches
        of ``batch_size`` samples counted over all ranks (the first ``curriculum_batches *
        batch_size`` samples of the run, whatever the rank count; on one rank, its first
        ``curriculum_batches`` micro-batches), then ``block_size``. Short samples first: the key is
        near the question, so retrieval is learned at short range before it has to reach L."""
        batch = index // self.batch_size
        if batch >= self.curriculum_batches:
            return self.block_size
        return self.curriculum_start + (self.block_size - self.curriculum_start) * batch // self.curriculum_batches

    def split_path(self, split: str):
        raise ValueError(f"data.task={self.task.name} is synthetic: there is no {split} text to score perplexity "
                         "on (evaluation/tasks.py measures accuracy vs length and depth instead)")

    def setup(self, stage: str | None = None) -> None:
        self.train_set = TaskSamples(self.task, self.block_size, self.train_samples, self.seed, "train", self.depth,
                                     length_of=self.curriculum_length if self.curriculum_batches else None)
        self.val_set = TaskSamples(self.task, self.block_size, self.val_samples, self.seed, "val", self.depth)

    def unigram_loss(self, samples: int = 2048) -> float:
        """Cross-entropy (nats) of the answer tokens of ``samples`` training samples, as a unigram
        distribution (add-one smoothed), on the validation set's answer tokens: the loss of a
        model that knows which answers are common but reads no context (passkey and assoc_recall
        digits: ln 10; flipflop bits: ln 2)."""
        counts = np.ones(VOCAB_SIZE)
        for i in range(samples):
            _, y = self.task.sample(self.block_size, i, self.seed, "train", 0, self.depth)
            np.add.at(counts, y[y >= 0], 1)
        logp = np.log(counts / counts.sum())
        answers = [y[y >= 0] for y in (self.task.sample(self.block_size, i, self.seed, "val", 0, self.depth)[1]
                                       for i in range(self.val_samples))]
        return float(-logp[np.concatenate(answers)].mean())
