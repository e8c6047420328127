"""data/tasks_2025.py's state_tracking, graphwalks, babilong, multi_query, common_words, find_block,
latent_list and frequent_words: each
layout written out by hand at its shortest length, every sample read back by a naive reader of
the bytes written from the task's definition (each reader first checked on a hand-made
sequence), F1 of set-valued answers by hand, the refusals, and one tiny training run."""

import functools
import itertools
import math
import os
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from data.synthetic import NEEDLE, PAD, QUERY, Task
from evaluation.tasks import TaskEvalConfig, evaluate_tasks, read_csv, set_f1
from model import GPTConfig
from pelab.config import ConfigError
from pelab.datamodule import SyntheticDataModule
from tests.cli import run_python
from tests.data.test_synthetic import ROOT, compose
from tests.data.test_synthetic_diagnostic_tasks import needles
from tests.tiny import tiny_gpt

Q = bytes([QUERY])
NEW = ("state_tracking", "graphwalks", "babilong", "multi_query", "common_words", "find_block", "latent_list")


# --- naive readers ------------------------------------------------------------------------------

def read_state_tracking(x: np.ndarray, group: str) -> list[int]:
    """The running product of the elements (ids 0x80 + index of the permutation in sorted order;
    A: the permutations with an even number of even-length cycles... i.e. m - cycles even)."""
    m = int(group[1:])

    def cycles(p):
        seen, count = set(), 0
        for i in range(m):
            if i not in seen:
                count += 1
                while i not in seen:
                    seen.add(i)
                    i = p[i]
        return count

    perms = [p for p in sorted(itertools.permutations(range(m))) if group[0] == "S" or (m - cycles(p)) % 2 == 0]
    out, state = [], list(range(m))
    for token in x.tolist():
        g = perms[token - 0x80]
        state = [g[state[i]] for i in range(m)]  # first the product so far, then g
        out.append(0x80 + perms.index(tuple(state)))
    return out


def read_graphwalks(x: bytes, max_answer: int) -> list[int]:
    body = x.lstrip(bytes([PAD]))
    assert len(x) - len(body) <= max_answer + 2
    cut = body.index(Q)
    edges = [(body[i], body[i + 2]) for i in range(0, cut, 3)]
    assert cut % 3 == 0 and all(body[i + 1] == ord(">") for i in range(0, cut, 3))
    assert len(set(edges)) == len(edges) and all(u != v and u >= 0x80 and v >= 0x80 for u, v in edges)
    direction, start, depth = body[cut + 1], body[cut + 2], int(chr(body[cut + 3]))
    if direction == ord("<"):
        assert depth == 1
        edges = [(v, u) for u, v in edges]
    distance, queue = {start: 0}, [start]
    for node in queue:  # breadth-first: shortest distances
        for u, v in edges:
            if u == node and v not in distance:
                distance[v] = distance[node] + 1
                queue.append(v)
    answer = sorted(v for v, d in distance.items() if d == depth)
    assert len(answer) <= max_answer and body[cut + 4 :] == bytes(answer + [ord(".")])[:-1]
    return answer + [ord(".")]


PLACE = "bathroom|hallway|kitchen|garden|office|bedroom"
FACT = re.compile(rf" (Mary|John|Daniel|Sandra) (?:(?:went|moved|journeyed|travelled) to the ({PLACE})|"
                  r"(?:picked up|grabbed|got|took) the (football|apple|milk))\.")


def read_babilong(x: bytes, answer_length: int) -> list[int]:
    text = x.decode("latin-1")
    question = re.search(r"\n(Where is (\w+)\?|Where is the (\w+)\?|Where was the (\w+) before the (\w+)\?) $",
                         text[: len(text) - answer_length + 1])
    assert question is not None
    where, holder, trace = {}, {}, {}
    for person, place, thing in FACT.findall(text[: question.start()]):
        if place:
            where[person] = place
            for o, h in holder.items():
                if h == person:
                    trace[o].append(place)
        else:
            holder[thing] = person
            trace[thing] = [where[person]] if person in where else []
    _, person, thing, before, after = question.groups()
    if person:
        answer = where[person]
    elif thing:
        answer = where[holder[thing]]
    else:
        steps = trace[before]
        answer = steps[len(steps) - 1 - steps[::-1].index(after) - 1]
    assert text.endswith(answer[:-1])
    return list(answer.encode())


def read_multi_query(x: bytes, k: int, count: int, asked: int) -> list[int]:
    head, tail = x.split(Q)
    pairs, _ = needles(head, k)
    table = dict(pairs)
    assert len(table) == len(pairs) == count
    keys = tail[:asked]
    assert len(set(keys)) == asked
    values = b"".join(table[key] for key in keys)
    assert tail[asked:] == values[:-1]
    return list(values)


