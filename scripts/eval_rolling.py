"""Rolling perplexity of a checkpoint on whole documents, as lm-evaluation-harness computes it
for an exported copy of the model (docs/export.md, "lm-evaluation-harness").

    python scripts/eval_rolling.py ckpt=RUN_DIR/checkpoints/last.ckpt
    python scripts/eval_rolling.py ckpt=... max_length=512 data=my_docs.jsonl

Reads the documents of lm_eval_tasks/pelab_gutenberg (or ``data=``: JSON lines with a
``text`` field), tokenizes each with the run's tokenizer, scores it after the end-of-text token
in lm-eval's rolling windows (evaluation/rolling.py) and prints nats per token and lm-eval's
``word_perplexity``, ``byte_perplexity`` and ``bits_per_byte``: the numbers
``lm_eval --model hf --model_args pretrained=EXPORTED --include_path lm_eval_tasks
--tasks pelab_gutenberg`` reports, in float32.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from _cli import command_line
from _common import (ROOT, bad_value, checked_checkpoint, device_arg, integer, load_run_config, required)

DATA = ROOT / "lm_eval_tasks" / "pelab_gutenberg" / "gutenberg_val.jsonl"


def read_documents(path: Path) -> list[str]:
    """The ``text`` of every line of the JSON lines file ``path``, checked before the model is
    loaded: a line that is not UTF-8, not JSON or has no ``text`` string is one line naming the
    file, the line and what is wrong (``data.corpus.jsonl_rows``, as for a training corpus)."""
    from data.corpus import jsonl_rows

    if not path.is_file():
        bad_value("data", str(path), "a JSON lines file with a 'text' field per line")
    every_line = "a JSON object with a 'text' string on every line"
    try:
        data = path.read_bytes()
    except OSError as e:
        bad_value("data", str(path), f"a JSON lines file this user can read ({e.strerror})")
    texts = []
    try:
        for n, row in jsonl_rows(data):
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                bad_value("data", str(path), f"{every_line} (line {n} {'is blank' if row is None else 'has none'})")
            texts.append(row["text"])
    except ValueError as e:  # not UTF-8, not JSON: the line and what is wrong
        bad_value("data", str(path), f"{every_line} ({e})")
    if not texts:
        bad_value("data", str(path), "at least one document")
    return texts


def main(argv: list[str]) -> dict:
    cfg = command_line("eval_rolling", argv, __doc__)
    if cfg is None:
        return {}
    max_length = None if cfg.max_length is None else integer("max_length", cfg.max_length, minimum=1)
    device = device_arg(cfg.device)
    texts = read_documents(Path(str(cfg.data)) if cfg.data is not None else DATA)
    ckpt = checked_checkpoint(required(cfg, "ckpt", "PATH"))
    run = load_run_config(ckpt, "which tokenizer the documents are read with")

    from data.tokenizers import get_tokenizer
    from evaluation.rolling import perplexity_metrics, rolling_loglikelihood
    from pelab.checkpoint import load_lit_gpt

    tokenizer = get_tokenizer(str(run.data.tokenizer))
    if tokenizer.eot_token is None:
        bad_value("data.tokenizer", str(run.data.tokenizer), "a tokenizer with an end-of-text token (lm-eval's prefix)")
    gpt = load_lit_gpt(ckpt, map_location=device).model.to(device).eval()
    limit = gpt.pe.max_positions
    max_length = max_length or limit or gpt.config.block_size
    if limit is not None and max_length > limit:
        bad_value("max_length", str(max_length), f"at most the {limit} positions of pe={gpt.pe.name}")

    documents = [tokenizer.encode(text) for text in texts]
    lls = [rolling_loglikelihood(gpt, ids, tokenizer.eot_token, max_length) for ids in documents]
    metrics = perplexity_metrics(lls, texts, sum(map(len, documents)))
    print(f"{len(texts)} documents, {sum(map(len, documents))} tokens, max_length {max_length}")
    for name, value in metrics.items():
        print(f"{name:16s} {value:.6f}")
    return {"loglikelihoods": lls, "tokens": [len(ids) for ids in documents], "max_length": max_length, **metrics}


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
