"""Files and filesystems as one line (issue 51, item 4): a path option that cannot serve, or a
write the filesystem refuses, ends in one line naming the path, what is wrong and what to do,
before any data is read where that is possible, and leaves nothing half-written.

- ``data.tokenizer`` a file that is not a tokenizer (empty, garbled, another JSON, a folder):
  refused by validation, which reads the file (``tokenizer_file``).
- The token cache's folder (``data.data_dir``) a file, under a file, or read-only: refused by
  validation (``data.cache.check_cache_folder``); a read-only copy of a built cache still serves.
- A full disk while the token cache is built or a model exported: one line, the temporary and
  renamed files gone. Real as root on a 2 MiB tmpfs where ``mount`` is allowed; simulated
  (writes raising ENOSPC) everywhere.
- ``scripts/eval_rolling.py data=`` with a line that is not UTF-8 or not JSON: the file and line.
- ``.NAME.<pid>-<id>.old`` left by a replacement killed between its renames: the next
  replacement removes it once its process is gone.
- Every output folder of a script (gpu_check ``out=``, ``work=``; export_hf ``out=``) through one
  check (data/paths.py).
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from data.paths import PathError, output_file, output_folder, remove_dead_leftovers
from tests.harness.test_config_errors import compose_config, no_work, refused  # noqa: F401 - a fixture
from tests.disk import FullDisk
from tests.harness.test_script_errors import script

TO_GIVE = ("give data.tokenizer= one of gpt2, bytes or the path of a Hugging Face tokenizer.json or a tiktoken "
           "ranks file")
TMPFS_BYTES = 2 * 2**20


@contextlib.contextmanager
def tmpfs(path: Path, options: str = f"size={TMPFS_BYTES}"):
    """A real tmpfs at ``path`` (root, and a kernel that lets this container mount), else a skip."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"mount -t tmpfs not allowed here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def one_line(message: str) -> str:
    assert "\n" not in message and "Traceback" not in message, message
    return message


# --- data.tokenizer ------------------------------------------------------------------------------

NOT_TOKENIZERS = {  # file name, its bytes (None: a folder), what the refusal says is wrong
    "empty.json": (b"", "is empty (0 bytes)"),
    "blank.tiktoken": (b" \n\n", "is empty (3 bytes, all blank)"),
    "garbled.json": (b'{"model": {"type": "BPE", ', "is not a readable Hugging Face tokenizer.json: not valid JSON "
                                                    "(Expecting property name enclosed in double quotes: line 1"),
    "config.json": (b'{"vocab_size": 256, "n_layer": 2}', 'is not a readable Hugging Face tokenizer.json: JSON, but '
                                                         'no "model" object (keys vocab_size, n_layer)'),
    "list.json": (b"[1, 2, 3]", 'is not a readable Hugging Face tokenizer.json: JSON, but no "model" object (a JSON '
                                'list)'),
    # a SentencePiece model (protobuf), as Llama 2 ships it: its first byte is a newline
    "tokenizer.model": (b"\x0a\x8b\x01\x00\xff garbage", "is neither a Hugging Face tokenizer.json (suffix .json) "
                                                        "nor a tiktoken ranks file (lines 'BASE64 RANK'): line 2"),
    "folder": (None, "is a folder without a tokenizer.json"),
}


@pytest.mark.parametrize("name", NOT_TOKENIZERS)
def test_a_tokenizer_file_that_is_not_one_is_refused_by_validation_in_one_line(name, tmp_path):
    """``tokenizer_file``, what the data module calls at validation, reads the file: before, these
    passed validation (the file exists) and failed with a traceback when the data module first
    tokenized (or, for a folder, were called "no such file")."""
    from data.tokenizers import tokenizer_file

    content, wrong = NOT_TOKENIZERS[name]
    path = tmp_path / name
    path.mkdir() if content is None else path.write_bytes(content)
    with pytest.raises(ValueError) as err:
        tokenizer_file(str(path))
    message = one_line(str(err.value))
    assert message.startswith(f"data.tokenizer='{path}' {wrong}") and message.endswith(TO_GIVE), message