def read_common_words(x: bytes, common: int) -> list[int]:
    body = x.lstrip(bytes([PAD]))
    words, tail = body.split(Q)
    counts = Counter(words.split())
    assert words.endswith(b" ") and all(len(w) == 3 and w.isalpha() and w.islower() for w in counts)
    frequent = sorted(w for w, c in counts.items() if c == 3)
    assert len(frequent) == common and all(c in (1, 3) for c in counts.values())
    answer = b"".join(frequent) + b"."
    assert tail == answer[:-1]
    return list(answer)


def read_frequent_words(x: bytes, asked: int) -> list[int]:
    """The words counted (the noise word ``...`` set aside, it outnumbers every other); the
    ``asked`` most frequent must outnumber the rest."""
    body = x.lstrip(bytes([PAD]))
    words, tail = body.split(Q)
    counts = Counter(words.split())
    noise = counts.pop(b"...", 0)
    assert words.endswith(b" ") and all(len(w) == 3 and w.isalpha() and w.islower() for w in counts)
    ranked = counts.most_common()
    assert len(ranked) >= asked and noise >= ranked[0][1]
    assert ranked[asked - 1][1] > (ranked[asked][1] if len(ranked) > asked else 0)  # the top words are unique
    answer = b"".join(sorted(w for w, _ in ranked[:asked])) + b"."
    assert tail == answer[:-1]
    return list(answer)


def read_find_block(x: bytes, size: int, asked: int) -> list[int]:
    body = x.lstrip(bytes([PAD]))
    assert len(x) - len(body) <= size
    text, tail = body.split(Q)
    blocks = text.split(b".")
    assert all(len(b) == size == len(set(b)) and b.isalpha() and b.islower() for b in blocks)
    query = tail[:asked]
    hits = [b for b in blocks if set(query) <= set(b)]
    assert len(query) == len(set(query)) == asked and len(hits) == 1  # one block holds every query letter
    assert tail[asked:] == hits[0][:-1]
    return list(hits[0])


def read_latent_list(x: bytes, ops: int) -> list[int]:
    body = x.lstrip(bytes([PAD]))
    text, tail = body.split(Q)
    assert len(x) - len(body) <= ops + 2 and len(text) % 3 == 0
    items, count = [], 0
    for i in range(0, len(text), 3):
        name, op, arg = text[i : i + 3]
        assert name in b"ab" and (chr(arg).isdigit() if op in b"+<" else (op in b"-~" and arg == ord(".")))
        if name != ord("a"):
            continue
        count += 1
        if op == ord("+"):
            items = items + [arg]
        elif op == ord("<"):
            items = [arg] + items
        elif op == ord("-"):
            assert items  # never dropped from an empty list
            items = items[:-1]
        else:
            items = items[::-1]
    assert count == ops and tail == bytes(items)
    return items + [ord(".")]


def test_readers_on_hand_made_sequences():
    # S3 sorted: 0 (0,1,2), 1 (0,2,1), 2 (1,0,2), 3 (1,2,0), 4 (2,0,1), 5 (2,1,0); (0,2,1) then (1,0,2)
    # = (1,2,0) (p[i] = b[a[i]]); then (0,2,1) again: (2,1,0)
    assert read_state_tracking(np.array([0x81, 0x82, 0x81]), "S3") == [0x81, 0x83, 0x85]
    assert read_state_tracking(np.array([0x81, 0x81]), "A4") == [0x81, 0x82]  # A4: 0 id, 1 (0,2,3,1), 2 (0,3,1,2)
    a, b, c, d = 0x80, 0x81, 0x82, 0x83
    graph = bytes([PAD, a, 62, b, a, 62, c, b, 62, d, c, 62, d, QUERY])
    assert read_graphwalks(graph + bytes([62, a, ord("2"), d]), 6) == [d, ord(".")]  # a->b->d, a->c->d: depth 2
    assert read_graphwalks(graph + bytes([60, d, ord("1"), b, c]), 6) == [b, c, ord(".")]  # d's parents
    assert read_graphwalks(graph + bytes([62, d, ord("1")]), 6) == [ord(".")]  # none: just the end
    story = (b"It was. Mary went to the kitchen. So John took the milk. Mary moved to the garden. Nay. "
             b"John went to the office. John travelled to the hallway.")
    assert read_babilong(story + b"\nWhere is Mary? garde", 6) == list(b"garden")
    assert read_babilong(story + b"\nWhere is the milk? hallwa", 7) == list(b"hallway")
    assert read_babilong(story + b"\nWhere was the milk before the hallway? offic", 6) == list(b"office")
    assert read_multi_query(b"T\x1cA1h\x1cB2e\x1cC3\x1fCA3", 1, 3, 2) == list(b"31")
    assert read_common_words(b"\x00abc xyz abc abc qrs \x1fabc", 1) == list(b"abc.")
    assert read_frequent_words(b"\x00... abc xyz ... abc ... qrs xyz abc \x1fabcxyz", 2) == list(b"abcxyz.")
    assert read_find_block(b"\x00abc.bcd.cde\x1fdbbc", 3, 2) == list(b"bcd")
    assert read_latent_list(b"a+1b+2a<3a~.b-.a-.\x1f1", 4) == list(b"1.")  # [1] [3 1] [1 3] [1]
    with pytest.raises(AssertionError):
        read_find_block(b"abc.bcd.cbe\x1fcbbc", 3, 2)  # two blocks hold b and c
    with pytest.raises(AssertionError):
        read_common_words(b"abc xyz abc abc xyz \x1fabc", 1)  # a word twice: neither common nor rare
    with pytest.raises(AssertionError):
        read_frequent_words(b"... ... abc xyz ... abc qrs xyz \x1fabc", 1)  # abc and xyz tie for the top


