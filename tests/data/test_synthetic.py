"""data/synthetic.py: task layouts, determinism and the data module, each checked against an
independent naive reading of the bytes."""

import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from data.synthetic import NEEDLE, PAD, QUERY, SEP, Task
from evaluation.tasks import TaskEvalConfig
from model import GPT, GPTConfig
from model.pe import SCHEMES
from pelab.config import ConfigError
from pelab.datamodule import SyntheticDataModule

ROOT = Path(__file__).resolve().parents[2]
FILLER = b"The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


# --- naive readers: what each task's bytes mean, written from the layout in the docstring ------

def read_passkey(x: bytes, k: int) -> list[int]:
    i = x.index(bytes([NEEDLE]))
    key = x[i + 1 : i + 1 + k]
    assert key.isdigit() and x.count(bytes([NEEDLE])) == 1 and x.count(bytes([QUERY])) == 1
    assert x.endswith(bytes([QUERY]) + key[:-1])  # the question, then the key (its last digit is a target only)
    filler = x[:i] + x[i + 1 + k : len(x) - k]
    assert filler == (FILLER * 100)[: len(filler)]  # the sentences, continuing across the needle
    return list(key)


def read_copy(x: bytes) -> list[int]:
    n = len(x) // 2  # length + 1 ids = [PAD] + n + SEP + n
    body = x[1:] if len(x) % 2 else x  # an odd input length starts with PAD
    assert len(x) % 2 == 0 or x[0] == PAD
    payload = body[:n]
    assert body[n] == SEP and body[n + 1 :] == payload[:-1] and payload.isalpha() and payload.islower()
    return list(payload)


def read_assoc(x: bytes, pairs: int, queries: int) -> list[int]:
    cut = x.index(bytes([SEP]))
    section, asked = x[:cut], x[cut + 1 :] + b"?"
    table = {section[i]: section[i + 1] for i in range(len(section) - 1) if chr(section[i]).isupper()}
    assert len(table) == pairs and sum(chr(c).isupper() for c in section) == pairs
    assert all(chr(v).isdigit() for v in table.values())
    keys = asked[0::2]
    assert len(keys) == queries and len(set(keys)) == queries
    for i, key in enumerate(keys[:-1]):  # earlier answers are inputs too: they must be right
        assert asked[2 * i + 1] == table[key]
    return [table[k] for k in keys]


def read_flipflop(x: bytes) -> list[int]:
    body = x[1:] + b"?" if len(x) % 2 == 0 else x + b"?"  # even input length: PAD first
    assert len(x) % 2 == 1 or x[0] == PAD
    ops, bits = body[0::2], body[1::2]
    assert ops[0:1] == b"w" and ops[-1:] == b"r" and set(ops) <= set(b"wir")
    register, reads = None, []
    for op, bit in zip(ops, bits):
        if op == ord("w"):
            register = bit
        elif op == ord("r"):
            reads.append(register)
    return reads


def answers_of(task: Task, x: np.ndarray) -> list[int]:
    raw = bytes(x.astype(np.uint8).tolist())
    return {"passkey": lambda: read_passkey(raw, task.key_length), "copy": lambda: read_copy(raw),
            "assoc_recall": lambda: read_assoc(raw, task.num_pairs, task.num_queries),
            "flipflop": lambda: read_flipflop(raw)}[task.name]()


TASK_CASES = [Task("passkey"), Task("passkey", key_length=2), Task("copy"), Task("assoc_recall"),
              Task("assoc_recall", num_pairs=3, num_queries=3), Task("flipflop"), Task("flipflop", p_ignore=0.0)]


@pytest.mark.parametrize("task", TASK_CASES, ids=lambda t: f"{t.name}")
def test_samples_have_the_length_and_answers_the_layout_says(task):
    for length in sorted({task.min_length, task.min_length + 1, 64, 65, 257}):
        for index in range(6):
            x, y = task.sample(length, index, seed=3)
            assert x.shape == y.shape == (length,) and x.dtype == y.dtype == np.int64
            assert 0 <= x.min() and x.max() < 256
            answer = np.flatnonzero(y >= 0)
            assert answer[-1] == length - 1  # every layout ends with an answer
            assert list(y[answer]) == answers_of(task, x)  # what a naive reader of the bytes expects
            assert np.all(y[answer[:-1]] == x[answer[:-1] + 1])  # targets are the next tokens
            assert np.all(y[y < 0] == -1)