def test_train_validation_refuses_an_empty_tokenizer_file_before_any_data(tmp_path, no_work):
    empty = tmp_path / "tokenizer.json"
    empty.write_bytes(b"")
    message = refused([f"data.tokenizer={empty}"], tmp_path)
    assert message == f"data.tokenizer='{empty}' is empty (0 bytes); {TO_GIVE}"


def test_train_refuses_a_checkpoint_folder_under_a_file_before_any_data(tmp_path, monkeypatch):
    """callbacks.model_checkpoint.dirpath: before, the first checkpoint save failed, after the compute."""
    import pelab.datamodule
    from pelab.config import ConfigError
    from train import train

    monkeypatch.setattr(pelab.datamodule.TextDataModule, "setup", lambda *a: pytest.fail("data was read"))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cfg = compose_config(["logger=none", f"callbacks.model_checkpoint.dirpath={blocker / 'ckpts'}"], tmp_path / "out")
    with pytest.raises(ConfigError) as err:
        train(cfg)
    assert str(err.value) == (f"callbacks.model_checkpoint.dirpath={blocker / 'ckpts'}: {blocker} above it is a file, "
                              f"not a folder; give callbacks.model_checkpoint.dirpath= a new folder, or an existing "
                              f"folder this user can write")


# --- the token cache's folder --------------------------------------------------------------------

def test_a_cache_folder_that_is_a_file_or_under_one_is_refused_by_validation(tmp_path, no_work):
    blocker = tmp_path / "cache"
    blocker.write_text("not a folder")
    for data_dir in (blocker, blocker / "deeper"):
        message = one_line(refused([f"data.data_dir={data_dir}"], tmp_path))
        assert message.startswith(f"data.data_dir={data_dir}: the token cache's folder {data_dir}/")
        assert message.endswith(f"cannot be written: {blocker} is a file, not a folder; point data.data_dir (or "
                                f"$PELAB_CACHE) at a folder this user can write")
    assert blocker.read_text() == "not a folder"


def test_scripts_check_the_token_cache_folder_before_any_data(tmp_path, monkeypatch):
    """scripts/evaluate.py (and its translators) build the run's data module: its cache folder is
    checked as train.py checks it, and a full disk during the build is the same one line."""
    import pelab.datamodule
    from _common import evaluate_checkpoint

    monkeypatch.setattr(pelab.datamodule, "prepare_token_files", lambda *a, **k: pytest.fail("data was read"))
    blocker = tmp_path / "cache"
    blocker.write_text("")
    cfg = compose_config([f"data.data_dir={blocker}"], tmp_path / "out")
    with pytest.raises(SystemExit) as exit_:
        evaluate_checkpoint(tmp_path / "never-read.ckpt", cfg, {}, device=None)
    assert str(exit_.value.code).startswith(f"data.data_dir={blocker}: the token cache's folder {blocker}/")


def read_only(path: Path):
    """``path`` made read-only for this user: a read-only tmpfs as root, chmod otherwise."""
    if os.geteuid() == 0:
        return tmpfs(path, "ro,size=64k")
    path.mkdir()
    path.chmod(0o555)
    return contextlib.nullcontext(path)


def test_a_read_only_cache_folder_is_refused_by_validation(tmp_path, no_work):
    with read_only(tmp_path / "ro") as ro:
        message = one_line(refused([f"data.data_dir={ro}"], tmp_path))
        assert message.startswith(f"data.data_dir={ro}: the token cache's folder {ro}/")
        assert f"cannot be written: {ro} is a folder " in message
        assert "read-only filesystem" in message or "cannot write" in message


def test_a_read_only_folder_holding_a_built_cache_serves_it_and_refuses_a_build(tmp_path):
    from data.cache import check_cache_folder

    built = tmp_path / "built"
    built.mkdir()
    (built / "meta.json").write_text("{}")
    with pytest.MonkeyPatch.context() as patch:  # a simulated read-only folder (EROFS on every new file)
        import data.paths

        def refuse(*args, **kwargs):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))

        patch.setattr(data.paths.tempfile, "TemporaryFile", refuse)
        check_cache_folder(built, "data.data_dir", built)  # a built cache is read as it is
        with pytest.raises(PathError, match=r"is a folder on a read-only filesystem; point data\.data_dir"):
            check_cache_folder(built, "data.data_dir", built, built=False)  # a build (prepare_data.py) must write