TASKS = [Task("state_tracking"), Task("state_tracking", group="A5"), Task("state_tracking", group="S3"),
         Task("graphwalks"), Task("graphwalks", walk_depth=3, max_answer=2), Task("babilong"),
         Task("babilong", qa=2, num_facts=3), Task("babilong", qa=3), Task("babilong", num_facts=3),  # task_ablation2's
         Task("multi_query"),
         Task("multi_query", num_needles=6, num_queries=2, key_length=2), Task("common_words"),
         Task("common_words", num_common=1), Task("find_block"), Task("find_block", block_length=3, query_length=3),
         Task("latent_list"), Task("latent_list", num_ops=12), Task("frequent_words"),
         Task("frequent_words", num_common=1), Task("frequent_words", alpha=1.5, num_common=2)]


def answers_of(task: Task, x: np.ndarray, y: np.ndarray) -> list[int]:
    raw = bytes(x.astype(np.uint8).tolist())
    return {"state_tracking": lambda: read_state_tracking(x, task.group),
            "graphwalks": lambda: read_graphwalks(raw, task.max_answer),
            "babilong": lambda: read_babilong(raw, int((y >= 0).sum())),
            "multi_query": lambda: read_multi_query(raw, task.key_length, task.num_needles, task.num_queries),
            "common_words": lambda: read_common_words(raw, task.num_common),
            "find_block": lambda: read_find_block(raw, task.block_length, task.query_length),
            "latent_list": lambda: read_latent_list(raw, task.num_ops),
            "frequent_words": lambda: read_frequent_words(raw, task.num_common)}[task.name]()


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.name)
def test_every_length_has_the_layout_and_only_answers_are_targets(task):
    for length in sorted({task.min_length, task.min_length + 1, 257, 1024}):
        for index in range(2):
            x, y = task.sample(length, index, seed=2, split="test")
            assert x.shape == y.shape == (length,) and x.dtype == y.dtype == np.int64 and 0 <= x.min() <= x.max() < 256
            answer = np.flatnonzero(y >= 0)
            answers = answers_of(task, x, y)
            assert list(answer) == list(range(length - len(answers), length))  # the answer ends the sample, whole
            assert list(y[answer]) == answers and np.all(y[y < 0] == -1)
            if task.name != "state_tracking":  # its targets label the inputs; the others' are the next tokens
                assert np.array_equal(y[answer[:-1]], x[answer[:-1] + 1])


def layout(task: Task, length: int, index: int = 0, depth: float | None = None):
    x, y = task.sample(length, index, seed=1, depth=depth)
    return list(x), list(y)