def test_answer_counts_by_hand():
    assert (Task("passkey").sample(40, 0)[1] >= 0).sum() == 5  # the key's digits
    assert (Task("copy").sample(40, 0)[1] >= 0).sum() == 20  # 41 ids: 20 + SEP + 20
    assert (Task("copy").sample(41, 0)[1] >= 0).sum() == 20  # 42 ids: PAD + 20 + SEP + 20
    assert (Task("assoc_recall", num_pairs=5, num_queries=2).sample(40, 0)[1] >= 0).sum() == 2
    assert Task("passkey").min_length == 11 and Task("assoc_recall").min_length == 24


def test_passkey_depth_places_the_needle_and_keeps_the_key():
    # length 41, key of 5: 42 ids = 30 filler + NEEDLE + 5 + QUERY + 5; the needle goes after
    # round(depth * 30) filler tokens: 0 at depth 0, 15 at 0.5, 30 (right before QUERY) at 1
    task = Task("passkey")
    keys = set()
    for depth, at in ((0.0, 0), (0.25, 8), (0.5, 15), (1.0, 30)):  # round(7.5) = 8: half to even
        x, y = task.sample(41, 7, seed=1, depth=depth)
        assert x[at] == NEEDLE
        keys.add(tuple(y[y >= 0]))
    assert x[36] == QUERY and len(keys) == 1  # the same key at every depth
    drawn = [list(task.sample(41, i, seed=1)[0]).index(NEEDLE) for i in range(300)]
    assert min(drawn) <= 2 and max(drawn) >= 28  # no depth given: spread over [0, 1]


def test_samples_are_pure_functions_of_their_arguments():
    task = Task("assoc_recall")
    a = task.sample(64, 5, seed=9)
    assert all(np.array_equal(u, v) for u, v in zip(a, task.sample(64, 5, seed=9)))
    others = [task.sample(64, 6, seed=9), task.sample(64, 5, seed=10), task.sample(64, 5, seed=9, split="val"),
              task.sample(64, 5, seed=9, rank=1), Task("assoc_recall", num_queries=3).sample(64, 5, seed=9)]
    assert all(not np.array_equal(a[0], o[0]) for o in others)
    # a longer sample is a fresh draw, not the short one padded
    assert not np.array_equal(task.sample(65, 5, seed=9)[0][:64], a[0])


def test_random_parts_have_the_stated_distributions():
    # flipflop FFL(0.8): middle instructions are 'i' with p 0.8, 'w' and 'r' 0.1 each
    ops = Counter()
    for i in range(200):
        x = Task("flipflop").sample(511, i)[0]  # 512 ids: 256 pairs, 254 free instructions each
        ops.update(bytes(x[2:-2:2].astype(np.uint8).tolist()).decode())
    n = sum(ops.values())
    assert n == 200 * 254
    assert abs(ops["i"] / n - 0.8) < 0.01 and abs(ops["w"] / n - 0.1) < 0.01 and abs(ops["r"] / n - 0.1) < 0.01
    digits = Counter()
    for i in range(400):
        y = Task("passkey").sample(20, i)[1]
        digits.update(y[y >= 0].tolist())
    assert set(digits) == set(range(48, 58)) and max(digits.values()) < 2 * min(digits.values())


@pytest.mark.parametrize("make,message", [
    (lambda: Task("pasky"), "data.task must be one of passkey, copy, assoc_recall, flipflop, niah, counting, "
                            "selective_copy, indirect_indexing, multi_key, multi_value, variable_tracking, "
                            "state_tracking, graphwalks, babilong, multi_query, common_words, find_block, latent_list, "
                            "frequent_words, got 'pasky'"),
    (lambda: Task("assoc_recall", num_pairs=4, num_queries=5), "data.num_queries must be <= data.num_pairs=4"),
    (lambda: Task("assoc_recall", num_pairs=27), "data.num_pairs must be <= 26"),
    (lambda: Task("flipflop", p_ignore=1.0), "data.p_ignore must be a number in [0, 1), got 1.0"),
    (lambda: Task("passkey", key_length=0), "data.key_length must be an integer >= 1, got 0"),
    (lambda: Task("passkey").sample(10, 0), "length must be an integer >= 11 (the shortest passkey sample), got 10"),
    (lambda: Task("copy").sample(10, 0, depth=0.5), "depth must be null for task=copy"),
    (lambda: Task("passkey").sample(20, 0, depth=1.5), "depth must be a number in [0, 1]"),
    (lambda: Task("passkey").sample(20, 0, split="dev"), "split must be one of train, val, test, got 'dev'"),
    (lambda: SyntheticDataModule("passkey", block_size=8), "data.block_size must be an integer >= 11"),
    (lambda: SyntheticDataModule("copy", depth=0.5), "data.depth must be null for data.task=copy"),
    (lambda: SyntheticDataModule(val_samples=0), "data.val_samples must be an integer >= 1, got 0"),
])
def test_bad_options_name_key_value_and_what_is_allowed(make, message):
    with pytest.raises(ValueError) as err:  # a ConfigError when train.py builds the module
        make()
    assert message in str(err.value)