# --- a full disk ---------------------------------------------------------------------------------

class Corpus:
    """Test-only: ``documents`` documents of ~1 KiB each, in memory (nothing loaded from disk)."""

    cache_name, rows_are_documents = "fill", True

    def __init__(self, documents: int) -> None:
        self.texts = [f"document {i} " + "lorem ipsum dolor sit amet " * 40 for i in range(documents)]

    def fingerprint(self) -> str:
        return f"fill-{len(self.texts)}"

    def load(self, workdir=None):
        import datasets

        half = len(self.texts) // 2
        return {"train": datasets.Dataset.from_dict({"text": self.texts[:half]}),
                "val": datasets.Dataset.from_dict({"text": self.texts[half:]})}


def assert_full_disk_refusal(err, out: Path, doing: str, elsewhere: str) -> None:
    message = one_line(str(err))
    assert message.startswith(f"{out}: no space left on device while {doing} (") and " MiB free there now; " in message
    assert message.endswith(f"nothing half-written is kept): free space or point {elsewhere} elsewhere")


def test_a_full_disk_during_a_token_cache_build_is_one_line_and_leaves_no_token_file(tmp_path):
    """Real: a 2 MiB tmpfs, 3 MiB of bytes-tokenizer tokens (uint16: 6 MiB). Before, numpy's
    OSError (or a SIGBUS in the offsets memmap) and the partial files left behind."""
    from data.cache import prepare_token_files
    from data.tokenizers import get_tokenizer

    with tmpfs(tmp_path / "small") as small:
        out = small / "cache"
        with pytest.raises(PathError) as err:
            prepare_token_files(Corpus(3000), get_tokenizer("bytes"), out)
        assert_full_disk_refusal(err.value, out, "building the token cache of fill", "data.data_dir (or $PELAB_CACHE)")
        assert sorted(p.name for p in out.iterdir()) == ["build.lock"]  # the lock file: empty, reused next time
        assert err.value.__suppress_context__


def test_a_full_disk_during_a_token_cache_build_simulated(tmp_path, monkeypatch):
    """The same refusal where no tmpfs can be mounted: the train split's token file is written and
    renamed, then val's writes raise ENOSPC after 64 KiB."""
    import builtins

    import data.cache
    from data.cache import prepare_token_files
    from data.tokenizers import get_tokenizer

    room = {"left": 1_400_000}

    def full_open(file, mode="r", *args, **kwargs):
        f = builtins.open(file, mode, *args, **kwargs)
        if str(file).endswith(".bin.partial"):
            f = FullDisk(f, room["left"])
            room["left"] = 2**16
        return f

    monkeypatch.setattr(data.cache, "open", full_open, raising=False)
    out = tmp_path / "cache"
    with pytest.raises(PathError) as err:
        prepare_token_files(Corpus(1000), get_tokenizer("bytes"), out)
    assert_full_disk_refusal(err.value, out, "building the token cache of fill", "data.data_dir (or $PELAB_CACHE)")
    assert sorted(p.name for p in out.iterdir()) == ["build.lock"]  # train.bin, renamed in place, is gone too


def test_a_path_error_at_the_top_of_a_hydra_job_prints_as_its_one_line():
    """train.py: the token cache is built inside trainer.fit, and data/ cannot raise Hydra's
    compact errors; the job's end turns its PathError into one (no traceback)."""
    from hydra.core.utils import JobReturn, JobStatus
    from hydra.errors import CompactHydraException

    from pelab.hydra_callbacks import PelabCallback

    ret = JobReturn(status=JobStatus.FAILED, _return_value=PathError("/x: no space left on device ..."))
    PelabCallback().on_job_end(config=None, job_return=ret)
    with pytest.raises(CompactHydraException, match=r"^/x: no space left on device \.\.\.$"):
        ret.return_value  # noqa: B018 - what Hydra reads, raising the job's error
    other = JobReturn(status=JobStatus.FAILED, _return_value=RuntimeError("a bug"))
    PelabCallback().on_job_end(config=None, job_return=other)
    with pytest.raises(RuntimeError):  # any other error keeps its traceback
        other.return_value  # noqa: B018


