"""Multi-node imitation on one machine: 2 "nodes" of 1 CPU process each (gloo DDP, NODE_RANK,
MASTER_ADDR/PORT as a cluster launcher sets them) train from one fresh shared token cache: it is
prepared once, and training equals a one-node 2-process run of the same config."""

import os
import random
import socket
from concurrent.futures import ThreadPoolExecutor

import torch

from tests.data.test_text_data import docs, write_txt
from tests.harness.test_train import TINY_RUN, read_metrics, run_train


def free_port() -> int:
    """A port free now and below the kernel's ephemeral range (32768 up on Linux), in a slice of
    its own for each pytest-xdist worker: the nodes bind it ~10 s later (after their imports).
    A port the kernel handed out (bind to 0) could meanwhile be given to another process's
    outgoing connection (the gloo mesh of a DDP test on the other worker, the one-node run's
    own pick) and the nodes' store then fails with "address already in use"."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    start = 20000 + 1000 * (worker % 12)
    for port in random.sample(range(start, start + 1000), 1000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {start}..{start + 999}")


def test_two_nodes_prepare_once_and_train_as_one_node_with_two_processes(tmp_path):
    """The one-node run (2 processes, Lightning starts the second) and the two nodes (1 process
    each, started by hand as a cluster's launcher would, on one data_dir and run dir) run side
    by side, each on a fresh cache; float32 on gloo: the same weights, losses and data position.
    Both also show that global rank zero alone tokenizes (prepare_data_per_node is off)."""
    write_txt(tmp_path / "corpus", docs(40))
    args = ["data=text", f"data.paths=[{tmp_path / 'corpus'}]", "trainer.accelerator=cpu", "trainer.strategy=ddp",
            "trainer.precision=32", "model.n_head=2", "logger=csv", "~callbacks.position_functions",
            "eval.probe.enabled=false", "trainer.log_every_n_steps=1", *TINY_RUN]
    one, nodes = tmp_path / "one", tmp_path / "nodes"

    def train(extra: list[str], env: dict | None = None):
        return run_train([*args, *extra], tmp_path, env={"OMP_NUM_THREADS": "1", **(env or {})}, timeout=300)

    master = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}  # the one-node run picks its own
    node = ["trainer.devices=1", "trainer.num_nodes=2", f"data.data_dir={tmp_path / 'cache'}", f"hydra.run.dir={nodes}"]
    with ThreadPoolExecutor(3) as pool:
        started = {"one": pool.submit(train, ["trainer.devices=2", f"data.data_dir={tmp_path / 'cache_one'}",
                                              f"hydra.run.dir={one}"])}
        started.update({f"node{rank}": pool.submit(train, node, {**master, "NODE_RANK": str(rank)}) for rank in (0, 1)})
        done = {name: future.result() for name, future in started.items()}
    for name, proc in done.items():
        assert proc.returncode == 0, (name, proc.stderr[-4000:])
    output = {name: proc.stdout + proc.stderr for name, proc in done.items()}
    nodes_output = output["node0"] + output["node1"]
    assert "MEMBER: 1/2" in output["node0"] and "MEMBER: 2/2" in output["node1"], nodes_output[-3000:]
    # one preparation on each fresh cache: by global rank 0 (the other node or process waits at the barrier)
    assert output["node0"].count("[pelab] tokenizing") == 1 and "[pelab] tokenizing" not in output["node1"]
    assert output["one"].count("[pelab] tokenizing") == 1
    assert len(list((tmp_path / "cache").glob("*/bytes/meta.json"))) == 1
    assert "finished at step 2" in done["node0"].stdout and "finished at step" not in done["node1"].stdout

    trained = {name: torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
               for name, run in (("one", one), ("nodes", nodes))}
    assert trained["nodes"]["global_step"] == trained["one"]["global_step"] == 2
    assert trained["nodes"]["TextFilesDataModule"] == trained["one"]["TextFilesDataModule"] == {"samples_consumed": 8}
    for name, value in trained["one"]["state_dict"].items():
        assert torch.equal(trained["nodes"]["state_dict"][name], value), name
    losses = [read_metrics(run / "csv" / "metrics.csv") for run in (one, nodes)]
    assert len(losses[0]["train/loss"]) == 2 and len(losses[0]["val/loss"]) == 1
    assert losses[0]["train/loss"] == losses[1]["train/loss"] and losses[0]["val/loss"] == losses[1]["val/loss"]
