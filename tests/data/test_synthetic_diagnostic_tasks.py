"""data/synthetic.py's counting, selective_copy, indirect_indexing, multi_key, multi_value and
variable_tracking: each layout written out by hand at its shortest length, and every sample read
back by a naive reader of the bytes written from the task's definition (each reader first checked
on a hand-made sequence)."""

import math
from collections import Counter

import numpy as np
import pytest

from data.synthetic import NEEDLE, PAD, QUERY, SEP, Task
from evaluation.tasks import TaskEvalConfig, evaluate_tasks
from model import GPTConfig
from pelab.datamodule import SyntheticDataModule
from tests.data.test_synthetic import FILLER, compose
from tests.tiny import tiny_gpt

N, Q, S = bytes([NEEDLE]), bytes([QUERY]), bytes([SEP])


# --- naive readers: the answer a reader of the bytes finds, from each task's definition ---------

def read_counting(x: bytes) -> list[int]:
    pad = len(x) % 2  # [PAD] statements QUERY v: an odd length starts with PAD
    assert x[:pad] == bytes([PAD]) * pad and x[-2:-1] == Q
    statements = [x[i : i + 2] for i in range(pad, len(x) - 2, 2)]
    assert statements[0][1:] == b"="  # the program starts by setting a variable
    count = {}
    for s in statements:
        if s == b"..":
            continue
        var, op = s[:1], s[1:]
        assert var.isalpha() and var.islower() and op in (b"=", b"+")
        count[var] = 0 if op == b"=" else count[var] + 1  # an increment names a variable already set
        assert count[var] <= 9
    return [ord(str(count[x[-1:]]))]


def read_selective_copy(x: bytes, k: int) -> list[int]:
    cut = x.index(S)
    section, copied = x[:cut], x[cut + 1 :]
    data = section.replace(b".", b"")
    assert len(data) == k and data.isalpha() and data.islower() and S not in copied
    assert copied == data[:-1]  # the copy so far (its last token is a target only)
    return list(data)


def read_indirect_indexing(x: bytes, max_offset: int) -> list[int]:
    string, (query, anchor, direction, offset) = x[:-4], x[-4:]
    assert query == QUERY and string.isalpha() and string.islower()
    assert string.count(anchor) == 1  # the anchor letter names one place
    step = int(chr(offset))
    assert 1 <= step <= max_offset and direction in b"+-"
    target = string.index(anchor) + (step if direction == ord("+") else -step)
    assert 0 <= target < len(string)
    return [string[target]]


def needles(text: bytes, value_length: int) -> tuple[list[tuple[int, bytes]], bytes]:
    """(key, value) of every NEEDLE key value, in order, and the text around them."""
    found, rest, i = [], b"", 0
    while (j := text.find(N, i)) >= 0:
        rest += text[i:j]
        found.append((text[j + 1], text[j + 2 : j + 2 + value_length]))
        i = j + 2 + value_length
    return found, rest + text[i:]


def read_multi_key(x: bytes, k: int, count: int) -> list[int]:
    head, (key, *asked) = x.split(Q)[0], x.split(Q)[1]
    pairs, filler = needles(head, k)
    table = dict(pairs)
    assert len(table) == len(pairs) == count and all(v.isdigit() for v in table.values())
    assert filler == (FILLER * 100)[: len(filler)]  # the sentences, continuing across the needles
    assert bytes(asked) == table[key][:-1]
    return list(table[key])


def read_multi_value(x: bytes, k: int, count: int) -> list[int]:
    head, tail = x.split(Q)
    pairs, filler = needles(head, k)
    assert len(pairs) == count and len({key for key, _ in pairs}) == 1 and filler == (FILLER * 100)[: len(filler)]
    values = b"".join(v for _, v in pairs)
    assert tail == bytes([pairs[0][0]]) + values[:-1]
    return list(values)


def read_variable_tracking(x: bytes, k: int, hops: int) -> list[int]:
    head, tail = x.split(Q)
    value_of, order, rest, i = {}, [], b"", 0
    while (j := head.find(N, i)) >= 0:
        rest += head[i:j]
        var, what = head[j + 1], head[j + 2 : j + 3]
        if what.isdigit():  # X = k digits
            value_of[var], i = head[j + 2 : j + 2 + k], j + 2 + k
        else:  # X = an earlier variable
            value_of[var], i = value_of[what[0]], j + 3
        assert chr(var).isupper()
        order.append(var)
    assert (rest + head[i:]) == (FILLER * 100)[: len(rest + head[i:])]
    value, names = tail[:k], tail[k:]
    chain = [v for v in order if value_of[v] == value]
    assert len(chain) == hops + 1 and bytes(chain[:-1]) == names
    return chain


