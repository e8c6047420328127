"""Synthetic length-generalisation tasks over the bytes vocabulary, generated on the fly.

A sample is ``length`` input ids and ``length`` target ids (the next token at each position,
as in language modelling) where every target is -1 (ignored by the model's cross-entropy,
``ignore_index=-1``) except at the answer tokens. It is a pure function of
(task, options, split, seed, index, length[, depth]): no files, nothing cached, the same
on every machine. ``split`` (train / val / test) selects independent streams.

Token layout (ids = bytes; the structural markers are ASCII control bytes that no task's
text alphabet contains, and 0x1E, the bytes tokenizer's document separator, is not used):

==========  =====  ==========================================================================
name        id     meaning
==========  =====  ==========================================================================
PAD         0x00   one leading pad where a task's layout needs an even or odd total length
NEEDLE      0x1C   passkey, multi_key, multi_value: marks a needle; variable_tracking: an assignment
SEP         0x1D   copy, selective_copy: end of the sequence to copy; assoc_recall: end of the pairs
QUERY       0x1F   the question of passkey, counting, indirect_indexing, multi_key, multi_value and
                   variable_tracking; the answer follows it
==========  =====  ==========================================================================

``seq`` below has ``length + 1`` ids; inputs are ``seq[:-1]``, targets ``seq[1:]`` masked to
the answers (so the last answer token is a target, never an input):

- ``passkey`` (Mohtashami & Jaggi 2023): filler text (the paper's sentences, repeated),
  with ``NEEDLE k1..kK`` inserted at ``depth`` (0 = first token, 1 = right before the
  question), then ``QUERY k1..kK``. Key: ``key_length`` random digits '0'-'9'. Answer: the K
  digits after QUERY. Depth None draws it uniformly in [0, 1] per sample.
- ``niah`` (needle in a haystack over real text, after Kamradt's NIAH and the YaRN authors'
  remark that filler passkey is much easier): an excerpt of the embedded Gutenberg corpus
  (``haystack``: the training split for ``train`` samples, the held-out split for ``val`` and
  ``test``), with the needle sentence `` The pass key is k1..kK.`` inserted at ``depth`` (at
  the word break before it), then ``NIAH_QUESTION k1..kK``. Answer: the K digits. No marker
  ids: the model has to find the sentence in prose.
- ``copy``: ``[PAD] r1..rn SEP r1..rn``, n = length // 2, r uniform over 'a'-'z'.
  Answer: the second r1..rn.
- ``assoc_recall`` (multi-query associative recall, Arora et al. 2023, "Zoology"):
  ``num_pairs`` pairs "KEY value" (distinct keys 'A'-'Z', values '0'-'9') at random
  non-overlapping places in random filler 'a'-'z', then ``SEP`` and ``num_queries`` distinct
  keys of those pairs, each followed by its value. Answer: the values after the queried keys.
- ``flipflop`` (Liu et al. 2023, "Exposing Attention Glitches with Flip-Flop Language
  Modeling"): ``[PAD]`` then instruction-bit pairs: 'w' b writes bit b, 'i' b is ignored,
  'r' b reads, b = the last written bit ('0'/'1'). The first instruction is 'w', the last
  'r', the others 'i' with probability ``p_ignore`` and 'w' or 'r' with (1 - p_ignore)/2
  each (FFL(p_ignore); the paper's default 0.8). Answer: the bit after every 'r'.
- ``counting`` (Golovneva et al. 2024, CoPE's counting task, after RAM's ``count_data_gen.py``):
  ``[PAD]`` then two-token statements over ``num_vars`` variables 'a', 'b', ...: ``v=`` sets v
  to 0, ``v+`` adds 1 to v, ``..`` does nothing, drawn with RAM's odds 1 : 7 : 50; then
  ``QUERY v c``. The first statement is a set; a set takes any variable, an increment one of
  those set so far and below 9 (none: a pass), the question one set so far. Answer: c, v's
  count of ``v+`` since its last ``v=`` (one digit; RAM's cap is 10). The variable-and-program
  variant rather than "count the x's": the count must select by variable and reset.
- ``selective_copy`` (Gu & Dao 2023, Mamba's selective copying): ``num_tokens`` data tokens
  'a'-'z' at random places among noise tokens '.', then ``SEP`` and the data tokens in order.
  Answer: the copy.
- ``indirect_indexing`` (Gopalakrishnan et al. 2025, PoPE's diagnostic: index by content, then
  by position): a string of 'a'-'z' in which the anchor letter occurs exactly once (the others
  are drawn from the other 25, so the string can be any length), then ``QUERY a d j``: anchor
  a, direction d ('+' right, '-' left), offset j in 1..``max_offset`` (uniform, each way
  equally likely; the anchor's place is uniform among those that keep the target inside).
  Answer: the letter j places from a in direction d.
- ``multi_key`` (RULER's multi-key NIAH, Hsieh et al. 2024): ``num_needles`` needles
  ``NEEDLE K v1..vk`` (distinct keys 'A'-'Z', values of ``key_length`` digits) in the passkey
  filler, the asked one at ``depth``, the others at uniform depths; then ``QUERY K v1..vk``.
  Answer: the asked key's value.
- ``multi_value`` (RULER's multi-value NIAH): ``num_needles`` needles ``NEEDLE K v1..vk`` of one
  key at uniform depths, then ``QUERY K`` and every value, in the order of the text. Answer:
  all the values. No depth (every needle is asked).
- ``variable_tracking`` (RULER's variable tracking): ``num_chains`` chains of ``num_hops + 1``
  distinct variables 'A'-'Z', ``NEEDLE X1 v1..vk`` (X1 = a value of ``key_length`` digits,
  distinct between chains) then ``NEEDLE X2 X1`` ... ``NEEDLE Xh+1 Xh`` (each = the previous),
  each chain's assignments in order at uniform depths of the passkey filler; then ``QUERY
  v1..vk`` and the variables of the chain that holds that value, in chain order. Answer: the
  variables. No depth (the chain is spread over the context).
- ``state_tracking``, ``graphwalks``, ``babilong``, ``multi_query``, ``common_words``,
  ``find_block``, ``latent_list``, ``frequent_words``: the 2025–26 long-context tasks, laid out in data/tasks_2025.py (``state_tracking``'s targets label the
  inputs rather than being the next tokens; ``graphwalks``, ``common_words`` and ``frequent_words``
  answer sets, scored by exact match and F1).

The harness's ``SyntheticDataModule`` (pelab/datamodule.py) serves training samples of length
``block_size`` keyed by the global sample index, as text data is (data/stream.py: sample g of
the ``train`` stream is the run's g-th sample over all ranks, so a run resumed on another
number of ranks continues the same stream, and one rank trains on the samples it did when the
key was (rank, per-rank index)) and a fixed validation set; ``evaluation/tasks.py`` measures
accuracy at longer lengths on the ``test`` stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch.utils.data import Dataset

from data import tasks_2025
from data.task_parts import (DIGITS, FILLER, LOWER, NEEDLE, PAD, QUERY, SEP, SPECIAL_IDS, UPPER, _ids,  # noqa: F401
                             _in_filler, haystack)
from model.config import require

VOCAB_SIZE = 256
WRITE, IGNORE, READ = ord("w"), ord("i"), ord("r")
SET_ZERO, INCREMENT, PASS = ord("="), ord("+"), ord(".")  # counting: "v=" sets v to 0, "v+" adds 1, ".." passes
#: counting: relative odds of set, pass and increment statements (RAM's count_data_gen.py OP_WEIGHTS)
COUNT_ODDS = np.array([1, 50, 7]) / 58
MAX_COUNT = 9  # counting: an increment never takes a variable past it, so the answer is one digit
NOISE = ord(".")  # selective_copy: the blank between the data tokens
LEFT, RIGHT = ord("-"), ord("+")  # indirect_indexing: the direction of the offset
NIAH_NEEDLE = b" The pass key is "  # + key + NIAH_END
NIAH_END = b"."  # the haystack after it starts at a word break (a space)
NIAH_QUESTION = b"\nWhat is the pass key? The pass key is "
TaskName = Literal["passkey", "copy", "assoc_recall", "flipflop", "niah", "counting", "selective_copy",
                   "indirect_indexing", "multi_key", "multi_value", "variable_tracking", "state_tracking",
                   "graphwalks", "babilong", "multi_query", "common_words", "find_block", "latent_list",
                   "frequent_words"]
TASKS: tuple[str, ...] = TaskName.__args__
SPLITS = ("train", "val", "test")
_TASK_CODE = {name: code for code, name in enumerate(TASKS, start=1)}  # fixed: changing one changes every sample


@dataclass(frozen=True)
class Task:
    """A task and its options (only the named task's options are used). Validated on creation;
    errors name the option as ``data.KEY``, the value and what is allowed."""

    name: str = "passkey"
    key_length: int = 5  # passkey, niah: digits in the key
    num_pairs: int = 8  # assoc_recall: key-value pairs (<= 26 distinct keys)
    num_queries: int = 4  # assoc_recall: queried keys (<= num_pairs)
    p_ignore: float = 0.8  # flipflop: probability of an 'i' instruction (FFL(p))
    num_vars: int = 3  # counting: variables 'a', 'b', ... (<= 26)
    num_tokens: int = 16  # selective_copy: data tokens to copy
    max_offset: int = 5  # indirect_indexing: offsets are 1 .. max_offset either way (<= 9, one digit)
    num_needles: int = 4  # multi_key, multi_value: needles in the filler (<= 26 distinct keys)
    num_chains: int = 1  # variable_tracking: chains of assignments (one asked, the others distractors)
    num_hops: int = 4  # variable_tracking: assignments after the first in each chain
    group: str = "S5"  # state_tracking: the permutation group (data/tasks_2025.py's GROUPS)
    walk_depth: int = 2  # graphwalks: breadth-first searches go 1 .. walk_depth deep (one digit)
    max_answer: int = 6  # graphwalks: nodes in an answer at most (queries with more are not asked)
    qa: int = 1  # babilong: bAbI task 1, 2 or 3 (supporting facts)
    num_facts: int = 4  # babilong: fact sentences in the text (the supporting ones and distractors)
    num_common: int = 3  # common_words: words more frequent than the others; frequent_words: top words asked
    block_length: int = 5  # find_block: distinct letters in a block (MTA's N = 5)
    query_length: int = 2  # find_block: letters of the target block asked (MTA's L = 2)
    num_ops: int = 4  # latent_list: operations on the asked list (the others act on a distractor list)
    alpha: float = 2.0  # frequent_words: the Zipf exponent of the word counts (RULER's fwe: 2.0)

    def __post_init__(self) -> None:
        require(self.name in TASKS, "data.task", self.name, f"one of {', '.join(TASKS)}")
        for key in ("key_length", "num_pairs", "num_queries", "num_vars", "num_tokens", "max_offset", "num_needles",
                    "num_chains", "num_hops", "walk_depth", "max_answer", "qa", "num_facts", "num_common", "block_length",
                    "query_length", "num_ops"):
            value = getattr(self, key)
            require(isinstance(value, int) and not isinstance(value, bool) and value >= 1, f"data.{key}", value,
                    "an integer >= 1")
        require(self.num_pairs <= 26, "data.num_pairs", self.num_pairs, "<= 26 (distinct keys 'A'-'Z')")
        require(self.num_queries <= self.num_pairs, "data.num_queries", self.num_queries,
                f"<= data.num_pairs={self.num_pairs} (queried keys are distinct)")
        require(isinstance(self.p_ignore, (int, float)) and 0 <= self.p_ignore < 1, "data.p_ignore", self.p_ignore,
                "a number in [0, 1)")
        require(self.num_vars <= 26, "data.num_vars", self.num_vars, "<= 26 (variables 'a'-'z')")
        require(self.max_offset <= 9, "data.max_offset", self.max_offset, "<= 9 (the offset is one digit)")
        require(self.num_needles <= 26, "data.num_needles", self.num_needles, "<= 26 (distinct keys 'A'-'Z')")
        names = 26 // (self.num_hops + 1)
        require(self.num_chains <= names, "data.num_chains", self.num_chains,
                f"<= {names} (num_chains x (data.num_hops={self.num_hops} + 1) distinct variables 'A'-'Z')")
        require(self.num_chains <= 10**min(self.key_length, 3), "data.num_chains", self.num_chains,
                f"<= {10**min(self.key_length, 3)} (distinct values of data.key_length={self.key_length} digits)")
        require(self.group in tasks_2025.GROUPS, "data.group", self.group,
                f"one of {', '.join(tasks_2025.GROUPS)} (symmetric and alternating groups whose elements fit one id "
                "each)")
        require(self.walk_depth <= 9, "data.walk_depth", self.walk_depth, "<= 9 (the depth is one digit)")
        require(self.max_answer <= 128, "data.max_answer", self.max_answer, "<= 128 (a graph's nodes at most)")
        require(self.qa <= 3, "data.qa", self.qa, "1, 2 or 3 (bAbI's qa1-qa3)")
        require(self.num_facts >= self.qa, "data.num_facts", self.num_facts,
                f">= data.qa={self.qa} (the supporting facts of qa{self.qa})")
        require(self.block_length <= 26, "data.block_length", self.block_length, "<= 26 (distinct letters 'a'-'z')")
        require(self.query_length <= self.block_length, "data.query_length", self.query_length,
                f"<= data.block_length={self.block_length} (the letters asked are the target block's)")
        require(isinstance(self.alpha, (int, float)) and not isinstance(self.alpha, bool) and 1 < self.alpha <= 4,
                "data.alpha", self.alpha, "a number in (1, 4] (the Zipf exponent of frequent_words, RULER's 2.0: "
                "the counts k^-alpha / zeta(alpha) need alpha > 1)")
        if self.name == "multi_query":  # assoc_recall's num_queries is bound by num_pairs instead
            require(self.num_queries <= self.num_needles, "data.num_queries", self.num_queries,
                    f"<= data.num_needles={self.num_needles} (asked keys are distinct needles)")

    @property
    def min_length(self) -> int:
        """The shortest input length whose layout fits."""
        if self.name in tasks_2025.LAYOUTS:
            return tasks_2025.min_length(self)
        k, needles = self.key_length, self.num_needles
        niah = len(NIAH_NEEDLE) + len(NIAH_END) + len(NIAH_QUESTION) + 2 * k - 1
        chains = self.num_chains * (2 + k + 3 * self.num_hops) + k + self.num_hops + 1
        return {"passkey": 2 * k + 1, "copy": 2, "niah": niah,
                "assoc_recall": 2 * self.num_pairs + 2 * self.num_queries, "flipflop": 3, "counting": 4,
                "selective_copy": 2 * self.num_tokens, "indirect_indexing": self.max_offset + 5,
                "multi_key": needles * (k + 2) + k + 1, "multi_value": needles * (2 * k + 2) + 1,
                "variable_tracking": chains}[self.name]

    @property
    def max_length(self) -> int | None:
        """The longest input length whose layout fits (None: any)."""
        return tasks_2025.max_length(self)

    @property
    def set_valued(self) -> bool:
        """The answer is a set (elements, then an end marker): scored by F1 beside exact match."""
        return self.name in tasks_2025.SET_ELEMENT_WIDTH

    @property
    def has_depth(self) -> bool:
        """Retrieval tasks: the fact sits at a chosen depth (accuracy grids are depth x length)."""
        return self.name in DEPTH_TASKS

    def sample(self, length: int, index: int, seed: int = 0, split: str = "train", rank: int = 0,
               depth: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets), both int64 of exactly ``length``; targets -1 except at answers.
        ``rank`` selects another independent stream; pelab draws every sample with rank 0 (the
        training stream's ``index`` is the global sample index, which already tells ranks apart)."""
        require(split in SPLITS, "split", split, f"one of {', '.join(SPLITS)}")
        require(isinstance(length, (int, np.integer)) and length >= self.min_length, "length", length,
                f"an integer >= {self.min_length} (the shortest {self.name} sample)")
        longest = self.max_length
        require(longest is None or length <= longest, "length", length,
                f"an integer <= {longest} (the longest {self.name} sample with these options)")
        for key, value in (("seed", seed), ("rank", rank), ("index", index)):
            require(int(value) == value and value >= 0, key, value, "an integer >= 0")
        if depth is not None:
            require(self.has_depth, "depth", depth, f"null for task={self.name} (only {', '.join(DEPTH_TASKS)} "
                    "have a depth)")
            require(0 <= depth <= 1, "depth", depth, "a number in [0, 1] (0 = start, 1 = right before the question)")
        # Every stream its own generator: numpy hashes the whole tuple (SeedSequence), so
        # neighbouring seeds or indices give unrelated samples.
        rng = np.random.default_rng([_TASK_CODE[self.name], SPLITS.index(split), int(seed), int(rank), int(index),
                                     int(length)])
        if self.name in tasks_2025.LAYOUTS:
            laid = tasks_2025.LAYOUTS[self.name](self, rng, int(length) + 1, depth, split)
            if isinstance(laid, tasks_2025.Labelled):  # targets label the inputs
                assert len(laid.inputs) == len(laid.targets) == length, (self.name, len(laid.inputs), length)
                return laid.inputs.astype(np.int64), laid.targets.astype(np.int64)
            seq, answers = laid
        elif self.name == "niah":  # its haystack depends on the split (held-out text outside training)
            seq, answers = self._niah(rng, int(length) + 1, depth, split)
        else:
            seq, answers = getattr(self, f"_{self.name}")(rng, int(length) + 1, depth)
        assert len(seq) == length + 1 and answers[-1] == length, (self.name, len(seq), length)  # the answer is whole
        targets = np.full(length, -1, dtype=np.int64)
        targets[answers - 1] = seq[answers]  # target t predicts seq[t + 1]
        return seq[:-1].astype(np.int64), targets

    # Each layout returns (seq of n = length + 1 ids, indices in seq of the answer tokens).

    def _passkey(self, rng: np.random.Generator, n: int, depth: float | None):
        k = self.key_length
        key = rng.integers(0, 10, k) + DIGITS  # drawn first: a sample has the same key at every depth
        depth = rng.random() if depth is None else depth
        filler = FILLER[np.arange(n - 2 * (k + 1)) % len(FILLER)]
        at = int(round(depth * len(filler)))
        seq = np.concatenate([filler[:at], [NEEDLE], key, filler[at:], [QUERY], key])
        return seq, np.arange(n - k, n)

    def _niah(self, rng: np.random.Generator, n: int, depth: float | None, split: str):
        k = self.key_length
        key = rng.integers(0, 10, k) + DIGITS  # drawn first: a sample has the same key at every depth
        depth = rng.random() if depth is None else depth
        needle = np.concatenate([_ids(NIAH_NEEDLE), key, _ids(NIAH_END)])
        question = _ids(NIAH_QUESTION)
        text = haystack("train" if split == "train" else "val")
        size = n - len(needle) - len(question) - k
        start = int(rng.integers(0, len(text) - size))
        hay = text[start : start + size]
        at = int(round(depth * size))
        if 0 < at < size:  # to the word break at or before it, so the needle never splits a word
            spaces = np.flatnonzero(hay[:at] == ord(" "))
            at = int(spaces[-1]) if len(spaces) else at
        seq = np.concatenate([hay[:at], needle, hay[at:], question, key])
        return seq, np.arange(n - k, n)

    def _copy(self, rng: np.random.Generator, n: int, depth: None):
        m = (n - 1) // 2
        payload = rng.integers(0, 26, m) + LOWER
        seq = np.concatenate([[PAD] * (n - 1 - 2 * m), payload, [SEP], payload])
        return seq, np.arange(n - m, n)

    def _assoc_recall(self, rng: np.random.Generator, n: int, depth: None):
        p, q = self.num_pairs, self.num_queries
        span = n - 1 - 2 * q  # the pairs-and-filler section
        keys = rng.choice(26, p, replace=False) + UPPER
        values = rng.integers(0, 10, p) + DIGITS
        section = rng.integers(0, 26, span) + LOWER
        # Choose which p of the (span - p) items (p pairs + span - 2p filler tokens) are pairs;
        # pair i then starts at its item index + i (each earlier pair is one token longer).
        starts = np.sort(rng.choice(span - p, p, replace=False)) + np.arange(p)
        section[starts], section[starts + 1] = keys, values
        asked = rng.choice(p, q, replace=False)
        queries = np.stack([keys[asked], values[asked]], axis=1).reshape(-1)
        seq = np.concatenate([section, [SEP], queries])
        return seq, span + 2 + 2 * np.arange(q)

    def _flipflop(self, rng: np.random.Generator, n: int, depth: None):
        m = n // 2  # instruction-bit pairs
        pad = n - 2 * m
        p_rw = (1 - self.p_ignore) / 2
        ops = rng.choice(np.array([WRITE, IGNORE, READ]), m, p=[p_rw, self.p_ignore, p_rw])
        ops[0], ops[-1] = WRITE, READ
        bits = rng.integers(0, 2, m) + DIGITS
        written = None
        for i, op in enumerate(ops):  # m <= a few thousand: a plain loop is clear and fast enough
            if op == WRITE:
                written = bits[i]
            elif op == READ:
                bits[i] = written
        seq = np.concatenate([[PAD] * pad, np.stack([ops, bits], axis=1).reshape(-1)])
        return seq, pad + 1 + 2 * np.flatnonzero(ops == READ)

    def _counting(self, rng: np.random.Generator, n: int, depth: None):
        m = (n - 3) // 2  # two-token statements before QUERY v count
        pad = n - 3 - 2 * m
        ops = rng.choice(3, m, p=COUNT_ODDS)  # 0 set, 1 pass, 2 increment
        ops[0] = 0  # a variable exists from the start, so an increment and the query always have one
        picks = rng.random(m)  # which variable a set or an increment takes
        count: dict[int, int] = {}  # variable -> increments since its last set
        statements = np.full((m, 2), PASS)
        for i, (op, u) in enumerate(zip(ops, picks)):  # m <= a few thousand: a plain loop is clear and fast enough
            if op == 0:
                var = int(u * self.num_vars)
                count[var] = 0
                statements[i] = LOWER + var, SET_ZERO
            elif op == 2:
                open_vars = [v for v in sorted(count) if count[v] < MAX_COUNT]
                if open_vars:  # else a pass: every variable set so far is at MAX_COUNT
                    var = open_vars[int(u * len(open_vars))]
                    count[var] += 1
                    statements[i] = LOWER + var, INCREMENT
        asked = sorted(count)[int(rng.integers(len(count)))]
        seq = np.concatenate([[PAD] * pad, statements.reshape(-1), [QUERY, LOWER + asked, DIGITS + count[asked]]])
        return seq, np.array([n - 1])

    def _selective_copy(self, rng: np.random.Generator, n: int, depth: None):
        k = self.num_tokens
        span = n - 1 - k  # noise with the data tokens in it
        data = rng.integers(0, 26, k) + LOWER
        section = np.full(span, NOISE)
        section[np.sort(rng.choice(span, k, replace=False))] = data
        return np.concatenate([section, [SEP], data]), np.arange(n - k, n)

    def _indirect_indexing(self, rng: np.random.Generator, n: int, depth: None):
        m = n - 5  # the string, then QUERY anchor direction offset answer
        anchor = int(rng.integers(0, 26))
        string = rng.integers(0, 25, m)
        string += string >= anchor  # every letter but the anchor's, so the anchor occurs once
        offset = int(rng.integers(1, self.max_offset + 1)) * (1 if rng.random() < 0.5 else -1)
        at = int(rng.integers(max(0, -offset), m - max(0, offset)))  # the target lies inside the string
        string[at] = anchor
        string += LOWER
        direction = RIGHT if offset > 0 else LEFT
        seq = np.concatenate([string, [QUERY, LOWER + anchor, direction, DIGITS + abs(offset), string[at + offset]]])
        return seq, np.array([n - 1])

    def _multi_key(self, rng: np.random.Generator, n: int, depth: float | None):
        k, count = self.key_length, self.num_needles
        keys = rng.choice(26, count, replace=False) + UPPER  # needle 0 is the one asked
        values = rng.integers(0, 10, (count, k)) + DIGITS
        places = rng.random(count)  # drawn before the depth: a sample has the same needles at every depth
        places[0] = rng.random() if depth is None else depth
        needles = [np.concatenate([[NEEDLE, key], value]) for key, value in zip(keys, values)]
        hay = _in_filler(needles, places, n - count * (k + 2) - 2 - k)
        return np.concatenate([hay, [QUERY, keys[0]], values[0]]), np.arange(n - k, n)

    def _multi_value(self, rng: np.random.Generator, n: int, depth: None):
        k, count = self.key_length, self.num_needles
        key = int(rng.integers(0, 26)) + UPPER
        values = rng.integers(0, 10, (count, k)) + DIGITS
        places = np.sort(rng.random(count))  # needle i is the i-th in the text: the answer lists them in order
        needles = [np.concatenate([[NEEDLE, key], value]) for value in values]
        hay = _in_filler(needles, places, n - count * (2 * k + 2) - 2)
        return np.concatenate([hay, [QUERY, key], values.reshape(-1)]), np.arange(n - count * k, n)

    def _variable_tracking(self, rng: np.random.Generator, n: int, depth: None):
        k, chains, hops = self.key_length, self.num_chains, self.num_hops
        names = rng.choice(26, (chains, hops + 1), replace=False) + UPPER  # chain 0 is the one asked
        values = rng.integers(0, 10, (chains, k)) + DIGITS
        while len({tuple(v) for v in values}) < chains:  # distinct values: the question names one chain
            values = rng.integers(0, 10, (chains, k)) + DIGITS
        places = np.sort(rng.random((chains, hops + 1)), axis=1)  # each chain's assignments in order
        statements = [[np.concatenate([[NEEDLE, names[c, 0]], values[c]])]
                      + [np.array([NEEDLE, names[c, h], names[c, h - 1]]) for h in range(1, hops + 1)]
                      for c in range(chains)]
        size = chains * (2 + k + 3 * hops)
        hay = _in_filler([s for chain in statements for s in chain], places.reshape(-1), n - size - 1 - k - hops - 1)
        return np.concatenate([hay, [QUERY], values[0], names[0]]), np.arange(n - hops - 1, n)


DEPTH_TASKS = ("passkey", "niah", "multi_key", "find_block")


class TaskSamples(Dataset):
    """Samples 0 .. count - 1 of one task's ``split`` stream, as (inputs, targets) tensors; for
    training, index g is the global sample index (data/stream.py's ``GlobalSamples`` picks each
    rank's)."""

    def __init__(self, task: Task, length: int, count: int, seed: int, split: str, depth: float | None = None,
                 length_of=None) -> None:
        self.task, self.length, self.count = task, length, count
        self.seed, self.split, self.depth = seed, split, depth
        self.length_of = length_of  # sample index -> its length (a curriculum); None: always ``length``

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        length = self.length if self.length_of is None else self.length_of(g)
        x, y = self.task.sample(length, g, self.seed, self.split, 0, self.depth)
        return torch.from_numpy(x), torch.from_numpy(y)


__all__ = ["Task", "TaskSamples", "TASKS", "SPECIAL_IDS", "VOCAB_SIZE"]