def export_checkpoint(folder: Path, n_embd: int = 16) -> Path:
    """A train.py-like checkpoint of a tiny learned-PE model (n_embd=256: its export, ~6 MiB of
    safetensors, does not fit the tmpfs), its run config beside it."""
    import lightning
    import torch
    import yaml

    from pelab.lit import LitGPT

    torch.manual_seed(0)
    lit = LitGPT(model=dict(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=n_embd),
                 pe={"_target_": "model.pe.learned.LearnedPositionEmbedding"})
    folder.mkdir(parents=True)
    torch.save({"state_dict": lit.state_dict(), "hyper_parameters": dict(lit.hparams),
                "pytorch-lightning_version": lightning.__version__}, folder / "last.ckpt")
    (folder / "config.yaml").write_text(yaml.safe_dump({"data": {"tokenizer": "bytes"}}))
    return folder / "last.ckpt"


def test_a_full_disk_during_an_export_is_one_line_and_leaves_no_temp_folder(tmp_path):
    """Real: safetensors raises its own SafetensorError ("No space left on device (os error 28)"),
    which was a traceback."""
    pytest.importorskip("transformers")
    ckpt = export_checkpoint(tmp_path / "run" / "checkpoints", n_embd=256)
    with tmpfs(tmp_path / "small") as small:
        out = small / "hf"
        with pytest.raises(SystemExit) as exit_:
            script("export_hf").main([f"ckpt={ckpt}", f"out={out}"])
        assert_full_disk_refusal(exit_.value.code, small, f"exporting to {out}", "out=")
        assert list(small.iterdir()) == []


def test_a_full_disk_during_an_export_simulated(tmp_path, monkeypatch):
    """The same refusal without a tmpfs; a previous export at ``out`` stays as it was."""
    pytest.importorskip("transformers")
    import pelab.export

    ckpt = export_checkpoint(tmp_path / "run" / "checkpoints")
    out = tmp_path / "hf"
    script("export_hf").main([f"ckpt={ckpt}", f"out={out}"])
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def full(hf_model, folder, *args):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(pelab.export, "save_model", full)
    with pytest.raises(SystemExit) as exit_:
        script("export_hf").main([f"ckpt={ckpt}", f"out={out}", "overwrite=true"])
    assert_full_disk_refusal(exit_.value.code, tmp_path, f"exporting to {out}", "out=")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]  # no .hf.<pid>-<id>.tmp


# --- eval_rolling data= --------------------------------------------------------------------------

BAD_LINES = {  # the file's bytes, what the refusal says of its line
    "not JSON": (b'{"text": "fine"}\n{"text": "cut\n', "(line 2 is not JSON: Unterminated string starting at: line 1 "
                                                     "column 10 (char 9))"),
    "not UTF-8": (b'{"text": "fine"}\n{"text": "ok"}\n{"text": "caf\xe9"}\n', "(line 3 is not UTF-8: byte 0xe9 at "
                                                                               "column 14)"),
    "no text": (b'{"text": "fine"}\n{"title": "no text"}\n', "(line 2 has none)"),
    "blank": (b'{"text": "fine"}\n\n{"text": "more"}\n', "(line 2 is blank)"),
}


@pytest.mark.parametrize("kind", BAD_LINES)
def test_eval_rolling_names_the_file_and_the_line_of_a_bad_jsonl_line(kind, tmp_path):
    """Read before the checkpoint: before, json and UTF-8 errors were tracebacks."""
    content, said = BAD_LINES[kind]
    data = tmp_path / "docs.jsonl"
    data.write_bytes(content)
    with pytest.raises(SystemExit) as exit_:
        script("eval_rolling").main([f"ckpt={tmp_path / 'never-read.ckpt'}", f"data={data}"])
    message = one_line(str(exit_.value.code))
    assert message == f"data='{data}' is not valid: expected a JSON object with a 'text' string on every line {said}"