def test_readers_on_hand_made_sequences():
    assert read_counting(b"a=a+b=a+b+..\x1fa") == [ord("2")]
    assert read_counting(b"\x00a=a+a+b=b+..a=a+\x1fb") == [ord("1")]  # a= resets a, not b
    assert read_selective_copy(b"..a.b..c\x1dab", 3) == list(b"abc")
    assert read_indirect_indexing(b"xqzmk\x1fz+2", 5) == [ord("k")]
    assert read_indirect_indexing(b"xqzmk\x1fz-2", 5) == [ord("x")]
    assert read_multi_key(b"The\x1cA12 gr\x1cB34ass\x1fB3", 2, 2) == list(b"34")
    assert read_multi_value(b"Th\x1cK12e \x1cK34gr\x1fK123", 2, 2) == list(b"1234")
    x = b"\x1cA12Th\x1cB34e\x1cCA\x1cDB gr\x1cEC\x1cFD\x1f12AC"  # A = 12, C = A, E = C; B = 34, D = B, F = D
    assert read_variable_tracking(x, 2, 2) == list(b"ACE")
    with pytest.raises(AssertionError):
        read_indirect_indexing(b"xzqzmk\x1fz+2", 5)  # the anchor twice: no single place


TASKS = [Task("counting"), Task("counting", num_vars=1), Task("selective_copy"), Task("selective_copy", num_tokens=3),
         Task("indirect_indexing"), Task("indirect_indexing", max_offset=9), Task("multi_key"),
         Task("multi_key", num_needles=1, key_length=2), Task("multi_value"), Task("multi_value", num_needles=2),
         Task("variable_tracking"), Task("variable_tracking", num_chains=3, num_hops=2, key_length=1)]


def answers_of(task: Task, x: np.ndarray) -> list[int]:
    raw = bytes(x.astype(np.uint8).tolist())
    return {"counting": lambda: read_counting(raw),
            "selective_copy": lambda: read_selective_copy(raw, task.num_tokens),
            "indirect_indexing": lambda: read_indirect_indexing(raw, task.max_offset),
            "multi_key": lambda: read_multi_key(raw, task.key_length, task.num_needles),
            "multi_value": lambda: read_multi_value(raw, task.key_length, task.num_needles),
            "variable_tracking": lambda: read_variable_tracking(raw, task.key_length, task.num_hops)}[task.name]()


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.name)
def test_every_length_has_the_layout_and_only_answers_are_targets(task):
    # 1024: 4x the default block_size 256, 16x the 64 a CPU run trains at
    for length in sorted({task.min_length, task.min_length + 1, 64, 65, 257, 1024}):
        for index in range(3):
            x, y = task.sample(length, index, seed=2, split="test")
            assert x.shape == y.shape == (length,) and x.dtype == y.dtype == np.int64 and 0 <= x.min() <= x.max() < 256
            answer = np.flatnonzero(y >= 0)
            answers = answers_of(task, x)
            assert list(answer) == list(range(length - len(answers), length))  # the answer ends the sample
            assert list(y[answer]) == answers and np.all(y[y < 0] == -1)
            assert np.array_equal(y[answer[:-1]], x[answer[:-1] + 1])  # targets are the next tokens


def layout(task: Task, length: int, index: int = 0, depth: float | None = None):
    x, y = task.sample(length, index, seed=1, depth=depth)
    return list(x), list(y)


