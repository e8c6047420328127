"""The task's documents, read from the file beside this one (so lm-eval runs from any folder, offline)."""

import json
from pathlib import Path

import datasets

DATA = Path(__file__).with_name("gutenberg_val.jsonl")


def load(**_metadata) -> datasets.DatasetDict:
    """lm-eval passes the task's metadata (and --metadata) as keyword arguments: none is needed here."""
    with DATA.open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return datasets.DatasetDict({"validation": datasets.Dataset.from_list(rows)})