# --- the data module ------------------------------------------------------------------------

def test_data_module_batches_validation_and_resume():
    dm = SyntheticDataModule("flipflop", block_size=33, batch_size=4, val_samples=10, seed=5)
    dm.setup()
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (4, 33) and dm.vocab_size == 256
    first = Task("flipflop").sample(33, 0, seed=5)
    assert torch.equal(x[0], torch.from_numpy(first[0])) and torch.equal(y[0], torch.from_numpy(first[1]))
    val = [b for b in dm.val_dataloader()]
    assert sum(len(b[0]) for b in val) == 10
    again = SyntheticDataModule("flipflop", block_size=33, batch_size=4, val_samples=10, seed=5)
    again.setup()
    assert all(torch.equal(a[0], b[0]) for a, b in zip(val, again.val_dataloader()))  # fixed
    assert not torch.equal(val[0][0][0], x[0])  # validation is its own stream
    dm.load_state_dict({"samples_consumed": 8})  # a resume after two batches continues the stream
    x, _ = next(iter(dm.train_dataloader()))
    assert torch.equal(x[0], torch.from_numpy(Task("flipflop").sample(33, 8, seed=5)[0]))


def test_unigram_baseline_is_the_answer_entropy():
    # uniform digits: ln 10 = 2.302585; uniform bits: ln 2 = 0.693147 (add-one smoothing over 256
    # ids moves them up a little: at most ln(1 + 256/answers))
    passkey = SyntheticDataModule("passkey", block_size=32, val_samples=200).unigram_loss(samples=1000)
    flipflop = SyntheticDataModule("flipflop", block_size=64, val_samples=200).unigram_loss(samples=1000)
    assert 2.302585 - 0.02 < passkey < 2.302585 + math.log(1 + 256 / 5000) + 0.02
    assert 0.693147 - 0.01 < flipflop < 0.693147 + 0.08


def test_no_held_out_text_is_said_plainly():
    dm = SyntheticDataModule()
    assert dm.held_out_text is False and dm.meta is None
    with pytest.raises(ValueError, match=r"data.task=passkey is synthetic: there is no val text.*"
                                         r"evaluation/tasks.py measures accuracy"):
        dm.split_path("val")


def test_model_loss_counts_answer_tokens_only():
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=1, n_head=2, n_embd=16)
    torch.manual_seed(0)
    gpt = GPT(cfg, SCHEMES["rope"](cfg))
    x, y = (torch.from_numpy(a)[None] for a in Task("passkey").sample(64, 0))
    logits, loss = gpt(x, y)
    logp = F.log_softmax(logits[0].double(), -1)
    naive = -sum(logp[t, y[0, t]] for t in range(64) if y[0, t] >= 0) / 5
    assert loss.item() == pytest.approx(naive.item(), rel=1e-5)


def compose(overrides):
    from hydra import compose as hydra_compose, initialize_config_dir

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return hydra_compose("config", overrides=[*overrides, "paths.output_dir=/nonexistent/pelab-out"])


def test_configs_compose_validate_and_build():
    from pelab.datamodule import build_datamodule
    from pelab.validate import validate_config

    cfg = compose(["data=synthetic", "data.task=copy", "eval.extrapolation.enabled=false"])
    validate_config(cfg)
    dm = build_datamodule(cfg.data)
    assert dm.task.name == "copy" and dm.block_size == cfg.model.block_size == 256
    cfg = compose(["experiment=task_ablation", "pe=alibi"])
    validate_config(cfg)
    assert cfg.data.task == "passkey" and cfg.model.block_size == 128
    assert TaskEvalConfig.from_dict({k: v for k, v in cfg.eval.tasks.items() if k != "enabled"}).eval_lengths(128) \
        == [128, 256, 512, 1024]
    with pytest.raises(ConfigError, match=r"data.task must be one of 'passkey', 'copy', 'assoc_recall', "
                                          r"'flipflop', 'niah', 'counting', 'selective_copy', 'indirect_indexing', "
                                          r"'multi_key', 'multi_value', 'variable_tracking', 'state_tracking', 'graphwalks', "
                                          r"'babilong', 'multi_query', 'common_words', 'find_block', 'latent_list', "
                                          r"'frequent_words', got 'pasky'"):
        validate_config(compose(["data=synthetic", "data.task=pasky", "eval.extrapolation.enabled=false"]))