def test_shortest_layouts_written_out_by_hand():
    # state_tracking, S2 at length 3: every target is the product so far, in the inputs' ids
    x, y = layout(Task("state_tracking", group="S2"), 3)
    swaps = [t - 0x80 for t in x]
    assert set(x) <= {0x80, 0x81} and y == [0x80 + sum(swaps[: i + 1]) % 2 for i in range(3)]
    # graphwalks, at most 6 answer nodes, length 16: 17 ids = PADs, 2 edges over 3 nodes, QUERY op x d, answer, END
    for i in range(4):
        x, y = layout(Task("graphwalks"), 16, i)
        pad = x.count(PAD)
        end = 17 - 1 - (pad + 6 + 4)  # answer nodes: what the PADs leave over (E = (17 - 5 - 6) // 3 = 2 exactly)
        assert x[:pad] == [PAD] * pad and x[pad + 1] == x[pad + 4] == ord(">") and x[pad + 6] == QUERY
        assert x[pad + 7] in (ord("<"), ord(">")) and ord("1") <= x[pad + 9] <= ord("2")
        assert pad == 6 - end and y[-1] == ord(".") and y[: 16 - end - 1] == [-1] * (16 - end - 1)
    # multi_query, 2 needles of 1 digit, both asked, length 10: N K v N K v QUERY Ka Kb va -> va vb
    x, y = layout(Task("multi_query", num_needles=2, num_queries=2, key_length=1), 10)
    value = {x[1]: x[2], x[4]: x[5]}
    assert x[0] == x[3] == NEEDLE and x[6] == QUERY and {x[7], x[8]} == {x[1], x[4]} and x[9] == value[x[7]]
    assert y == [-1] * 8 + [value[x[7]], value[x[8]]]
    # common_words, one common word, length 16: "abc abc abc " QUERY "abc" -> "abc."
    x, y = layout(Task("common_words", num_common=1), 16)
    word = x[:3]
    assert x == [*word, 32] * 3 + [QUERY, *word] and y == [-1] * 12 + [*word, ord(".")]
    # find_block, blocks of 3, 1 asked, length 11: b1 . b2 QUERY q t1 t2 -> t1 t2 t3 (the block holding q)
    for depth, at in ((0.0, 0), (1.0, 4)):
        x, y = layout(Task("find_block", block_length=3, query_length=1), 11, depth=depth)
        hit, other = x[at : at + 3], x[4 - at : 7 - at]
        assert x[3] == ord(".") and x[7] == QUERY and x[8] in hit and x[8] not in other and x[9:] == hit[:2]
        assert y == [-1] * 8 + hit and len(set(hit)) == len(set(other)) == 3
    # latent_list, one operation, length 5: 6 ids = "a" op arg QUERY answer END, the op on the empty list
    x, y = layout(Task("latent_list", num_ops=1), 5)
    assert x[:2] in ([ord("a"), ord("+")], [ord("a"), ord("<")]) and x[3] == QUERY and x[4] == x[2]
    assert y == [-1] * 3 + [x[2], ord(".")]
    # babilong qa1, 1 fact: the text around the fact, then the question and the place
    x, y = layout(Task("babilong", num_facts=1), 200)
    raw = bytes(x + [y[-1]]).decode("latin-1")
    person, place = re.search(r"\nWhere is (\w+)\? (\w+)$", raw).groups()
    assert re.search(rf" {person} \w+ to the {place}\.", raw) and y.count(-1) == 200 - len(place)


def test_babilong_haystack_is_the_held_out_text_outside_training():
    from data.synthetic import haystack

    held_out = bytes(haystack("val").tolist())
    for split in ("train", "test"):
        x, y = Task("babilong", qa=2).sample(400, 1, 5, split)
        raw = bytes(x.tolist()).decode("latin-1")
        hay = FACT.sub("", raw[: raw.rindex("\nWhere")]).encode("latin-1")
        assert (hay in held_out) == (split == "test")  # facts removed, an excerpt of its split's text


def test_graphwalks_queries_cover_both_operations_and_every_depth():
    asked = Counter()
    sizes = Counter()
    for i in range(60):
        x, y = Task("graphwalks", walk_depth=3).sample(96, i)
        raw = bytes(x.tolist())
        asked[raw[raw.index(Q) + 1 : raw.index(Q) + 4:2]] += 1
        sizes[int((y >= 0).sum()) - 1] += 1
    assert set(asked) == {b"<1", b">1", b">2", b">3"}
    assert sizes[0] > 0 and max(sizes) >= 3  # empty answers happen, as in GraphWalks, and larger ones


def test_state_tracking_groups_have_their_orders_and_close():
    from data.tasks_2025 import group_table

    assert [len(group_table(g)) for g in ("S2", "S3", "S4", "S5", "A3", "A4", "A5")] == [2, 6, 24, 120, 3, 12, 60]
    a5 = group_table("A5")
    assert (a5[0] == np.arange(60)).all() and all(sorted(row) == list(range(60)) for row in a5)  # a Latin square
    x, y = Task("state_tracking", group="A5").sample(512, 0)
    assert x.max() < 0x80 + 60 and len(set(y.tolist())) > 50  # the products visit the group


@pytest.mark.parametrize("predicted,target,width,expected", [
    ("ab.", "ab.", 1, 1.0), ("ac.", "ab.", 1, 0.5), ("a..", "ab.", 1, 2 / 3),
    ("abc", "ab.", 1, 0.8),  # went on past the end: one element too many
    (".", ".", 1, 1.0), ("a", ".", 1, 0.0), ("abcdeX.", "abcdef.", 3, 0.5), ("aa.", "ab.", 1, 2 / 3),
])
def test_set_f1_by_hand(predicted, target, width, expected):
    assert set_f1(list(predicted.encode()), list(target.encode()), width, ord(".")) == pytest.approx(expected)