@pytest.mark.parametrize("kind", ["jsonl", "txt"])
def test_a_training_corpus_file_with_a_bad_line_is_named_with_its_line(kind, tmp_path):
    """data=text data.paths=[...]: the ``datasets`` builder's own error ("An error occurred while
    generating the dataset") named neither the file nor the line, and was a traceback under
    train.py; now a PathError (one line there) naming both."""
    from data.corpus import TextFilesCorpus

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    if kind == "jsonl":
        (corpus / "a.jsonl").write_bytes(b'{"text": "one two"}\n{"text": "three"}\n')
        (corpus / "b.jsonl").write_bytes(b'{"text": "four"}\n\n{"text": "cut\n')
        said = (f"data.paths: {corpus / 'b.jsonl'} line 3 is not JSON: Unterminated string starting at: line 1 column "
                f"10 (char 9); fix that line, or leave the file out of data.paths")
    else:
        (corpus / "a.txt").write_bytes(b"one two\n")
        (corpus / "b.txt").write_bytes(b"three\nfour caf\xe9\n")
        said = (f"data.paths: {corpus / 'b.txt'} line 2 is not UTF-8: byte 0xe9 at column 9; save it as UTF-8, or "
                f"leave the file out of data.paths")
    with pytest.raises(PathError) as err:
        TextFilesCorpus([str(corpus)]).load(tmp_path / "work")
    assert str(err.value) == said


def test_an_unreadable_corpus_file_is_refused_when_the_corpus_is_built(tmp_path, monkeypatch):
    """At validation (the data module builds the corpus), not when the token cache is built; the
    permission is simulated (root reads everything)."""
    import data.corpus
    from data.corpus import TextFilesCorpus

    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text("text\n")
    monkeypatch.setattr(data.corpus.os, "access", lambda path, mode: Path(path).name != "b.txt")
    with pytest.raises(PathError, match=rf"^data\.paths: {tmp_path / 'b.txt'} cannot be read by this user \(permission "
                                        r"denied\); make it readable, or leave it out of data\.paths$"):
        TextFilesCorpus([str(tmp_path)])


# --- what killed writers leave -------------------------------------------------------------------

def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


def test_a_killed_replacement_leaves_an_old_folder_the_next_one_removes(tmp_path):
    """replace_dir (exports, sharded checkpoints) renames the previous folder aside as
    ``.NAME.<pid>-<id>.old``; one killed between its two renames leaves it. Before, nothing
    removed it (and its name did not say whose it was)."""
    from pelab.checkpoint.sharded import replace_dir

    out = tmp_path / "hf"
    dead = tmp_path / f".hf.{dead_pid()}-0123abcd.old"
    alive = tmp_path / f".hf.{os.getpid()}-4567cdef.old"  # a live process's: never touched
    other = tmp_path / f".hg.{dead_pid()}-89abcdef.old"  # another folder's
    for folder in (dead, alive, other):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"previous")
    new = tmp_path / "new"
    new.mkdir()
    (new / "config.json").write_text("{}")
    replace_dir(new, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive.name, other.name, "hf"])
    assert (out / "config.json").read_text() == "{}"
    assert remove_dead_leftovers(tmp_path / "hg") == [other]


# --- every output folder of a script through one check -------------------------------------------

