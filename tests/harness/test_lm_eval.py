"""lm-evaluation-harness on an exported model: the shipped task lm_eval_tasks/pelab_gutenberg runs
offline through lm-eval's Hugging Face backend, and its rolling log-likelihood equals pelab's own
(scripts/eval_rolling.py) within 1e-3 nats per token. lm-eval (the ``eval`` extra) is the reference;
without it these tests are skipped."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
lm_eval = pytest.importorskip("lm_eval")
from lm_eval.tasks import TaskManager  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

from data.corpus import GutenbergCorpus  # noqa: E402
from evaluation.rolling import rolling_windows  # noqa: E402
from tests.scripts.test_export_hf import script as export_script  # noqa: E402
from tests.scripts.test_export_hf import write_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "lm_eval_tasks"
DATA = TASKS / "pelab_gutenberg" / "gutenberg_val.jsonl"

# name: (pe scheme, its options, model options, tokenizer, documents scored): lm-eval's max_length is
# GPT-2's n_positions or GPT-NeoX's max_position_embeddings (64: the tiny model's block_size)
CASES = {
    "learned_gpt2": ("learned", {}, dict(bias=True), "gpt2", 1),  # one: 50257-wide logits are the slow part
    "rope_bytes": ("rope", {"base": 500.0}, dict(bias=False), "bytes", 2),
}
# bytes' end-of-text (0x1E) is an ordinary byte, no special token: lm-eval is told its prefix
MODEL_ARGS = {"gpt2": {}, "bytes": {"prefix_token_id": 30}}


def eval_rolling():
    spec = importlib.util.spec_from_file_location("pelab_script_eval_rolling", ROOT / "scripts" / "eval_rolling.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "scripts"))
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("n_tokens", [1, 5, 63, 64, 65, 128, 130, 200])
@pytest.mark.parametrize("max_length", [1, 8, 64])
def test_windows_are_lm_evals(n_tokens, max_length):
    tokens = list(range(1000, 1000 + n_tokens))
    seq = [7, *tokens]
    theirs = [make_disjoint_window(w) for w in get_rolling_token_windows(tokens, 7, max_length, 1)]
    ours = rolling_windows(n_tokens, max_length)
    assert len(ours) == len(theirs)
    for (start, end, scored), (context, continuation) in zip(ours, theirs):
        model_input = (context + continuation)[-(max_length + 1):][:-1]  # what lm-eval's HF backend feeds
        assert seq[start:end] == model_input
        assert seq[end - scored + 1 : end + 1] == continuation


def test_the_task_holds_the_start_of_each_held_out_book():
    rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines()]
    held_out = GutenbergCorpus(val_fraction=0.1).documents()["val"]
    assert [row["title"] for row in rows] == [title for title, _ in held_out]
    for row, (_, body) in zip(rows, held_out):
        text = row["text"]
        assert body.startswith(text[:-1]) and body[len(text) - 1 : len(text) + 1] == "\n\n"  # whole paragraphs
        assert 8000 < len(text) <= 10_000


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval")
    folders = {}
    for name, (scheme, pe_options, model_options, tokenizer, _) in CASES.items():
        ckpt = write_checkpoint(root / name / "checkpoints", scheme, pe_options, model_options, tokenizer)
        out = root / name / "hf"
        assert export_script().main([f"ckpt={ckpt}", f"out={out}"]) == 0
        folders[name] = (ckpt, out)
    return folders


@pytest.mark.parametrize("name", CASES)
def test_lm_eval_rolling_loglikelihood_equals_pelabs(exported, name, tmp_path):
    ckpt, out = exported[name]
    tokenizer, n_docs = CASES[name][3:]
    results = lm_eval.simple_evaluate(
        model="hf", model_args={"pretrained": str(out), "dtype": "float32", **MODEL_ARGS[tokenizer]},
        tasks=["pelab_gutenberg"], task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
        device="cpu", batch_size=16, limit=n_docs, log_samples=True, bootstrap_iters=0)
    theirs = [sample["resps"][0][0] for sample in results["samples"]["pelab_gutenberg"]]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(DATA.read_text(encoding="utf-8").splitlines(keepends=True)[:n_docs]), encoding="utf-8")
    ours = eval_rolling().main([f"ckpt={ckpt}", f"data={data}", "device=cpu"])
    assert ours["max_length"] == 64
    assert len(theirs) == len(ours["loglikelihoods"]) == n_docs
    for mine, lm, n_tokens in zip(ours["loglikelihoods"], theirs, ours["tokens"]):
        assert abs(mine - lm) / n_tokens <= 1e-3  # nats per token
    metrics = results["results"]["pelab_gutenberg"]
    for key in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        assert math.isclose(metrics[f"{key},none"], ours[key], rel_tol=1e-3)
    assert ours["nats_per_token"] > 1.0  # a spread random model: far from certain predictions


def test_eval_rolling_refuses_bad_options_in_one_line(exported, tmp_path):
    ckpt, _ = exported["learned_gpt2"]
    with pytest.raises(SystemExit, match=r"max_length='65' is not valid: expected at most the 64 positions of pe=learned"):
        eval_rolling().main([f"ckpt={ckpt}", "max_length=65", "device=cpu"])
    with pytest.raises(SystemExit, match=r"max_length='0' is not valid: expected an integer >= 1"):
        eval_rolling().main([f"ckpt={ckpt}", "max_length=0"])
    with pytest.raises(SystemExit, match=r"data=.*missing.jsonl.* is not valid: expected a JSON lines file"):
        eval_rolling().main([f"ckpt={ckpt}", f"data={tmp_path / 'missing.jsonl'}"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"title": "no text"}\n')
    with pytest.raises(SystemExit, match=r"'text' string on every line \(line 2 has none\)"):
        eval_rolling().main([f"ckpt={ckpt}", f"data={bad}"])
