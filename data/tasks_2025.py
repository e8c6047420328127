"""The synthetic long-context tasks of the 2025–26 papers, as layouts of ``data/synthetic.py``'s
``Task`` (which validates their options and draws their samples; a layout reads the options it
needs from the task): a pure function of (task,
options, split, seed, index, length), lengths counted in pelab's own (byte) tokens, the answer
always whole at the end (asserted in every layout).

Layouts (``seq`` has n = length + 1 ids and the answers are next-token targets, as in
data/synthetic.py, except state_tracking, whose targets are labels of the inputs):

- ``state_tracking`` (the word problem of Merrill et al. 2024, as trained by Grazzi et al., ICLR
  2025, and reported by PaTH, DeltaProduct and Selective RoPE): ``length`` elements g1..gL of the
  permutation group ``group`` (S2-S5 or A3-A5), element i of the group (permutations of 0..m-1
  in lexicographic order, the even ones for A) being id ``GROUP_BASE + i``, drawn uniformly.
  Target at position t: the running product p_t = g_t after p_(t-1) (p_t[i] = g_t[p_(t-1)[i]]),
  at every position, the papers' per-position variant (not the final product alone): token
  accuracy is their accuracy, exact match asks every prefix right. Inputs are not shifted: the
  labels are not tokens of the sequence.
- ``graphwalks`` (openai/graphwalks): ``[PAD]*s`` then E directed edges ``u > v`` (no
  separator; distinct, no self-loops) over N = min(128, max(3, ceil(E / 2))) nodes (one id each, a
  random subset of ids ``NODE_BASE`` .. 0xFF), E = (n - 5 - max_answer) // 3, then ``QUERY op x d``
  and the answer: op '>' = breadth-first search from x, answer the nodes at distance exactly d
  (1 <= d <= ``walk_depth``, one digit), not x; op '<' with d = 1 = the parents of x. Answer: the
  node ids in increasing order, then ``END`` ('.'); it may be empty (just END). A query whose
  answer has more than ``max_answer`` nodes is not asked (the next of a random order of
  queries is); s = n - 5 - 3E - |answer| leading PADs absorb the answer's size. A set: scored
  by exact match and F1.
- ``babilong`` (booydar/babilong, qa1-qa3 of bAbI): ``num_facts`` fact sentences (`` Mary went to
  the kitchen.``, `` John picked up the apple.``), in story order at uniform word breaks of an
  excerpt of the embedded Gutenberg text (the haystack of ``niah``, its split likewise), then the
  question and the answer, a location word: qa1 ``\\nWhere is Mary? `` (her last move), qa2
  ``\\nWhere is the apple? `` (where its holder went last), qa3 ``\\nWhere was the apple before the
  garden? `` (where its holder picked it up, then carried it to the garden). The supporting
  facts (1, 2, 3) are planted; the others are moves of other people and their picking up of
  other objects (distractors). No depth: the facts are spread over the text.
- ``multi_query`` (RULER's multi-query NIAH): ``num_needles`` needles ``NEEDLE K v1..vk``
  (distinct keys 'A'-'Z', values of ``key_length`` digits) at uniform depths of the passkey
  filler, then ``QUERY K1..Kq`` (q = ``num_queries`` distinct keys of them, RULER's 4 of 4) and
  their values in the order asked. Answer: the q values. No depth (several are asked).
- ``common_words`` (RULER's common-word extraction, the aggregation task): ``[PAD]*s`` then W
  words of three letters 'a'-'z', each followed by a space: ``num_common`` common words appear
  ``COMMON_TIMES`` times each, the others once (RULER: 30 and 3 times; scaled down to tiny
  contexts), all shuffled; W = (n - 2 - 3c) // 4, s = n - 2 - 3c - 4W < 4. Then ``QUERY`` and the
  answer: the common words in alphabetical order (three letters each, no separator), then END.
  A set: scored by exact match and F1 (RULER scores recall of the words).
- ``frequent_words`` (RULER's frequent-word extraction, fwe, the other aggregation task):
  ``[PAD]*s`` then W words of three letters 'a'-'z', each followed by a space, in a random
  order, whose counts follow Zipf's law: the word of rank k occurs floor(W k^-alpha / zeta(alpha))
  times (``alpha``: RULER's 2.0); rank 1 is the noise word ``...`` (RULER's, which the question
  says to ignore), which also takes the W slots the floors leave; W = (n - 2 - 3c) // 4, s = n -
  2 - 3c - 4W < 4. Then ``QUERY`` and the answer: the words of ranks 2 .. c + 1 (c = ``num_common``,
  RULER's 3), the c most frequent words, in alphabetical order (three letters each), then END.
  Lengths where rank c + 1 does not occur more often than rank c + 2 (the answer would not be
  the unique top c) are below ``min_length``. A set: scored by exact match and F1 (RULER scores
  recall of the words).
- ``find_block`` (MTA's toy task, Golovneva et al. 2025, after RAM's ``toy_task/generate_data.py``):
  ``[PAD]*s`` then B blocks of ``block_length`` distinct letters 'a'-'z' joined by '.', then
  ``QUERY`` and ``query_length`` distinct letters of the target block in a random order, then
  the answer: the target block. No other block holds every query letter. B = (n - q - N) // (N + 1)
  (N = block_length, q = query_length: every block whole, where RAM cuts the text to length),
  s = the rest; the target is block round(depth x (B - 1)) (uniform with no depth).
- ``latent_list`` (after Michelangelo's Latent List, Vodrahalli et al. 2024, whose generator is
  not public: a list tracked through operations among irrelevant ones; this grammar is pelab's):
  ``[PAD]*s`` then S three-token statements ``v op x`` on list v = 'a' (``num_ops`` of them, at
  uniform places) or 'b' (the distractors): ``+d`` appends digit d, ``<d`` puts d first, ``-.``
  drops the last item (only of a non-empty list), ``~.`` reverses; both lists start empty. Then
  ``QUERY`` and the answer: list a's digits, first to last, then END (empty: END alone). S =
  (n - 2 - num_ops) // 3, s = n - 2 - |a| - 3S absorbs the answer's size.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import numpy as np

from data.task_parts import DIGITS, LOWER, NEEDLE, PAD, QUERY, UPPER, _ids, _in_filler, haystack

GROUPS = ("S2", "S3", "S4", "S5", "A3", "A4", "A5")  # the largest whose elements fit ids 0x80..0xFF
GROUP_BASE = 0x80  # state_tracking: group element i is id GROUP_BASE + i
NODE_BASE, MAX_NODES = 0x80, 128  # graphwalks: node ids 0x80..0xFF
FORWARD, BACKWARD = ord(">"), ord("<")  # graphwalks: an edge u > v; a query's direction
END = ord(".")  # graphwalks, common_words: after the last element of a set-valued answer
COMMON_TIMES = 3  # common_words: occurrences of each common word (the others occur once)
WORD = 3  # common_words, frequent_words: letters in a word
WORDS = 26**WORD  # distinct words of WORD letters
NOISE_WORD = ord(".")  # frequent_words: the letters of the noise word (rank 1), "..."
BLOCK_END = ord(".")  # find_block: between two blocks
PERSONS = ("Mary", "John", "Daniel", "Sandra")  # babilong: bAbI's people, places, objects and verbs
PLACES = ("bathroom", "hallway", "kitchen", "garden", "office", "bedroom")
OBJECTS = ("football", "apple", "milk")
MOVES = ("went", "moved", "journeyed", "travelled")
TAKES = ("picked up", "grabbed", "got", "took")

#: set-valued tasks: tokens per element of the answer (the answer is elements, then END)
SET_ELEMENT_WIDTH = {"graphwalks": 1, "common_words": WORD, "frequent_words": WORD}


@dataclass(frozen=True)
class Labelled:
    """A layout whose targets label the inputs (not the next tokens): both of ``length``."""

    inputs: np.ndarray
    targets: np.ndarray


# --- state_tracking ------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def group_table(group: str) -> np.ndarray:
    """``table[a, b]``: the index of "a, then b" (p[i] = b[a[i]]) among the group's elements,
    permutations of 0..m-1 in lexicographic order (the even ones for A)."""
    m = int(group[1:])
    perms = [p for p in itertools.permutations(range(m)) if group[0] == "S" or _even(p)]
    index = {p: i for i, p in enumerate(perms)}
    return np.array([[index[tuple(b[a[i]] for i in range(m))] for b in perms] for a in perms], dtype=np.int64)


def _even(p: tuple[int, ...]) -> bool:
    return sum(p[i] > p[j] for i in range(len(p)) for j in range(i + 1, len(p))) % 2 == 0


def state_tracking(task, rng: np.random.Generator, n: int, depth: None, split: str) -> Labelled:
    table = group_table(task.group)
    elements = rng.integers(0, len(table), n - 1)
    products = np.empty_like(elements)
    product = elements[0]
    products[0] = product
    for t in range(1, len(elements)):  # a few thousand table look-ups: a plain loop is clear and fast enough
        product = table[product, elements[t]]
        products[t] = product
    return Labelled(elements + GROUP_BASE, products + GROUP_BASE)


# --- graphwalks ----------------------------------------------------------------------------

def graph_size(n: int, max_answer: int) -> tuple[int, int]:
    """(edges, nodes) of a sample of n ids."""
    edges = (n - 5 - max_answer) // 3
    return edges, min(MAX_NODES, max(3, (edges + 1) // 2))  # N(N-1) >= 2N >= E: the edges fit


def nodes_at(adjacency: list[set[int]], start: int, depth: int) -> set[int]:
    """The nodes whose shortest distance from ``start`` is exactly ``depth``."""
    seen, frontier = {start}, {start}
    for _ in range(depth):
        frontier = {v for u in frontier for v in adjacency[u]} - seen
        seen |= frontier
    return frontier


def graphwalks(task, rng: np.random.Generator, n: int, depth: None, split: str):
    edges, nodes = graph_size(n, task.max_answer)
    assert edges <= nodes * (nodes - 1), (n, edges, nodes)  # min_length / max_length keep it so
    ids = np.sort(rng.choice(MAX_NODES, nodes, replace=False)) + NODE_BASE
    pairs = rng.choice(nodes * (nodes - 1), edges, replace=False)  # edge k: u = k // (N-1), v the (k % (N-1))-th other
    u, v = pairs // (nodes - 1), pairs % (nodes - 1)
    v = v + (v >= u)
    forward, backward = [set() for _ in range(nodes)], [set() for _ in range(nodes)]
    for a, b in zip(u.tolist(), v.tolist()):
        forward[a].add(b)
        backward[b].add(a)
    # queries (direction, node, depth) in a random order; the first whose answer fits is asked
    queries = [(BACKWARD, x, 1) for x in range(nodes)] + [
        (FORWARD, x, d) for x in range(nodes) for d in range(1, task.walk_depth + 1)]
    for q in rng.permutation(len(queries)):
        direction, x, d = queries[q]
        answer = nodes_at(backward if direction == BACKWARD else forward, x, d)
        if len(answer) <= task.max_answer:
            break
    else:
        raise AssertionError(f"no graphwalks query of at most {task.max_answer} nodes in a graph of {edges} edges")
    answer_ids = np.concatenate([ids[sorted(answer)], [END]]).astype(np.int64)
    edge_list = np.stack([ids[u], np.full(edges, FORWARD), ids[v]], axis=1).reshape(-1)
    pad = n - 4 - len(edge_list) - len(answer_ids)
    assert 0 <= pad <= task.max_answer + 2, pad  # the answer is never cut off
    seq = np.concatenate([[PAD] * pad, edge_list, [QUERY, direction, ids[x], DIGITS + d], answer_ids])
    return seq, np.arange(n - len(answer_ids), n)


# --- babilong ------------------------------------------------------------------------------

QUESTIONS = {1: "\nWhere is {name}? ", 2: "\nWhere is the {obj}? ", 3: "\nWhere was the {obj} before the {place}? "}


def babilong_story(qa: int, facts: int, rng: np.random.Generator) -> tuple[list[str], str, str]:
    """(fact sentences in story order, question, answer): the supporting facts of qa1/qa2/qa3
    for one person (and object), the others distractors by other people."""
    person = int(rng.integers(len(PERSONS)))
    others = [p for p in range(len(PERSONS)) if p != person]
    thing = int(rng.integers(len(OBJECTS)))
    free = [o for o in range(len(OBJECTS)) if o != thing]  # objects a distractor may pick up (once each)
    where: dict[int, int] = {}  # person -> place

    def move(p: int) -> str:
        place = int(rng.choice([x for x in range(len(PLACES)) if x != where.get(p)]))
        where[p] = place
        return f" {PERSONS[p]} {MOVES[int(rng.integers(len(MOVES)))]} to the {PLACES[place]}."

    def take(p: int, o: int) -> str:
        return f" {PERSONS[p]} {TAKES[int(rng.integers(len(TAKES)))]} the {OBJECTS[o]}."

    # the asked person's facts: qa1 one or two moves; qa2 a move and a pick-up in either order;
    # qa3 a move, the pick-up, another move
    plan = {1: ["move"] * int(rng.integers(1, min(2, facts) + 1)),
            2: ["move", "take"] if rng.random() < 0.5 else ["take", "move"], 3: ["move", "take", "move"]}[qa]
    slots = set(rng.choice(facts, len(plan), replace=False).tolist())  # which facts are the asked person's
    story, steps, carried_from = [], iter(plan), None
    for i in range(facts):
        if i in slots:
            step = next(steps)
            if step == "take":
                carried_from = where.get(person)
                story.append(take(person, thing))
            else:
                story.append(move(person))
        else:
            p = int(rng.choice(others))
            if free and p in where and rng.random() < 0.25:
                story.append(take(p, free.pop(int(rng.integers(len(free))))))
            else:
                story.append(move(p))
    question = QUESTIONS[qa].format(name=PERSONS[person], obj=OBJECTS[thing], place=PLACES[where[person]])
    return story, question, PLACES[carried_from if qa == 3 else where[person]]


def babilong(task, rng: np.random.Generator, n: int, depth: None, split: str):
    story, question, answer = babilong_story(task.qa, task.num_facts, rng)
    facts = [_ids(s.encode()) for s in story]
    tail = _ids((question + answer).encode())
    size = n - sum(map(len, facts)) - len(tail)
    assert size >= 0, (n, size)  # min_length keeps the story, question and answer whole
    text = haystack("train" if split == "train" else "val")
    start = int(rng.integers(0, len(text) - size))
    hay = text[start : start + size]
    spaces = np.flatnonzero(hay == ord(" "))
    cuts = np.sort(rng.random(len(facts)) * size).astype(int)
    # to the word break at or before each (so a fact never splits a word); monotone, so in order
    cuts = [int(spaces[np.searchsorted(spaces, c, side="right") - 1]) if (spaces <= c).any() else c for c in cuts]
    parts, at = [], 0
    for cut, fact in zip(cuts, facts):
        parts += [hay[at:cut], fact]
        at = cut
    seq = np.concatenate([*parts, hay[at:], tail])
    return seq, np.arange(n - len(answer), n)


def babilong_min_length(task) -> int:
    longest = lambda words: max(map(len, words))  # noqa: E731
    fact = len(" ") + longest(PERSONS) + 1 + max(longest(MOVES) + len(" to the ") + longest(PLACES),
                                                  longest(TAKES) + len(" the ") + longest(OBJECTS)) + len(".")
    question = len(QUESTIONS[task.qa].format(name="x" * longest(PERSONS), obj="x" * longest(OBJECTS),
                                             place="x" * longest(PLACES)))  # the asked qa's question only
    return task.num_facts * fact + question + longest(PLACES) - 1


# --- multi_query ---------------------------------------------------------------------------

def multi_query(task, rng: np.random.Generator, n: int, depth: None, split: str):
    k, count, asked = task.key_length, task.num_needles, task.num_queries
    keys = rng.choice(26, count, replace=False) + UPPER
    values = rng.integers(0, 10, (count, k)) + DIGITS
    needles = [np.concatenate([[NEEDLE, key], value]) for key, value in zip(keys, values)]
    hay = _in_filler(needles, rng.random(count), n - count * (k + 2) - 1 - asked - asked * k)
    order = rng.choice(count, asked, replace=False)
    seq = np.concatenate([hay, [QUERY], keys[order], values[order].reshape(-1)])
    return seq, np.arange(n - asked * k, n)


# --- common_words --------------------------------------------------------------------------

def common_words(task, rng: np.random.Generator, n: int, depth: None, split: str):
    c = task.num_common
    words = (n - 2 - WORD * c) // (WORD + 1)
    rare = words - COMMON_TIMES * c
    assert rare >= 0, (n, words)  # min_length keeps the common words and the answer whole
    drawn = rng.choice(26**WORD, c + rare, replace=False)  # distinct words, as numbers base 26
    common = np.sort(drawn[:c])  # alphabetical = numerical order
    text = rng.permutation(np.concatenate([np.repeat(common, COMMON_TIMES), drawn[c:]]))
    letters = lambda w: (w[:, None] // 26 ** np.arange(WORD - 1, -1, -1)) % 26 + LOWER  # noqa: E731
    listed = np.concatenate([letters(text), np.full((len(text), 1), ord(" "))], axis=1).reshape(-1)
    answer = np.concatenate([letters(common).reshape(-1), [END]])
    pad = n - len(listed) - 1 - len(answer)
    assert 0 <= pad <= WORD, pad
    return np.concatenate([[PAD] * pad, listed, [QUERY], answer]), np.arange(n - len(answer), n)


# --- frequent_words ------------------------------------------------------------------------

def zeta(alpha: float) -> float:
    """Riemann's zeta(alpha) for alpha > 1: 63 terms, then the Euler-Maclaurin remainder (error
    below 1e-12 for alpha >= 1.01)."""
    k = np.arange(1, 64, dtype=np.float64)
    m = 64.0
    return float(np.sum(k**-alpha) + m ** (1 - alpha) / (alpha - 1) + m**-alpha / 2 + alpha * m ** (-alpha - 1) / 12
                 - alpha * (alpha + 1) * (alpha + 2) * m ** (-alpha - 3) / 720)


def zipf_counts(words: int, alpha: float) -> np.ndarray:
    """Occurrences of the words of rank 1, 2, ... among ``words`` (the ranks that occur at all):
    floor(words k^-alpha / zeta(alpha)), RULER's counts; rank 1 (the noise) also takes the slots
    the floors leave, so they sum to ``words``."""
    scale = words / zeta(alpha)
    ranks = np.arange(1, int(scale ** (1 / alpha)) + 2, dtype=np.float64)  # one past the last with a count >= 1
    counts = np.floor(scale * ranks**-alpha).astype(np.int64)
    counts = counts[counts > 0]
    if len(counts):
        counts[0] += words - counts.sum()
    return counts


def frequent_words_fit(words: int, alpha: float, asked: int) -> bool:
    """The ``asked`` words after the noise occur, each more often than every other word, and the
    words there are differ (three letters each)."""
    counts = zipf_counts(words, alpha)
    after = counts[asked + 1] if len(counts) > asked + 1 else 0
    return len(counts) > asked and counts[asked] > after and len(counts) - 1 <= WORDS


def frequent_words_slots(n: int, asked: int) -> int:
    return (n - 2 - WORD * asked) // (WORD + 1)


@functools.lru_cache(maxsize=None)
def frequent_words_range(alpha: float, asked: int) -> tuple[int, int]:
    """(fewest, most) words W such that every W between fits: from rank ``asked`` + 1's count
    passing rank ``asked`` + 2's for good (W (a - b) >= 1) downward to the first that does not
    fit; up to the last W whose ranks fit the three-letter words (the count of ranks grows with W)."""
    z = zeta(alpha)
    a, b = (asked + 1) ** -alpha / z, (asked + 2) ** -alpha / z
    low = int(np.ceil(1 / (a - b)))
    while low > 1 and frequent_words_fit(low - 1, alpha, asked):
        low -= 1
    high, step = low, 1
    while frequent_words_fit(high + step, alpha, asked) and high + step < 2**40:  # doubling, then halving
        high, step = high + step, step * 2
    while step > 1:
        step //= 2
        if frequent_words_fit(high + step, alpha, asked):
            high += step
    return low, high


def frequent_words(task, rng: np.random.Generator, n: int, depth: None, split: str):
    c, words = task.num_common, frequent_words_slots(n, task.num_common)
    counts = zipf_counts(words, task.alpha)
    assert frequent_words_fit(words, task.alpha, c), (n, words)  # min_length / max_length keep it so
    ranked = rng.choice(WORDS, len(counts) - 1, replace=False)  # the words of ranks 2, 3, ... as numbers base 26
    text = rng.permutation(np.repeat(np.concatenate([[-1], ranked]), counts))  # -1: the noise word
    letters = lambda w: (w[:, None] // 26 ** np.arange(WORD - 1, -1, -1)) % 26 + LOWER  # noqa: E731
    spelled = np.where(text[:, None] < 0, NOISE_WORD, letters(np.maximum(text, 0)))
    listed = np.concatenate([spelled, np.full((len(text), 1), ord(" "))], axis=1).reshape(-1)
    answer = np.concatenate([letters(np.sort(ranked[:c])).reshape(-1), [END]])
    pad = n - len(listed) - 1 - len(answer)
    assert 0 <= pad <= WORD, pad  # the answer is never cut off
    return np.concatenate([[PAD] * pad, listed, [QUERY], answer]), np.arange(n - len(answer), n)


# --- find_block ----------------------------------------------------------------------------

def find_block(task, rng: np.random.Generator, n: int, depth: float | None, split: str):
    size, asked = task.block_length, task.query_length
    blocks = (n - asked - size) // (size + 1)
    target = rng.choice(26, size, replace=False)
    query = rng.choice(target, asked, replace=False)
    at = int(round((rng.random() if depth is None else depth) * (blocks - 1)))
    letters = np.argsort(rng.random((blocks, 26)), axis=1)[:, :size]  # distinct letters per block
    while True:  # a block with every query letter would be a second answer: drawn again (RAM's rule)
        clash = np.isin(letters, query).sum(axis=1) == asked
        if not clash.any():
            break
        letters[clash] = np.argsort(rng.random((int(clash.sum()), 26)), axis=1)[:, :size]
    letters[at] = target
    text = np.concatenate([letters + LOWER, np.full((blocks, 1), BLOCK_END)], axis=1).reshape(-1)[:-1]
    pad = n - len(text) - 1 - asked - size
    assert 0 <= pad <= size, pad  # every block whole, the answer too
    seq = np.concatenate([[PAD] * pad, text, [QUERY], query + LOWER, target + LOWER])
    return seq, np.arange(n - size, n)


# --- latent_list ---------------------------------------------------------------------------

APPEND, PREPEND, DROP, REVERSE = ord("+"), ord("<"), ord("-"), ord("~")  # latent_list's operations


def latent_list(task, rng: np.random.Generator, n: int, depth: None, split: str):
    statements = (n - 2 - task.num_ops) // 3
    relevant = set(rng.choice(statements, task.num_ops, replace=False).tolist())
    lists: dict[int, list[int]] = {ord("a"): [], ord("b"): []}
    text = np.empty((statements, 3), dtype=np.int64)
    ops, digits = rng.integers(0, 4, statements), rng.integers(0, 10, statements) + DIGITS
    for i in range(statements):  # a few hundred statements: a plain loop is clear and fast enough
        name = ord("a") if i in relevant else ord("b")
        items = lists[name]
        op = (APPEND, PREPEND, DROP, REVERSE)[ops[i] if items or ops[i] < 2 else ops[i] - 2]  # no drop of nothing
        if op == APPEND:
            items.append(int(digits[i]))
        elif op == PREPEND:
            items.insert(0, int(digits[i]))
        elif op == DROP:
            items.pop()
        else:
            items.reverse()
        text[i] = name, op, digits[i] if op in (APPEND, PREPEND) else END
    answer = np.array([*lists[ord("a")], END], dtype=np.int64)
    pad = n - 1 - len(answer) - 3 * statements
    assert 0 <= pad <= task.num_ops + 2, pad  # the answer is never cut off
    return np.concatenate([[PAD] * pad, text.reshape(-1), [QUERY], answer]), np.arange(n - len(answer), n)


#: name -> layout(task, rng, n, depth, split): (seq, answer indices) or Labelled
LAYOUTS = {"state_tracking": state_tracking, "graphwalks": graphwalks, "babilong": babilong,
           "multi_query": multi_query, "common_words": common_words, "find_block": find_block,
           "latent_list": latent_list, "frequent_words": frequent_words}


def min_length(task) -> int:
    """The shortest input length whose layout fits (graphwalks: two edges)."""
    k = task.key_length
    if task.name == "frequent_words":  # n = length + 1 ids hold W words, QUERY, the answer and END
        return (WORD + 1) * frequent_words_range(task.alpha, task.num_common)[0] + WORD * task.num_common + 1
    return {"state_tracking": 1, "graphwalks": 10 + task.max_answer, "babilong": babilong_min_length(task),
            "multi_query": task.num_needles * (k + 2) + task.num_queries * (k + 1),
            "common_words": (WORD + 1) * COMMON_TIMES * task.num_common + WORD * task.num_common + 1,
            "find_block": 2 * task.block_length + task.query_length, "latent_list": 4 * task.num_ops + 1}[task.name]


def max_length(task) -> int | None:
    """The longest input length whose layout fits (graphwalks: every edge of 128 nodes); None: any."""
    if task.name == "graphwalks":
        return 3 * MAX_NODES * (MAX_NODES - 1) + 4 + task.max_answer
    if task.name == "frequent_words":  # its ranks fit the three-letter words (s <= 3 PADs more)
        return (WORD + 1) * frequent_words_range(task.alpha, task.num_common)[1] + WORD * task.num_common + 1 + WORD
    return None


__all__ = ["GROUPS", "LAYOUTS", "SET_ELEMENT_WIDTH", "END", "Labelled", "group_table", "min_length", "max_length"]