def test_output_path_checks_say_the_kind_and_the_clash(tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    with pytest.raises(PathError, match=rf"^out={tmp_path} is a folder, not a file; give out= a file's path$"):
        output_file("out", tmp_path)
    with pytest.raises(PathError, match=rf"^out={a_file}/x.json: {a_file} above it is a file, not a folder; "):
        output_file("out", a_file / "x.json")
    run = tmp_path / "run" / "checkpoints" / "last.ckpt"
    with pytest.raises(PathError, match=rf"^out={tmp_path / 'run'} holds ckpt={run}, which the command reads; "):
        output_folder("out", tmp_path / "run", inputs={"ckpt": run})
    with pytest.raises(PathError, match=rf"^out={run}/x lies inside ckpt={run}, which the command reads; "):
        output_folder("out", run / "x", inputs={"ckpt": run})
    assert output_folder("out", tmp_path / "new" / "folder") == tmp_path / "new" / "folder"
    assert not (tmp_path / "new").exists()  # checking creates nothing


@pytest.mark.parametrize("key", ["work", "out"])
def test_gpu_check_refuses_a_work_or_out_folder_under_a_file_before_any_step(key, tmp_path, monkeypatch):
    import gpucheck.steps

    monkeypatch.setattr(gpucheck.steps, "all_steps", lambda *a, **k: pytest.fail("steps built for a bad folder"))
    blocker = tmp_path / "blocker"
    blocker.write_text("mine")
    with pytest.raises(SystemExit) as exit_:
        script("gpu_check").main([f"{key}={blocker / 'x'}", f"{'out' if key == 'work' else 'work'}={tmp_path / 'ok'}"])
    purpose = "for the report" if key == "out" else "for the steps' files"
    assert str(exit_.value.code) == (f"{key}={blocker / 'x'}: {blocker} above it is a file, not a folder; give {key}= "
                                     f"a new folder, or an existing folder this user can write, {purpose}")


def test_export_refuses_an_out_under_a_file_before_the_checkpoint_is_read(tmp_path, monkeypatch):
    """Before: NotADirectoryError from mkdir, after the checkpoint was loaded."""
    import pelab.export

    monkeypatch.setattr(pelab.export, "load_lit_gpt", lambda *a, **k: pytest.fail("the checkpoint was read"))
    blocker = tmp_path / "blocker"
    blocker.write_text("mine")
    with pytest.raises(SystemExit) as exit_:
        script("export_hf").main([f"ckpt={tmp_path / 'run' / 'last.ckpt'}", f"out={blocker / 'hf'}"])
    assert str(exit_.value.code) == (f"out={blocker / 'hf'}: {blocker} above it is a file, not a folder; give out= a "
                                     f"new folder, or an existing folder this user can write")


def test_every_scripts_output_path_is_checked_before_anything_is_read(tmp_path, monkeypatch):
    """evaluate.py (and its translators) out= under a file, consolidate.py out= inside the sharded
    checkpoint it reads, bench_attention.py out= a folder: each refused by the same check before
    a checkpoint is read or anything timed. Before: a traceback after the work (or, for
    consolidate, a file written into the checkpoint's own folder)."""
    import benchkit.attention

    monkeypatch.setattr(benchkit.attention, "time_attention", lambda *a, **k: pytest.fail("timed for a bad out="))
    blocker = tmp_path / "blocker"
    blocker.write_text("mine")
    with pytest.raises(SystemExit) as exit_:
        script("evaluate").main([f"ckpt={tmp_path / 'never-read.ckpt'}", f"out={blocker / 'eval'}"])
    assert str(exit_.value.code) == (f"out={blocker / 'eval'}: {blocker} above it is a file, not a folder; give out= "
                                     f"a new folder, or an existing folder this user can write")
    sharded = tmp_path / "run" / "checkpoints" / "last.ckpt"
    sharded.mkdir(parents=True)
    with pytest.raises(SystemExit) as exit_:
        script("consolidate").main([f"ckpt={sharded}", f"out={sharded / 'full.ckpt'}"])
    assert str(exit_.value.code) == (f"out={sharded / 'full.ckpt'} lies inside ckpt={sharded}, which the command "
                                     f"reads; give out= a path apart from it")
    with pytest.raises(SystemExit) as exit_:
        script("bench_attention").main(["smoke=true", f"out={tmp_path}"])
    assert str(exit_.value.code) == f"out={tmp_path} is a folder, not a file; give out= a file's path"
    assert blocker.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["blocker", "run"]