def test_synthetic_data_as_typed_replaces_perplexity_with_task_accuracy():
    """``python train.py data=synthetic data.task=passkey`` validates as typed; tasks.enabled=true on text data
    and a bad value are refused, naming the key."""
    from pelab.validate import validate_config

    for task in ("passkey", "niah"):
        validate_config(compose(["data=synthetic", f"data.task={task}"]))
    with pytest.raises(ConfigError, match=r"eval.tasks.enabled=true needs a synthetic task"):
        validate_config(compose(["eval.tasks.enabled=true"]))
    with pytest.raises(ConfigError, match=r"eval.tasks.enabled must be auto \(on for data=synthetic\), true or false, "
                                          r"got 'sometimes'"):
        validate_config(compose(["data=synthetic", "eval.tasks.enabled=sometimes"]))
    with pytest.raises(ConfigError, match=r"eval.positions=randomized .* pe.randomize_to is null"):
        validate_config(compose(["eval.positions=randomized"]))


def test_niah_haystack_is_real_text_held_out_outside_training():
    from data.synthetic import NIAH_NEEDLE, NIAH_QUESTION, haystack

    task = Task("niah", key_length=4)
    train, held_out = bytes(haystack("train").tolist()), bytes(haystack("val").tolist())
    for split, text in (("train", train), ("test", held_out), ("val", held_out)):
        for depth in (0.0, 0.5, 1.0):
            x, y = task.sample(256, 3, 7, split, 0, depth)
            seq = bytes(np.append(x, y[-1]).tolist())
            key = bytes(y[y >= 0].tolist())
            assert len(x) == 256 and len(key) == 4 and key.isdigit() and (y >= 0).sum() == 4
            assert seq.endswith(NIAH_QUESTION + key)
            needle = NIAH_NEEDLE + key + b"."
            at = seq.index(needle)
            assert abs(at - depth * (256 + 1 - len(needle) - len(NIAH_QUESTION) - 4)) <= 40  # at a word break near it
            hay = seq[:at] + seq[at + len(needle): -len(NIAH_QUESTION) - 4]
            assert hay in text and (hay not in held_out if split == "train" else True)  # a real excerpt of its split
    a, b = task.sample(256, 3, 7, "test", 0, 0.0), task.sample(256, 3, 7, "test", 0, 1.0)
    assert (a[1] == b[1]).all()  # the same key at every depth
    # 17 (" The pass key is ") + 4 + 1 (".") + 39 ("\nWhat is the pass key? The pass key is ") + 4 = 65 ids
    assert task.min_length == 64 and len(task.sample(64, 0)[0]) == 64
    with pytest.raises(ValueError, match=r"length must be an integer >= 64"):
        task.sample(63, 0)


def test_curriculum_grows_whole_batches_from_start_to_block_size():
    dm = SyntheticDataModule("passkey", block_size=64, batch_size=4, key_length=3, curriculum_batches=4,
                             curriculum_start=16)
    dm.setup()
    # batch b < 4: 16 + 48 * b // 4 = 16, 28, 40, 52; then 64
    assert [dm.curriculum_length(i) for i in range(0, 24, 4)] == [16, 28, 40, 52, 64, 64]
    assert [len(dm.train_set[i][0]) for i in range(8)] == [16] * 4 + [28] * 4  # one length per batch
    assert len(next(iter(dm.train_dataloader()))[0][0]) == 16
    assert SyntheticDataModule("passkey", block_size=256, key_length=3, curriculum_batches=1).curriculum_start == 32
    with pytest.raises(ValueError, match=r"data.curriculum_start must be null or an integer in \[7, "
                                          r"data.block_size=64\], got 65"):
        SyntheticDataModule("passkey", block_size=64, key_length=3, curriculum_batches=2, curriculum_start=65)


# --- the training stream: keyed by the global sample index --------------------------------------