def test_shortest_layouts_written_out_by_hand():
    # counting, 5 ids: "v=" QUERY v, answer 0 (no increment); one more: a leading PAD
    x, y = layout(Task("counting"), 4)
    assert x == [x[0], ord("="), QUERY, x[0]] and y == [-1, -1, -1, ord("0")] and chr(x[0]) in "abc"
    x, y = layout(Task("counting"), 5)
    assert x == [PAD, x[1], ord("="), QUERY, x[1]] and y == [-1] * 4 + [ord("0")]
    # selective_copy, 3 tokens at length 6: no noise, d1 d2 d3 SEP d1 d2 -> d1 d2 d3
    x, y = layout(Task("selective_copy", num_tokens=3), 6)
    d = x[:3]
    assert x == [*d, SEP, *d[:2]] and y == [-1, -1, -1, *d]
    x, _ = layout(Task("selective_copy", num_tokens=3), 7)  # one noise token among the data
    assert x.count(ord(".")) == 1 and x.index(SEP) == 4
    # indirect_indexing, offset 1 at length 6: a two-letter string, the anchor one, the answer the other
    for i in range(4):
        x, y = layout(Task("indirect_indexing", max_offset=1), 6, i)
        s0, s1, anchor, direction = x[0], x[1], x[3], x[4]
        assert s0 != s1 and x[2] == QUERY and x[5] == ord("1") and y[:5] == [-1] * 5
        assert (anchor, direction, y[5]) in ((s0, ord("+"), s1), (s1, ord("-"), s0))
    # multi_key, 2 needles of 2 digits at length 11: no filler; at depth 0 the asked needle is first
    x, y = layout(Task("multi_key", num_needles=2, key_length=2), 11, depth=0.0)
    k0, a, b, k1 = x[1], x[2], x[3], x[5]
    assert x == [NEEDLE, k0, a, b, NEEDLE, k1, x[6], x[7], QUERY, k0, a] and k0 != k1
    assert y == [-1] * 9 + [a, b]
    # multi_value, 2 needles of 2 digits at length 13: N K a b N K c d QUERY K a b c -> a b c d
    x, y = layout(Task("multi_value", num_needles=2, key_length=2), 13)
    key, a, b, c, d = x[1], x[2], x[3], x[6], x[7]
    assert x == [NEEDLE, key, a, b, NEEDLE, key, c, d, QUERY, key, a, b, c] and y == [-1] * 9 + [a, b, c, d]
    # variable_tracking, one hop of 1 digit at length 9: N X v N Y X QUERY v X -> X Y
    x, y = layout(Task("variable_tracking", num_hops=1, key_length=1), 9)
    var, value, other = x[1], x[2], x[4]
    assert x == [NEEDLE, var, value, NEEDLE, other, var, QUERY, value, var] and y == [-1] * 7 + [var, other]


def test_multi_key_depth_places_the_asked_needle_and_keeps_the_needles():
    task = Task("multi_key", num_needles=3, key_length=2)
    # length 64: 65 ids = 49 filler + 3 x 4 needle + QUERY K + 2 digits; the asked needle after round(depth x 49)
    seen = set()
    for depth, at in ((0.0, 0), (0.5, 24), (1.0, 49)):  # round(24.5) = 24: half to even
        x, y = task.sample(64, 4, seed=1, depth=depth)
        raw = bytes(x.tolist())
        asked = raw[raw.index(Q) + 1]
        j = raw.index(N + bytes([asked]))
        assert j - 4 * raw[:j].count(N) == at  # filler tokens before it
        seen.add((tuple(y[y >= 0]), frozenset(needles(raw.split(Q)[0], 2)[0])))
    assert len(seen) == 1 and x[-4] != NEEDLE and x[-7] == NEEDLE  # depth 1: the asked needle right before QUERY
    drawn = [bytes(task.sample(64, i, seed=1)[0].tolist()) for i in range(200)]
    places = [r.index(N + bytes([r[r.index(Q) + 1]])) for r in drawn]
    assert min(places) <= 4 and max(places) >= 50  # no depth given: spread over [0, 1]


def test_random_parts_cover_what_the_definitions_allow():
    offsets = Counter()
    for i in range(300):
        x = bytes(Task("indirect_indexing").sample(32, i)[0].tolist())
        offsets[x[-2:]] += 1
    assert set(offsets) == {bytes([d, j]) for d in b"+-" for j in b"12345"}  # each direction, offsets 1..5
    assert max(offsets.values()) < 2.5 * min(offsets.values())
    counts = Counter(Task("counting").sample(128, i)[1][-1] - ord("0") for i in range(300))
    assert len(counts) >= 8 and counts[0] > 0  # counts from 0 upward, not a constant
    statements = Counter()
    for i in range(100):
        x = bytes(Task("counting").sample(1024, i)[0].tolist())
        statements.update(x[j + 1] for j in range(0, len(x) - 2, 2))
    n = sum(statements.values())
    assert abs(statements[ord("=")] / n - 1 / 58) < 0.005  # RAM's odds; an increment past 9 becomes a pass
    assert 50 / 58 - 0.01 < statements[ord(".")] / n < 50 / 58 + 0.03
    vt = Task("variable_tracking", num_chains=3, num_hops=2)
    for i in range(20):  # the distractor chains are there, with other variables and values
        raw = bytes(vt.sample(128, i)[0].tolist())
        assert raw.count(N) == 9 and len({raw[j + 1] for j in range(len(raw)) if raw[j] == NEEDLE}) == 9