def test_f1_is_scored_for_set_valued_tasks_only(monkeypatch):
    """Through evaluate_tasks: a model that misses the first element of every answer (predicts END
    there) scores 0 exact match and F1 = 2(m-1)/(2m-1) per sample of m >= 1 elements."""
    import evaluation.tasks as tasks

    def first_element_missed(gpt, inputs, targets, *args):
        out = targets.clone()
        for row in out:
            row[int((row >= 0).nonzero()[0])] = ord(".")
        return out

    monkeypatch.setattr(tasks, "predict_answers", first_element_missed)
    gpt = tiny_gpt("alibi", config=GPTConfig(vocab_size=256, block_size=64, n_layer=1, n_head=2, n_embd=16))
    config = TaskEvalConfig(multipliers=[1], samples=6, precision="32")
    for task in (Task("graphwalks"), Task("common_words")):
        (row,) = evaluate_tasks(gpt, task, 64, config, seed=0, log=lambda _: None)
        width = 1 if task.name == "graphwalks" else 3
        sizes = [(int((task.sample(64, i, 0, "test")[1] >= 0).sum()) - 1) // width for i in range(6)]
        assert row.accuracy == (sum(m == 0 for m in sizes) / 6)  # an empty answer is its END alone: right
        assert row.f1 == pytest.approx(np.mean([1.0 if m == 0 else 2 * (m - 1) / (2 * m - 1) for m in sizes]))
    (row,) = evaluate_tasks(gpt, Task("multi_query"), 64, config, seed=0, log=lambda _: None)
    assert math.isnan(row.f1)


@pytest.mark.parametrize("make,message", [
    (lambda: Task("state_tracking", group="S6"), "data.group must be one of S2, S3, S4, S5, A3, A4, A5"),
    (lambda: Task("state_tracking", group="Z5"), "got 'Z5'"),
    (lambda: Task("graphwalks", walk_depth=10), "data.walk_depth must be <= 9 (the depth is one digit), got 10"),
    (lambda: Task("graphwalks").sample(15, 0), "length must be an integer >= 16 (the shortest graphwalks sample)"),
    (lambda: Task("graphwalks", max_answer=1).sample(50_000, 0),
     "length must be an integer <= 48773 (the longest graphwalks sample with these options), got 50000"),
    (lambda: Task("babilong", qa=4), "data.qa must be 1, 2 or 3 (bAbI's qa1-qa3), got 4"),
    (lambda: Task("babilong", qa=3, num_facts=2), "data.num_facts must be >= data.qa=3"),
    # qa1, 4 facts: 4 x len(" Daniel journeyed to the bathroom.") = 4 x 34, + "\nWhere is Daniel? " (18),
    # + "bathroom" (8), - 1 (the last answer byte is no input) = 161
    (lambda: Task("babilong").sample(100, 0), "length must be an integer >= 161 (the shortest babilong sample)"),
    # qa3 asks the longest question, "\nWhere was the football before the bathroom? " (45): 136 + 45 + 8 - 1 = 188
    (lambda: Task("babilong", qa=3).sample(187, 0), "length must be an integer >= 188 (the shortest babilong sample)"),
    (lambda: Task("multi_query", num_needles=3, num_queries=4),
     "data.num_queries must be <= data.num_needles=3 (asked keys are distinct needles), got 4"),
    (lambda: Task("multi_query", num_needles=20).sample(100, 0),
     "length must be an integer >= 164 (the shortest multi_query sample)"),
    (lambda: Task("common_words", num_common=0), "data.num_common must be an integer >= 1, got 0"),
    (lambda: Task("find_block", query_length=6), "data.query_length must be <= data.block_length=5 (the letters "
                                                 "asked are the target block's), got 6"),
    (lambda: Task("latent_list", num_ops=0), "data.num_ops must be an integer >= 1, got 0"),
    (lambda: Task("latent_list", num_ops=8).sample(32, 0), "length must be an integer >= 33 (the shortest latent_list"),
    (lambda: Task("find_block", block_length=27), "data.block_length must be <= 26 (distinct letters 'a'-'z')"),
    (lambda: SyntheticDataModule("common_words", block_size=32), "data.block_size must be an integer >= 46"),
    (lambda: SyntheticDataModule("graphwalks", depth=0.5), "data.depth must be null for data.task=graphwalks"),
    (lambda: TaskEvalConfig(f1=True).check_task(Task("passkey")),
     "eval.tasks.f1 must be null or false for data.task=passkey: its answer is a single one"),
])
def test_bad_options_name_key_value_and_what_is_allowed(make, message):
    with pytest.raises(ValueError) as err:
        make()
    assert message in str(err.value)


def test_f1_of_a_single_answer_task_is_refused_before_any_data_is_read():
    from pelab.validate import validate_config

    with pytest.raises(ConfigError, match=r"eval.tasks.f1 must be null or false for data.task=multi_value"):
        validate_config(compose(["data=synthetic", "data.task=multi_value", "eval.tasks.f1=true"]))
    validate_config(compose(["data=synthetic", "data.task=graphwalks", "eval.tasks.f1=true"]))


@pytest.mark.parametrize("name", NEW)
def test_each_task_builds_as_typed_and_trains_a_step(name):
    """``python train.py data=synthetic data.task=NAME`` validates and builds, and a batch of its
    data module takes a training step of a tiny model (the loss counts answers only)."""
    import torch

    from pelab.datamodule import build_datamodule
    from pelab.validate import validate_config

    cfg = compose(["data=synthetic", f"data.task={name}", "model.block_size=192", "data.batch_size=2"])
    validate_config(cfg)
    dm = build_datamodule(cfg.data)
    assert dm.task == Task(name) and dm.block_size == 192
    dm.setup()
    x, y = next(iter(dm.train_dataloader()))
    gpt = tiny_gpt("rope", config=GPTConfig(vocab_size=256, block_size=192, n_layer=1, n_head=2, n_embd=16))
    _, loss = gpt(x, y)
    loss.backward()
    assert x.shape == (2, 192) and torch.isfinite(loss) and gpt.lm_head.weight.grad.abs().sum() > 0
    assert 0 < dm.unigram_loss(samples=8) < math.log(256) + 1


def test_graphwalks_trains_and_scores_f1_end_to_end(tmp_path):
    """The one training run: ``python train.py data=synthetic data.task=graphwalks`` writes its task
    table with F1 beside the exact match, rows marked not learned."""
    run = tmp_path / "run"
    proc = run_python(
        ["train.py", "data=synthetic", "data.task=graphwalks", "logger=csv", f"hydra.run.dir={run}",
         "model.n_layer=1", "model.n_embd=16", "model.n_head=2", "model.block_size=32", "data.batch_size=2",
         "data.val_samples=2", "trainer.max_steps=1", "trainer.val_check_interval=1", "~callbacks.attention_maps",
         "eval.tasks.samples=2", "eval.tasks.multipliers=[1,2]", "trainer.precision=32-true",
         "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"],
        cwd=ROOT, env={**os.environ, "HYDRA_FULL_ERROR": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_csv(run / "tasks" / "tasks.csv")
    assert [(r.task, r.eval_length, r.learned) for r in rows] == [("graphwalks", n, "no") for n in (32, 64)]
    assert all(0 <= r.f1 <= 1 for r in rows) and ", F1 " in proc.stdout
    assert "(F1 " in (run / "tasks" / "tasks.md").read_text()


def test_compare_runs_shows_f1_beside_exact_match_and_marks_unlearned_runs_once(tmp_path, monkeypatch):
    """scripts/compare_runs.py on graphwalks runs: single runs get "(F1 x)" in each cell; two seeds
    per scheme get a "graphwalks F1" section after the exact-match one (mean over seeds), and the
    group with a run below the criterion at L is marked once per line."""
    import yaml

    from evaluation.tasks import TaskRow, write_csv

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import compare_runs

    def run(sweep: Path, name: str, scheme: str, seed: int, scores: dict, learned: str) -> None:
        folder = sweep / name
        config = {"seed": seed, "pe": {"_target_": f"model.pe.{scheme}"}, "model": {"block_size": 64},
                  "data": {"seed": seed, "task": "graphwalks"}, "trainer": {"max_steps": 10}}
        (folder / "checkpoints").mkdir(parents=True)
        (folder / "checkpoints" / "config.yaml").write_text(yaml.safe_dump(config))
        write_csv([TaskRow("graphwalks", scheme, 64, n, math.nan, 10, acc, acc, 0.1, learned=learned, f1=f1)
                   for n, (acc, f1) in scores.items()], folder / "tasks" / "tasks.csv")

    single = tmp_path / "single"
    run(single, "0-rope", "rope", 1, {64: (0.5, 0.75), 128: (0.0, 0.25)}, "no")
    run(single, "1-alibi", "alibi", 1, {64: (1.0, 1.0), 128: (0.9, 0.95)}, "yes")
    assert compare_runs.main([str(single)]) == 0
    md = (single / "comparison.md").read_text()
    assert "| rope [not learned at L] | 50.0 (F1 75.0) | 0.0 (F1 25.0) |" in md
    assert "| alibi | 100.0 (F1 100.0) | 90.0 (F1 95.0) |" in md
    assert [line.count("not learned") for line in md.splitlines() if line.startswith("| rope")] == [1]
    assert "by evaluation length (tokens).\n" in md and "mean over depths" not in md  # graphwalks has no depth

    seeds = tmp_path / "seeds"
    run(seeds, "0-rope", "rope", 1, {64: (0.5, 0.7), 128: (0.0, 0.2)}, "no")
    run(seeds, "1-rope", "rope", 2, {64: (1.0, 1.0), 128: (0.2, 0.4)}, "yes")
    run(seeds, "2-alibi", "alibi", 1, {64: (1.0, 1.0), 128: (1.0, 1.0)}, "yes")
    run(seeds, "3-alibi", "alibi", 2, {64: (1.0, 1.0), 128: (0.8, 0.9)}, "yes")
    assert compare_runs.main([str(seeds)]) == 0
    md = (seeds / "comparison.md").read_text()
    exact, f1 = md.index("### graphwalks\n"), md.index("### graphwalks F1\n")
    assert exact < f1 and "F1 (%) of the set-valued answer" in md[f1:]
    # F1 (70 + 100) / 2 and (20 + 40) / 2; exact match (50 + 100) / 2
    assert "| rope [1/2 not learned at L] (2) | 85.0 ± " in md[f1:] and " | 30.0 ± " in md[f1:]
    assert "| rope [1/2 not learned at L] (2) | 75.0 ± " in md[exact:f1]
    assert all(line.count("not learned") <= 1 for line in md.splitlines())
    assert "mean over depths" not in md


def test_find_block_depth_places_the_target_block_and_keeps_the_query():
    task = Task("find_block")
    # length 64: 65 ids = 9 blocks of 5 + 8 '.', QUERY, 2 letters, 5 answer, 4 PADs; the target is block round(8 d)
    seen = set()
    for depth, block in ((0.0, 0), (0.5, 4), (1.0, 8)):
        x, y = task.sample(64, 3, seed=1, depth=depth)
        raw = bytes(x.tolist()).lstrip(bytes([PAD]))
        assert len(x) - len(raw) == 4
        blocks = raw.split(Q)[0].split(b".")
        assert len(blocks) == 9 and list(blocks[block]) == list(y[y >= 0])
        seen.add((bytes(y[y >= 0].tolist()), raw.split(Q)[1]))
    assert len(seen) == 1  # the same target and query at every depth
    spots = Counter(bytes(task.sample(64, i)[0].tolist()).lstrip(b"\0").split(Q)[0].split(b".").index(
        bytes(task.sample(64, i)[1][-5:].tolist())) for i in range(90))
    assert set(spots) == set(range(9))  # no depth given: every block


def test_task_evaluation_scores_depth_rows_only_for_find_block():
    """At L x {1, 2}: find_block by depth (its heatmap), the others one row a length."""
    gpt = tiny_gpt("alibi", config=GPTConfig(vocab_size=256, block_size=64, n_layer=1, n_head=2, n_embd=16))
    config = TaskEvalConfig(multipliers=[1, 2], depths=[0.0, 1.0], samples=2, precision="32")
    for name in NEW:
        rows = evaluate_tasks(gpt, Task(name), 200, config, seed=0, log=lambda _: None)
        depth = name == "find_block"
        assert [(r.eval_length, r.ok) for r in rows] == [(n, True) for n in (200, 400) for _ in range(1 + depth)]
        assert all(math.isnan(r.depth) != depth for r in rows)
        assert all(math.isnan(r.f1) != Task(name).set_valued for r in rows)


# --- frequent_words ---------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)  # a million terms: computed once per alpha
def zeta(alpha: float) -> float:
    """Riemann's zeta by brute force, independent of the layout's: a million terms and the
    integral of the rest with its first correction (error ~ alpha N^(-alpha-1) / 12)."""
    n = 10**6
    return float(np.sum(np.arange(1, n, dtype=np.float64) ** -alpha) + n ** (1 - alpha) / (alpha - 1) + n**-alpha / 2)


def test_frequent_words_shortest_layout_by_hand():
    """One word asked, alpha 2, length 32: 33 ids = 7 words of 4 ids, QUERY, the word, END. RULER's
    counts of 7 words: rank 1 floor(7/zeta(2)) = 4, rank 2 floor(7/(4 zeta(2))) = 1, rank 3 0; the
    noise (rank 1) takes the 2 the floors leave: 6 x "... " and the word once."""
    x, y = layout(Task("frequent_words", num_common=1), 32)
    words = [bytes(x[i : i + 4]) for i in range(0, 28, 4)]
    word = next(w for w in words if w != b"... ")
    assert sorted(words) == [b"... "] * 6 + [word] and word[:3].isalpha()
    assert x[28] == QUERY and bytes(x[29:]) == word[:3] and y == [-1] * 28 + [*word[:3], ord(".")]


@pytest.mark.parametrize("alpha,asked,length", [(2.0, 3, 222), (2.0, 3, 1024), (1.1, 3, 2048), (3.0, 2, 4096)])
def test_frequent_words_counts_are_rulers_zipf_counts(alpha, asked, length):
    """Counted back from the bytes: rank k (k >= 2) occurs floor(W k^-alpha / zeta(alpha)) times
    (zeta by brute force), the noise word the rest of the W words."""
    task = Task("frequent_words", alpha=alpha, num_common=asked)
    for index in range(3):
        x, _ = task.sample(length, index, seed=4, split="test")
        words = bytes(x.astype(np.uint8).tolist()).lstrip(bytes([PAD])).split(Q)[0].split()
        counts = Counter(words)
        noise = counts.pop(b"...")
        total = len(words)
        expected = [math.floor(total * k**-alpha / zeta(alpha)) for k in range(2, total + 2)]
        assert sorted(counts.values(), reverse=True) == [c for c in expected if c > 0]
        assert noise == total - sum(counts.values()) and total == (length - 1 - 3 * asked) // 4


def test_frequent_words_shortest_length_is_where_the_top_words_are_unique():
    """At alpha 2 with 3 asked, 52 words (length 221) give ranks 4 and 5 one occurrence each
    (52 / (16 zeta(2)) = 1.98, 52 / (25 zeta(2)) = 1.26): a tie, refused; 53 (length 222) is
    the shortest from which on rank 4 always outnumbers rank 5."""
    counts = lambda words, k: math.floor(words * k**-2 / zeta(2))  # noqa: E731
    assert counts(52, 4) == counts(52, 5) == 1
    assert all(counts(w, 4) > counts(w, 5) for w in range(53, 2000))
    assert Task("frequent_words").min_length == 4 * 53 + 9 + 1
    with pytest.raises(ValueError, match=r"length must be an integer >= 222 \(the shortest frequent_words sample\)"):
        Task("frequent_words").sample(221, 0)


@pytest.mark.parametrize("make,message", [
    (lambda: Task("frequent_words", alpha=1.0), "data.alpha must be a number in (1, 4] (the Zipf exponent of "
                                                "frequent_words, RULER's 2.0: the counts k^-alpha / zeta(alpha) need "
                                                "alpha > 1), got 1.0"),
    (lambda: Task("frequent_words", alpha=True), "data.alpha must be a number in (1, 4]"),
    (lambda: Task("frequent_words", alpha="2"), "got '2'"),
    (lambda: SyntheticDataModule("frequent_words", block_size=128),
     "data.block_size must be an integer >= 222 (the shortest frequent_words sample with these options), got 128"),
    (lambda: SyntheticDataModule("frequent_words", block_size=512, alpha=1.1),
     "data.block_size must be an integer >= 790"),
    (lambda: TaskEvalConfig(f1=True).check_task(Task("passkey")),
     "F1 scores set-valued answers (graphwalks, common_words, frequent_words)"),
])
def test_frequent_words_bad_options_are_one_line(make, message):
    with pytest.raises(ValueError) as err:
        make()
    assert message in str(err.value) and "\n" not in str(err.value)


def test_frequent_words_builds_as_typed_and_scores_f1(monkeypatch):
    """``data=synthetic data.task=frequent_words`` at the default length (256) builds and takes a
    step; evaluation scores its set answers with F1 (first word missed: F1 2(3-1)/(2*3-1) = 0.8)."""
    import torch

    import evaluation.tasks as tasks
    from pelab.datamodule import build_datamodule
    from pelab.validate import validate_config

    cfg = compose(["data=synthetic", "data.task=frequent_words", "model.block_size=256", "data.batch_size=2"])
    validate_config(cfg)
    dm = build_datamodule(cfg.data)
    assert dm.task == Task("frequent_words") and dm.task.alpha == 2.0
    dm.setup()
    x, y = next(iter(dm.train_dataloader()))
    gpt = tiny_gpt("rope", config=GPTConfig(vocab_size=256, block_size=256, n_layer=1, n_head=2, n_embd=16))
    _, loss = gpt(x, y)
    loss.backward()
    assert x.shape == (2, 256) and torch.isfinite(loss) and int((y[0] >= 0).sum()) == 3 * 3 + 1

    def first_element_missed(gpt, inputs, targets, *args):
        out = targets.clone()
        for row in out:
            row[int((row >= 0).nonzero()[0])] = ord(".")
        return out

    monkeypatch.setattr(tasks, "predict_answers", first_element_missed)
    config = TaskEvalConfig(multipliers=[1], samples=4, precision="32")
    (row,) = tasks.evaluate_tasks(gpt, Task("frequent_words"), 256, config, seed=0, log=lambda _: None)
    assert row.accuracy == 0 and row.f1 == pytest.approx(0.8)
