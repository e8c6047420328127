"""``train.py trainer=fsdp`` and ``trainer=hsdp`` end to end on gloo CPU processes
(tests/harness/fsdp_train.py lifts Lightning's GPU-only refusal), with pelab's own data path
(``data=text`` on a small token cache: ``StreamDataModule``'s global sample stream and its
``samples_consumed``) and sharded checkpoints:

- a checkpoint of 2 ranks resumes on 3 (torch.distributed.checkpoint reshards the weights and
  the optimizer state, every parameter split at other offsets), exactly the state saved;
- hybrid sharding, 2 "nodes" of 2 processes (NODE_RANK, MASTER_ADDR/PORT as a cluster's launcher
  sets them): each node shards, the nodes replicate; it trains as FSDP does (float32 tolerance)
  and its checkpoint resumes exactly;
- a SIGKILL in the middle of an asynchronous save (``trainer.strategy.async_save=true``), while
  training went on: the half-written directory never gets a checkpoint's name and
  ``resume=auto`` continues from the previous one and ends bit for bit where the uninterrupted
  run ends: weights, AdamW's moments and step counts, global step, samples consumed.

The runs are started side by side in three lanes (the machine's two cores are mostly waiting on
imports and gloo), once for the module.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.data.test_text_data import docs, write_txt
from tests.harness.test_multinode import free_port

ROOT = Path(__file__).resolve().parents[2]
STEPS, EVERY = 6, 2
TINY = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=32", "optim.warmup_steps=2",
        f"trainer.max_steps={STEPS}", "trainer.precision=32-true", "trainer.accelerator=cpu", "data.num_workers=0",
        f"trainer.val_check_interval={STEPS}", "trainer.limit_val_batches=1.0", "eval.extrapolation.enabled=false",
        "~callbacks.attention_maps", "~callbacks.position_functions", "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false", "logger=csv", "trainer.log_every_n_steps=1", "resume=auto",
        "trainer.strategy.state_dict_type=sharded", f"+callbacks.model_checkpoint.every_n_train_steps={EVERY}",
        "callbacks.model_checkpoint.save_top_k=-1", "callbacks.model_checkpoint.monitor=null",
        "callbacks.model_checkpoint.save_last=false"]
GLOBAL_BATCH = 4  # windows a step: 2 ranks x 2, 4 ranks x 1, 3 ranks x 2 (a resume on 3 ranks: 6)


def step_dir(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step{step:06d}.ckpt"


def train(run: Path, args: list[str], data: list[str], nodes: int = 1, timeout: float = 400) -> dict:
    """``fsdp_train.py`` (``train.py``) in ``run``; with ``nodes`` > 1 one command a node, as a
    cluster starts them. Each node is a session of its own, killed whole at the end (a rank left
    behind by a SIGKILLed one would otherwise wait on gloo for 30 minutes)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT),
           "HYDRA_FULL_ERROR": "1"}
    if nodes > 1:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    command = [sys.executable, "tests/harness/fsdp_train.py", *data, *TINY, f"hydra.run.dir={run}", *args]
    run.mkdir(parents=True, exist_ok=True)
    procs = []
    for node in range(nodes):
        log = open(run / f"node{node}.log", "ab")
        procs.append(subprocess.Popen(command + ([f"trainer.num_nodes={nodes}"] if nodes > 1 else []), cwd=ROOT,
                                      env={**env, "NODE_RANK": str(node)}, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    deadline, codes = time.monotonic() + timeout, []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append("timeout")
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of the job is left
        except ProcessLookupError:
            pass
    logs = "".join((run / f"node{n}.log").read_text(errors="replace") for n in range(nodes))
    return {"codes": codes, "log": logs}


def keep_only(source: Path, run: Path, step: int) -> None:
    """A copy of ``source``'s run dir holding only its checkpoint of ``step`` (and config.yaml)."""
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(source / "checkpoints" / "config.yaml", run / "checkpoints")
    shutil.copytree(step_dir(source, step), step_dir(run, step))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("fsdp_train")
    write_txt(tmp / "corpus", docs(40))
    data = ["data=text", f"data.paths=[{tmp / 'corpus'}]", f"data.data_dir={tmp / 'cache'}"]
    fsdp = ["trainer=fsdp", "trainer.devices=2", "data.batch_size=2"]
    out: dict = {"dir": tmp}

    def lane_whole():  # the uninterrupted run, then a resume of its step-2 checkpoint on 3 ranks
        out["whole"] = train(tmp / "whole", fsdp, data)
        keep_only(tmp / "whole", tmp / "three", 2)
        out["three"] = train(tmp / "three", ["trainer=fsdp", "trainer.devices=3", "data.batch_size=2",
                                             "+callbacks.dump._target_=tests.harness.fsdp_train.DumpState",
                                             f"+callbacks.dump.path={tmp / 'three' / 'state.pt'}"], data)

    def lane_async():  # killed in its step-4 save, then resumed
        killer = ["+callbacks.kill._target_=tests.harness.fsdp_train.KillDuringAsyncSave", "+callbacks.kill.step=4",
                  f"+callbacks.kill.marker={tmp / 'killed' / 'marker'}"]
        best_only = ["callbacks.model_checkpoint.save_top_k=1", "callbacks.model_checkpoint.monitor=train/loss"]
        out["killed"] = train(tmp / "killed", [*fsdp, "trainer.strategy.async_save=true", *killer, *best_only], data)
        out["after_kill"] = sorted(p.name for p in (tmp / "killed" / "checkpoints").iterdir())
        out["partial_metadata"] = [p.name for p in (tmp / "killed" / "checkpoints").glob(".*.partial/*")]
        out["continued"] = train(tmp / "killed", [*fsdp, "trainer.strategy.async_save=true",
                                                  "callbacks.model_checkpoint.save_last=true"], data)

    def lane_hybrid():  # 2 nodes x 2 processes, then a resume of its step-4 checkpoint
        hsdp = ["trainer=hsdp", "trainer.devices=2", "data.batch_size=1"]
        record = ["+callbacks.sharding._target_=tests.harness.fsdp_train.RecordSharding",
                  f"+callbacks.sharding.prefix={tmp / 'hybrid' / 'sharding'}"]
        out["hybrid"] = train(tmp / "hybrid", [*hsdp, *record], data, nodes=2)
        keep_only(tmp / "hybrid", tmp / "hybrid_resumed", 4)
        out["hybrid_resumed"] = train(tmp / "hybrid_resumed", [*hsdp, "trainer.strategy.async_save=true"], data,
                                      nodes=2)

    start = time.perf_counter()
    with ThreadPoolExecutor(3) as pool:
        for lane in [pool.submit(f) for f in (lane_whole, lane_async, lane_hybrid)]:
            lane.result()
    out["wall_s"] = time.perf_counter() - start
    return out


def finished(result: dict) -> None:
    assert result["codes"] and all(code == 0 for code in result["codes"]), (result["codes"], result["log"][-5000:])


def saved(path: Path) -> dict:
    """A sharded checkpoint gathered on this one process: weights, AdamW state by parameter name,
    and meta.pt (global step, the data module's samples_consumed)."""
    from pelab.checkpoint import sharded_state

    state = sharded_state(path, keys=("model", "optimizer_0"))
    meta = torch.load(path / "meta.pt", weights_only=True)
    return {"model": state["model"], "optim": state["optimizer_0"]["state"], "step": meta["global_step"],
            "data": meta["TextFilesDataModule"]}


def assert_same_state(ours: dict, theirs: dict, exact: bool = True) -> None:
    assert sorted(ours["model"]) == sorted(theirs["model"]) and len(ours["model"]) > 10
    assert sorted(ours["optim"]) == sorted(theirs["optim"]) and len(ours["optim"]) > 10
    compare = torch.equal if exact else (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6))
    for name, value in theirs["model"].items():
        assert compare(ours["model"][name], value), name
    for name, moments in theirs["optim"].items():
        assert sorted(moments) == ["exp_avg", "exp_avg_sq", "step"], name
        for key, value in moments.items():
            assert compare(ours["optim"][name][key], value), (name, key)


def test_a_sharded_checkpoint_of_two_ranks_resumes_on_three(runs):
    """Step 2 of the 2-rank run, resumed on 3 ranks: the weights and AdamW state gathered from the
    new ranks right after the load equal the saved ones, bit for bit (every parameter split at
    other offsets than it was saved with); the data stream goes on from the samples consumed."""
    finished(runs["three"])
    state = torch.load(runs["dir"] / "three" / "state.pt", weights_only=True)
    reference = saved(step_dir(runs["dir"] / "whole", 2))
    assert state["global_step"] == 2 and state["data"] == {"samples_consumed": 2 * GLOBAL_BATCH}
    assert_same_state(state, reference)
    assert f"continuing from {step_dir(runs['dir'] / 'three', 2)}" in runs["three"]["log"]


def test_hybrid_sharding_shards_in_a_node_replicates_across_and_trains_as_fsdp(runs):
    """2 nodes x 2 processes: every rank holds half the weights (its node's shard group of 2; the
    replicate group spans the 2 nodes; FULL_SHARD over 4 would hold a quarter). The 4-rank run trains on the same global batches as the
    2-rank FSDP run: the same weights, AdamW state and validation loss within float32 rounding."""
    finished(runs["hybrid"])
    hybrid, whole = runs["dir"] / "hybrid", runs["dir"] / "whole"
    records = [json.loads((hybrid / f"sharding.{rank}.json").read_text()) for rank in range(4)]
    assert {(r["world"], r["shard_group"], r["replicate_group"]) for r in records} == {(4, 2, 2)}
    total = sum(moments["exp_avg"].numel() for moments in saved(step_dir(whole, 2))["optim"].values())  # tied once
    assert all(abs(r["local_numel"] - total / 2) <= total * 0.01 for r in records)
    ours, theirs = saved(step_dir(hybrid, STEPS)), saved(step_dir(whole, STEPS))
    assert ours["step"] == STEPS and ours["data"] == theirs["data"]
    assert_same_state(ours, theirs, exact=False)
    from tests.harness.test_train import read_metrics

    losses = [read_metrics(run / "csv" / "metrics.csv")["val/loss"] for run in (hybrid, whole)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_a_hybrid_sharded_checkpoint_resumes_exactly(runs):
    """Step 4 of the hybrid run resumed on 2 x 2 (saving asynchronously: DTensor shards) ends at
    step 6 with its state bit for bit (with Lightning's optimizer load the first step after it
    trained right, the second did not: the AdamW moments came back wrong)."""
    finished(runs["hybrid_resumed"])
    resumed = runs["dir"] / "hybrid_resumed"
    assert f"continuing from {step_dir(resumed, 4)}" in runs["hybrid_resumed"]["log"]
    assert_same_state(saved(step_dir(resumed, STEPS)), saved(step_dir(runs["dir"] / "hybrid", STEPS)))


def test_a_kill_during_an_async_save_resumes_from_the_previous_checkpoint(runs):
    """Every rank SIGKILLed in the middle of writing step 4's shards, after training had gone on
    to step 5 (the save ran beside it). The run kept the best checkpoint only (by train/loss, lower
    at 4 than at 2), so step 4's save superseded step 2: its removal waited for the save, which
    never finished, and step 2 is still there, the only name; the half-written directory stays
    hidden without its .metadata. resume=auto continues from step 2 and, saving asynchronously
    again (each step's directory, then last.ckpt over the previous one), ends exactly as the
    uninterrupted (synchronously saved) run: weights, AdamW's moments and step counts, global step,
    samples consumed."""
    finished(runs["whole"])
    killed = runs["killed"]
    assert killed["codes"] == [-signal.SIGKILL], killed["log"][-5000:]
    assert (runs["dir"] / "killed" / "marker").read_text() == "ASYNC"  # step 5 trained while step 4 was saved
    names = runs["after_kill"]
    assert [n for n in names if not n.startswith(".")] == ["config.yaml", "step000002.ckpt"], names
    assert len([n for n in names if n.startswith(".step000004.ckpt.") and n.endswith(".partial")]) == 1
    assert ".metadata" not in runs["partial_metadata"] and "__0_0.distcp" in runs["partial_metadata"]
    finished(runs["continued"])
    run = runs["dir"] / "killed"
    assert f"resume=auto: continuing from {step_dir(run, 2)}" in runs["continued"]["log"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "config.yaml", "last.ckpt", "step000002.ckpt", "step000004.ckpt", "step000006.ckpt"]  # no partial left
    whole = runs["dir"] / "whole"
    for ours, theirs in ((step_dir(run, 4), step_dir(whole, 4)), (step_dir(run, STEPS), step_dir(whole, STEPS)),
                         (run / "checkpoints" / "last.ckpt", step_dir(whole, STEPS))):
        ours, theirs = saved(ours), saved(theirs)
        assert ours["step"] == theirs["step"] and ours["data"] == theirs["data"]
        assert ours["data"] == {"samples_consumed": ours["step"] * GLOBAL_BATCH}
        assert_same_state(ours, theirs)
    first, last = saved(step_dir(whole, 2)), saved(step_dir(whole, STEPS))
    assert not torch.equal(first["model"]["model.wte.weight"], last["model"]["model.wte.weight"])  # it did train


# ---------------------------------------------------------------------------- refusals, before any work


def compose(overrides: list[str]):
    from tests.harness.test_train import compose_config

    return compose_config(overrides)


@pytest.mark.parametrize("overrides, message", [
    (["trainer.num_nodes=2", "trainer.devices=2", "trainer.strategy.device_mesh=[3,2]"],
     "trainer.strategy.device_mesh=[3, 2]: 3 replicas x 2 shards is not the world of 4 processes "
     "(trainer.num_nodes=2 x trainer.devices=2), and 3 does not divide it; allowed: [R, 4/R] with R one of 1, 2, 4, "
     "by default [2, 2] (one replica a node)"),
    (["trainer.num_nodes=8", "trainer.devices=8", "trainer.strategy.device_mesh=[4,8]"],
     "trainer.strategy.device_mesh=[4, 8]: 4 replicas x 8 shards is not the world of 64 processes "
     "(trainer.num_nodes=8 x trainer.devices=8); allowed: [R, 64/R] with R one of 1, 2, 4, 8, 16, 32, 64, "
     "by default [8, 8] (one replica a node)"),
    (["trainer.num_nodes=2", "trainer.devices=auto"],
     "trainer.devices='auto': trainer=hsdp needs the number of devices a node as an integer >= 1"),
])
def test_a_hybrid_mesh_that_does_not_cover_the_world_is_one_line_before_any_data(overrides, message):
    from pelab.config import ConfigError
    from pelab.validate import validate_config

    cfg = compose(["trainer=hsdp", *overrides])
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_the_hsdp_preset_is_hybrid_over_nodes_by_devices():
    import hydra
    from torch.distributed.fsdp import ShardingStrategy

    cfg = compose(["trainer=hsdp", "trainer.num_nodes=8", "trainer.devices=8"])
    strategy = hydra.utils.instantiate(cfg.trainer.strategy)
    assert strategy.sharding_strategy == ShardingStrategy.HYBRID_SHARD
    assert strategy.kwargs["device_mesh"] == (8, 8) and strategy.async_saves is None


@pytest.mark.parametrize("kwargs, message", [
    ({"async_save": "yes"}, "trainer.strategy.async_save must be true or false, got 'yes'"),
    ({"async_save": True, "state_dict_type": "full"}, "trainer.strategy.async_save=true saves sharded checkpoints"),
])
def test_async_save_options_are_refused_in_one_line(kwargs, message):
    from pelab.checkpoint import FSDPStrategy

    with pytest.raises(ValueError, match=message):
        FSDPStrategy(**kwargs)
