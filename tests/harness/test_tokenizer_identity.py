"""A run never continues on another tokenizer: every checkpoint records its tokenizer's
fingerprint (the token cache's identity, data/tokenizers.py), and a resume, an ``init_from`` and
the scripts that read a checkpoint refuse in one line, before any data is read, when the
``data.tokenizer`` file changed since (even once the token cache was rebuilt for the new file).

One tiny run on a tiktoken ranks file this module writes; each test changes the file in place
(two merges swap ranks: the same vocabulary, other ids) and puts it back."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest
import torch

from data.tokenizers import get_tokenizer
from pelab.checkpoint import CheckpointError, load_lit_gpt
from pelab.checkpoint.tokenizer import RECORD
from pelab.validate import validate_config
from tests.cli import run_python
from tests.harness.test_train import TINY_RUN, compose_config

ROOT = Path(__file__).resolve().parents[2]
MERGES = [b"th", b"he", b" t", b"e "]


def write_ranks(path: Path, merges: list[bytes]) -> None:
    """A tiktoken ranks file: the 256 bytes, then ``merges`` in rank order."""
    ranks = {bytes([i]): i for i in range(256)} | {m: 256 + i for i, m in enumerate(merges)}
    path.write_text("".join(f"{base64.b64encode(k).decode()} {v}\n" for k, v in ranks.items()))


def data_args(run) -> list[str]:
    return ["data=text", f"data.paths=[{run['corpus']}]", f"data.tokenizer={run['tok']}",
            f"data.data_dir={run['cache']}", "data.val_fraction=0.3", "model.n_head=2", *TINY_RUN]


def cli(args: list[str]):
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}  # errors as the user sees them
    return run_python(args, cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}, timeout=300)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """RUN/checkpoints/{last.ckpt,config.yaml} of a 2-step run on the ranks file ``tok``."""
    tmp = tmp_path_factory.mktemp("tokenizer-identity")
    corpus = tmp / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"{i}.txt").write_text(f"the theme of the {i} then there the other\n" * 40)
    run = {"tok": tmp / "small.tiktoken", "corpus": corpus, "cache": tmp / "cache", "dir": tmp / "run"}
    write_ranks(run["tok"], MERGES)
    proc = cli(["train.py", *data_args(run), "logger=none", f"hydra.run.dir={run['dir']}"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    run["ckpt"] = run["dir"] / "checkpoints" / "last.ckpt"
    run["trained"] = get_tokenizer(str(run["tok"])).fingerprint()
    return run


@pytest.fixture
def changed(run):
    """The run's tokenizer file edited in place (same vocabulary, two ranks swapped); restored after.
    Returns the new fingerprint."""
    write_ranks(run["tok"], [MERGES[1], MERGES[0], *MERGES[2:]])
    yield get_tokenizer(str(run["tok"])).fingerprint()
    write_ranks(run["tok"], MERGES)


def error_line(proc) -> str:
    """The refusal: a non-zero exit, no traceback, the message on one line of stderr."""
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "was trained on data.tokenizer=" in line]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def assert_names_both(message: str, run, now: str) -> None:
    assert "data.tokenizer=" in message and str(run["tok"]) in message
    assert run["trained"][:12] in message and now[:12] in message
    assert "\n" not in message.strip()


def test_every_checkpoint_records_the_tokenizer_fingerprint(run):
    for ckpt in run["ckpt"].parent.glob("*.ckpt"):
        record = torch.load(ckpt, map_location="cpu", weights_only=True)[RECORD]
        assert record == {"key": "data.tokenizer", "name": str(run["tok"].resolve()), "fingerprint": run["trained"]}


def test_resume_auto_on_a_changed_tokenizer_refuses_in_one_line_before_any_data(run, changed):
    meta = next(run["cache"].glob("*/*/meta.json"))
    built = meta.read_text()
    proc = cli(["train.py", *data_args(run), "logger=none", "trainer.max_steps=4", "resume=auto",
                f"hydra.run.dir={run['dir']}"])
    line = error_line(proc)
    assert f"ckpt_path={run['ckpt']} was trained on data.tokenizer=" in line
    assert_names_both(line, run, changed)
    assert meta.read_text() == built  # the token cache was not rebuilt: nothing was read


def test_ckpt_path_resume_refused_after_the_cache_was_rebuilt(run, tmp_path):
    args = [*data_args(run), f"ckpt_path={run['ckpt']}"]
    validate_config(compose_config(args, output_dir=tmp_path / "same"))  # the same tokenizer: accepted
    old = tmp_path / "old.ckpt"  # as written before the record existed: accepted whatever the file holds
    torch.save({k: v for k, v in torch.load(run["ckpt"], weights_only=True).items() if k != RECORD}, old)
    write_ranks(run["tok"], [MERGES[1], MERGES[0], *MERGES[2:]])
    try:
        now = get_tokenizer(str(run["tok"])).fingerprint()
        validate_config(compose_config([*data_args(run), f"ckpt_path={old}"], output_dir=tmp_path / "old"))
        load_lit_gpt(old)
        cfg = compose_config(args, output_dir=tmp_path / "other")
        from pelab.datamodule import build_datamodule

        build_datamodule(cfg.data).prepare_data()  # another job rebuilt the cache for the new file
        with pytest.raises(ValueError) as err:  # validation's ConfigError, one line
            validate_config(cfg)
    finally:
        write_ranks(run["tok"], MERGES)
    assert_names_both(str(err.value), run, now)
    assert "start a new run" in str(err.value)


def test_init_from_another_tokenizer_is_refused(run, tmp_path):
    same = compose_config([*data_args(run), f"init_from={run['ckpt']}"], output_dir=tmp_path / "a")
    validate_config(same)  # the tokenizer it was trained with: accepted
    bytes_run = compose_config([*data_args(run), "data.tokenizer=bytes", f"init_from={run['ckpt']}"],
                               output_dir=tmp_path / "b")
    with pytest.raises(ValueError, match=r"init_from=.* was trained on data\.tokenizer=.*small\.tiktoken "
                                              r"\(fingerprint [0-9a-f]{12}\), but data\.tokenizer=bytes now has "
                                              r"fingerprint [0-9a-f]{12}.*use the data\.tokenizer it was trained with"):
        validate_config(bytes_run)


def test_init_from_a_changed_tokenizer_of_the_same_vocabulary_is_refused(run, tmp_path, changed):
    cfg = compose_config([*data_args(run), f"init_from={run['ckpt']}"], output_dir=tmp_path / "a")
    with pytest.raises(ValueError) as err:  # validation's ConfigError, one line
        validate_config(cfg)
    assert_names_both(str(err.value), run, changed)


def test_scripts_refuse_a_checkpoint_whose_tokenizer_changed(run, tmp_path, changed):
    with pytest.raises(CheckpointError) as err:
        load_lit_gpt(run["ckpt"])  # what evaluate.py, sample.py, eval_rolling.py and export_hf.py load with
    assert_names_both(str(err.value), run, changed)
    for script, *options in (("sample.py", "tokens=4", "device=cpu"), ("evaluate.py", "device=cpu"),
                             ("export_hf.py", f"out={tmp_path / 'hf'}")):
        line = error_line(cli([f"scripts/{script}", f"ckpt={run['ckpt']}", *options]))
        assert line.startswith(f"ckpt={run['ckpt']} was trained on data.tokenizer="), script
        assert_names_both(line, run, changed)
    assert not (tmp_path / "hf").exists()


def test_scripts_refuse_a_checkpoint_whose_tokenizer_file_is_gone(run, tmp_path):
    moved = tmp_path / "moved.tiktoken"
    run["tok"].rename(moved)
    try:
        with pytest.raises(CheckpointError, match=r"ckpt=.* was trained on data\.tokenizer=.*small\.tiktoken, "
                                                  r"which cannot be loaded now"):
            load_lit_gpt(run["ckpt"])
    finally:
        moved.rename(run["tok"])
    load_lit_gpt(run["ckpt"])  # the file back where it was: accepted