def synthetic_loader(trainer, state: dict | None = None, **options):
    """One rank's data module (``trainer``: tests/data/test_stream.py's stand-in; ``state``: the
    checkpoint's) and its training batches."""
    dm = SyntheticDataModule(**options)
    dm.setup()
    dm.trainer = trainer
    if state is not None:
        dm.load_state_dict(state)
    return dm, iter(dm.train_dataloader())


def digest(batches) -> str:
    import hashlib

    h = hashlib.sha256()
    for x, y in batches:
        h.update(x.numpy().tobytes())
        h.update(y.numpy().tobytes())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("step, accumulation, keys, expected", [
    (0, 1, ["049", "408", "855", "495"], "df86d80b37b28cf7"),
    (3, 2, ["123", "509", "895", "676"], "1a058a78ec3c7f72"),  # resumed after 3 steps of 2 x 4 samples
])
def test_one_rank_stream_is_the_one_before_global_keying(step, accumulation, keys, expected):
    """One rank (world 1): the first three batches recorded from the per-rank code at b794d84, from
    the start and resumed; the passkey keys of the first batch by hand, the rest as a digest."""
    from tests.data.test_stream import FakeTrainer

    _, batches = synthetic_loader(FakeTrainer(0, 1, step, accumulation), task="passkey", block_size=32,
                                  batch_size=4, key_length=3, seed=7)
    first = [next(batches) for _ in range(3)]
    assert [bytes(y[y >= 0].tolist()).decode() for y in first[0][1]] == keys
    assert digest(first) == expected


@pytest.mark.parametrize("step, accumulation, lengths, expected", [
    (0, 1, [9, 15, 21], "e6e357e3d806b915"),  # 9 + 24 * b // 4
    (1, 2, [21, 27, 33], "fcc0727420c4a689"),
])
def test_one_rank_curriculum_is_the_one_before_global_keying(step, accumulation, lengths, expected):
    from tests.data.test_stream import FakeTrainer

    _, batches = synthetic_loader(FakeTrainer(0, 1, step, accumulation), task="flipflop", block_size=33,
                                  batch_size=4, seed=5, curriculum_batches=4, curriculum_start=9)
    first = [next(batches) for _ in range(3)]
    assert [x.shape[1] for x, _ in first] == lengths
    assert digest(first) == expected


CURRICULUM = dict(task="passkey", block_size=32, batch_size=4, key_length=3, seed=7, curriculum_batches=6,
                  curriculum_start=11)


def run_steps(world: int, accumulation: int, first_step: int, steps: int, state: dict | None = None):
    """The samples (input rows as tuples) each optimisation step trains on over all ranks, and the
    data module state a checkpoint written after the last step holds."""
    from tests.data.test_stream import FakeTrainer

    per_step: list[Counter] = [Counter() for _ in range(steps)]
    for rank in range(world):
        trainer = FakeTrainer(rank, world, first_step, accumulation)
        dm, batches = synthetic_loader(trainer, state, **CURRICULUM)
        for s in range(steps):
            for _ in range(accumulation):
                per_step[s].update(tuple(row.tolist()) for row in next(batches)[0])
        trainer.global_step = first_step + steps
        saved = dm.state_dict()
    return per_step, saved


def test_resume_on_four_ranks_continues_the_two_rank_stream():
    """16 samples a step: 2 ranks x 4 x accumulation 2, cut at step 2 and resumed on 4 ranks x 4,
    trains on the uninterrupted run's samples, each step: sample g of the stream for g = 16 s ..
    16 s + 15, at its curriculum length (11 + 21 b // 6 for batch b = g // 4, then 32). The
    per-rank keying before replayed and drew other samples."""
    def expected(s):
        lengths = [11 + 21 * (g // 4) // 6 if g // 4 < 6 else 32 for g in range(16 * s, 16 * s + 16)]
        return Counter(tuple(Task("passkey", key_length=3).sample(n, g, seed=7)[0].tolist())
                       for g, n in zip(range(16 * s, 16 * s + 16), lengths))

    whole, _ = run_steps(world=2, accumulation=2, first_step=0, steps=5)
    before, state = run_steps(world=2, accumulation=2, first_step=0, steps=2)
    assert state == {"samples_consumed": 32}
    after, _ = run_steps(world=4, accumulation=1, first_step=2, steps=3, state=state)
    assert [sorted(set(map(len, c))) for c in whole[:2]] == [[11, 14, 18, 21], [25, 28, 32]]  # the curriculum
    for s, samples in enumerate(before + after):
        assert samples == whole[s] == expected(s), s