def test_samples_are_pure_functions_of_their_arguments():
    for task in (Task("counting"), Task("selective_copy"), Task("indirect_indexing"), Task("multi_key"),
                 Task("multi_value"), Task("variable_tracking")):
        a = task.sample(96, 5, seed=9)
        assert all(np.array_equal(u, v) for u, v in zip(a, task.sample(96, 5, seed=9)))
        others = [task.sample(96, 6, seed=9), task.sample(96, 5, seed=10), task.sample(96, 5, seed=9, split="val"),
                  task.sample(96, 5, seed=9, split="test"), task.sample(96, 5, seed=9, rank=1)]
        assert all(not np.array_equal(a[0], o[0]) for o in others), task.name


@pytest.mark.parametrize("make,message", [
    (lambda: Task("counting", num_vars=27), "data.num_vars must be <= 26 (variables 'a'-'z'), got 27"),
    (lambda: Task("selective_copy", num_tokens=0), "data.num_tokens must be an integer >= 1, got 0"),
    (lambda: Task("indirect_indexing", max_offset=10),
     "data.max_offset must be <= 9 (the offset is one digit), got 10"),
    (lambda: Task("multi_key", num_needles=27), "data.num_needles must be <= 26 (distinct keys 'A'-'Z'), got 27"),
    (lambda: Task("variable_tracking", num_chains=6, num_hops=4),
     "data.num_chains must be <= 5 (num_chains x (data.num_hops=4 + 1) distinct variables 'A'-'Z'), got 6"),
    (lambda: Task("variable_tracking", num_chains=11, num_hops=1, key_length=1),
     "data.num_chains must be <= 10 (distinct values of data.key_length=1 digits), got 11"),
    (lambda: Task("counting").sample(3, 0), "length must be an integer >= 4 (the shortest counting sample), got 3"),
    (lambda: Task("selective_copy").sample(31, 0), "length must be an integer >= 32 (the shortest selective_copy"),
    (lambda: Task("indirect_indexing").sample(9, 0), "length must be an integer >= 10 (the shortest indirect_indexing"),
    (lambda: Task("multi_key").sample(33, 0), "length must be an integer >= 34 (the shortest multi_key sample)"),
    (lambda: Task("multi_value").sample(48, 0), "length must be an integer >= 49 (the shortest multi_value sample)"),
    # 30 ids: N X 5 digits, 4 x (N Y X), QUERY, 5 digits, 5 variables
    (lambda: Task("variable_tracking").sample(28, 0),
     "length must be an integer >= 29 (the shortest variable_tracking"),
    (lambda: Task("multi_value").sample(64, 0, depth=0.5), "depth must be null for task=multi_value (only passkey, "
                                                           "niah, multi_key, find_block have a depth)"),
    (lambda: SyntheticDataModule("multi_value", block_size=32, num_needles=4),
     "data.block_size must be an integer >= 49 (the shortest multi_value sample with these options), got 32"),
    (lambda: SyntheticDataModule("variable_tracking", depth=0.5),
     "data.depth must be null for data.task=variable_tracking"),
])
def test_bad_options_name_key_value_and_what_is_allowed(make, message):
    with pytest.raises(ValueError) as err:
        make()
    assert message in str(err.value)


def test_each_task_runs_as_typed_and_evaluates_with_depth_only_where_it_has_one():
    """``python train.py data=synthetic data.task=TASK`` validates and builds; the task evaluation
    scores each at 1x and 4x the training length, with depth rows (the heatmap) for multi_key only."""
    from pelab.datamodule import build_datamodule
    from pelab.validate import validate_config

    gpt = tiny_gpt("alibi", config=GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=32))
    config = TaskEvalConfig(multipliers=[1, 4], depths=[0.0, 1.0], samples=2, precision="32")
    for name in ("counting", "selective_copy", "indirect_indexing", "multi_key", "multi_value", "variable_tracking"):
        cfg = compose(["data=synthetic", f"data.task={name}"])
        validate_config(cfg)
        dm = build_datamodule(cfg.data)
        assert dm.task == Task(name) and dm.block_size == 256
        rows = evaluate_tasks(gpt, Task(name), 64, config, seed=0, log=lambda _: None)
        assert [r.eval_length for r in rows if r.ok] == ([64, 64, 256, 256] if name == "multi_key" else [64, 256])
        assert all(math.isnan(r.depth) != (name == "multi_key") for r in rows)
    cfg = compose(["data=synthetic", "data.task=variable_tracking", "data.num_chains=2", "data.num_hops=3"])
    validate_config(cfg)
    # 42 ids: 2 chains x (N X 5 digits + 3 x (N Y X)), QUERY, 5 digits, 4 variables
    assert build_datamodule(cfg.data).task.min_length == 41
