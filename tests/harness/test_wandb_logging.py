"""W&B, offline: checkpoints as model artifacts (aliases latest and best), evaluation scalars with
length as their x-axis, a bad ``logger.wandb.log_model`` refused in one line. Everything is read
back from the offline run's own ``.wandb`` file, the records ``wandb sync`` would upload."""

import base64
import hashlib
import json
import struct
import time
from pathlib import Path

import lightning as L
import pytest
import wandb
from hydra import compose, initialize_config_dir
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from google.protobuf.message import DecodeError
from wandb.proto import wandb_internal_pb2

from evaluation.extrapolation import ExtrapolationRow, loggable
from evaluation.tasks import TaskRow
from evaluation.tasks import loggable as task_loggable
from pelab.config import ConfigError
from pelab.loggers import SafeWandbLogger, by_length, log_to_wandb

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B offline, every file it writes (runs, staged artifacts, settings) under tmp_path."""
    for var, sub in [("WANDB_DIR", ""), ("WANDB_DATA_DIR", "data"), ("WANDB_CACHE_DIR", "cache"),
                     ("WANDB_CONFIG_DIR", "config")]:
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    if wandb.run is not None:  # a run another test left open would be reused, and read from the wrong file
        wandb.finish()
    return tmp_path


def records(root: Path, wait: float = 20.0) -> list:
    """The records of the one offline run under ``root``, once W&B's service has written its last
    (``exit``): the ``.wandb`` file is written by another process, after ``finish`` returns."""
    deadline = time.monotonic() + wait
    while True:
        try:
            out = read_records(next(root.rglob("*.wandb")))
        except DecodeError:  # read while the service was writing the record: read again
            if time.monotonic() > deadline:
                raise
            out = []
        if any(r.WhichOneof("record_type") == "exit" for r in out) or time.monotonic() > deadline:
            return out
        time.sleep(0.1)


def read_records(path: Path) -> list:
    """A ``.wandb`` file is a LevelDB-style log (7-byte file header; 32 KiB blocks of chunks, each
    with a 7-byte header: crc, length, type 1 full / 2 first / 3 middle / 4 last) of protobuf
    ``Record``s."""
    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", path
    out, pos, chunks = [], 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + length > len(data):  # the chunk the writer is still writing
            break
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            out.append(record)
            chunks = b""
    return out


def of_type(recs: list, kind: str) -> list:
    return [getattr(r, kind) for r in recs if r.WhichOneof("record_type") == kind]


def md5_b64(path: str) -> str:
    return base64.b64encode(hashlib.md5(Path(path).read_bytes()).digest()).decode()


class ValLoss(BoringModel):
    """val/loss 1 at step 2, then 2: the best checkpoint is step 2's, the last one step 4's."""

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", 1.0 + (self.global_step > 2))


def test_checkpoints_become_artifacts_latest_and_best(offline):
    logger = SafeWandbLogger(project="pelab-test", save_dir=str(offline), log_model=True)
    checkpoints = ModelCheckpoint(dirpath=offline / "checkpoints", filename="step{step:06d}", monitor="val/loss",
                                  mode="min", save_top_k=1, save_last=True, auto_insert_metric_name=False)
    trainer = L.Trainer(max_steps=4, val_check_interval=2, limit_val_batches=1, logger=logger, callbacks=[checkpoints],
                        accelerator="cpu", enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(ValLoss())
    assert "W&B offline run" in logger.finish()

    best, last = checkpoints.best_model_path, checkpoints.last_model_path
    assert (Path(best).name, Path(last).name) == ("step000002.ckpt", "last.ckpt")
    artifacts = of_type(records(offline), "artifact")
    assert [a.type for a in artifacts] == ["model", "model"]
    assert {a.name for a in artifacts} == {f"model-{logger.experiment.id}"}
    by_file = {a.manifest.contents[0].digest: a for a in artifacts}
    assert set(by_file) == {md5_b64(best), md5_b64(last)}  # the two files, as written
    assert sorted(by_file[md5_b64(best)].aliases) == ["best", "latest"]
    assert list(by_file[md5_b64(last)].aliases) == ["latest"]  # logged after best: latest moves to it
    assert artifacts[-1].manifest.contents[0].digest == md5_b64(last)
    assert all([e.path for e in a.manifest.contents] == ["model.ckpt"] for a in artifacts)


def test_log_model_with_offline_is_an_offline_run_not_an_error(offline, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "")  # as train.py sees it with no credentials: it asks for offline itself
    logger = SafeWandbLogger(project="pelab-test", save_dir=str(offline), offline=True, log_model="all")
    assert logger.experiment.offline and logger.failure is None
    assert "W&B offline run" in logger.finish()


def test_a_sharded_checkpoint_directory_is_said_once(tmp_path, capsys):
    (tmp_path / "last.ckpt").mkdir()
    logger = SafeWandbLogger(project="pelab-test", save_dir=str(tmp_path), log_model=True)
    callback = ModelCheckpoint(dirpath=tmp_path, save_top_k=1)
    callback.last_model_path = str(tmp_path / "last.ckpt")
    logger.after_save_checkpoint(callback)
    logger.after_save_checkpoint(callback)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "last.ckpt is a sharded checkpoint (a directory) and is not logged" in lines[0]


def row(length: int, ppl: float, mode: str = "nonoverlapping") -> ExtrapolationRow:
    return ExtrapolationRow(scheme="rope", rope_scaling="none", train_length=64, eval_length=length, mode=mode,
                            stride=length, tokens=1000, loss=0.0, ppl=ppl, seconds=0.1)


def test_extrapolation_is_plotted_against_length(offline):
    rows = [row(64, 10.5), row(128, 12.25), row(256, 20.0), row(128, 11.0, "sliding"),
            ExtrapolationRow("rope", "none", 64, 512, "nonoverlapping", 512, 0, float("nan"), float("nan"), 0.0,
                             status="skipped: too long")]
    run = wandb.init(project="pelab-test", dir=str(offline), mode="offline")
    log_to_wandb(loggable(rows), run)
    run.finish()
    recs = records(offline)

    metrics = {m.name: m for m in of_type(recs, "metric") if m.name}
    ppl = "extrapolation/nonoverlapping/none/ppl"
    assert metrics[ppl].step_metric == "extrapolation/length"
    assert metrics["extrapolation/sliding/none/ppl"].step_metric == "extrapolation/length"
    assert "extrapolation/length" in metrics and not metrics["extrapolation/length"].step_metric

    history = [{item.key or "/".join(item.nested_key): item.value_json for item in h.item}
               for h in of_type(recs, "history")]
    media = {key.rsplit("/", 1)[0] for key in history[0] if key.endswith("/_type")}
    assert media == {"extrapolation/table", "extrapolation/ppl_vs_length_table"}  # the table and chart as before
    by_length = [h for h in history if "extrapolation/length" in h]
    got = [(json.loads(h["extrapolation/length"]), json.loads(h.get(ppl, "null")),
            json.loads(h.get("extrapolation/sliding/none/ppl", "null"))) for h in by_length]
    assert got == [(64, 10.5, None), (128, 12.25, 11.0), (256, 20.0, None)]  # one row a length, ok rows only


def test_task_accuracy_rows_by_length():
    rows = [TaskRow("passkey", "rope", 64, n, depth, 10, acc, tok, 0.1, learned="yes")
            for n, depth, acc, tok in [(64, 0.0, 1.0, 1.0), (64, 1.0, 0.5, 0.75), (128, 0.0, 0.25, 0.5),
                                       (128, 1.0, 0.75, 0.75)]]
    rows.append(TaskRow("passkey", "rope", 64, 256, 0.0, 0, float("nan"), float("nan"), 0.0, status="skipped: x"))
    assert by_length(task_loggable(rows).summary) == {"tasks": {
        64: {"tasks/passkey/depth0/accuracy": 1.0, "tasks/passkey/depth1/accuracy": 0.5,
             "tasks/passkey/accuracy": 0.75, "tasks/passkey/token_accuracy": 0.875},
        128: {"tasks/passkey/depth0/accuracy": 0.25, "tasks/passkey/depth1/accuracy": 0.75,
              "tasks/passkey/accuracy": 0.5, "tasks/passkey/token_accuracy": 0.625}}}  # learned_at_... is no length


def test_bad_log_model_is_one_line(tmp_path):
    from pelab.validate import validate_config

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["logger=wandb", "logger.wandb.log_model=best",
                                           f"paths.output_dir={tmp_path / 'out'}"])
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert str(err.value) == "logger.wandb.log_model must be one of 'all' or true or false, got 'best'"
    assert not (tmp_path / "out").exists()


def test_sharded_checkpoints_with_log_model_are_refused(tmp_path):
    from pelab.validate import validate_config

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["logger=wandb", "logger.wandb.log_model=true", "trainer=fsdp",
                                           "trainer.strategy.state_dict_type=sharded",
                                           f"paths.output_dir={tmp_path / 'out'}"])
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert "logger.wandb.log_model=True logs checkpoint files" in str(err.value)
    assert "trainer.strategy.state_dict_type=full" in str(err.value) and "\n" not in str(err.value)
