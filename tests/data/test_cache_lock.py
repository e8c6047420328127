"""data/lock.py: the token cache's build lock on clusters. An owner killed with SIGKILL is taken
over at once; a lease left by a dead node (another host, a heartbeat that never moves) is
taken over after the stale limit; a live owner blocks a waiter until data.lock_timeout, which
gives up with one line; the same without flock (the lease alone); a bad timeout is refused at
validation in one line."""

import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

import data.lock
from data.lock import LockTimeout, build_lock


def hold(out_dir, ready, seconds):
    """A process that takes the lock and holds it (a live builder)."""
    with build_lock(Path(out_dir), timeout=5):
        ready.set()
        time.sleep(seconds)


def owner_process(out_dir: Path, seconds: float = 60):
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    proc = ctx.Process(target=hold, args=(str(out_dir), ready, seconds))
    proc.start()
    assert ready.wait(10)
    return proc


def lease(out_dir: Path) -> dict:
    return json.loads((out_dir / "build.owner").read_text())


def test_an_owner_killed_with_sigkill_is_taken_over_at_once(tmp_path, capsys):
    proc = owner_process(tmp_path)
    assert lease(tmp_path)["pid"] == proc.pid  # the lease names its owner
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    start = time.monotonic()
    with build_lock(tmp_path, timeout=5, stale_after=60, poll=0.05):  # its heartbeat would not age out in time
        assert lease(tmp_path)["pid"] == os.getpid()
    assert time.monotonic() - start < 2
    out = capsys.readouterr().out
    assert f"took over the build lock of pid {proc.pid} on " in out and "its process is gone" in out, out
    assert not (tmp_path / "build.owner").exists()  # released: only the empty flock file stays
    assert sorted(p.name for p in tmp_path.iterdir()) == ["build.lock"]


def test_a_dead_hosts_lease_is_taken_over_when_its_heartbeat_does_not_move(tmp_path, capsys):
    (tmp_path / "build.owner").write_text(json.dumps({"pid": 4242, "host": "node-that-died", "since": 0,
                                                      "token": "x"}))
    os.utime(tmp_path / "build.owner", (time.time() - 3600, time.time() - 3600))
    start = time.monotonic()
    with build_lock(tmp_path, timeout=10, stale_after=0.5, poll=0.05):
        waited = time.monotonic() - start
        assert lease(tmp_path)["host"] != "node-that-died"
    assert 0.5 <= waited < 3  # watched for the stale limit (by this process's clock), then taken
    out = capsys.readouterr().out
    assert "is being built by pid 4242 on node-that-died since " in out and "heartbeat 3600 s ago" in out, out
    assert "took over the build lock of pid 4242 on node-that-died" in out and "its heartbeat stopped" in out


def racer(out_dir, start, spans):
    data.lock.try_flock = lambda path: -1  # no flock: the lease alone decides
    start.wait()
    with build_lock(Path(out_dir), timeout=20, stale_after=0.3, poll=0.02):
        began = time.monotonic()
        time.sleep(0.15)
        spans.put((began, time.monotonic()))


def test_waiters_racing_to_take_over_a_dead_lease_hold_it_one_at_a_time(tmp_path):
    """Four processes find one dead node's lease: one takes it over (the rename decides), the
    others then wait their turn: no two hold the lock at once."""
    (tmp_path / "build.owner").write_text(json.dumps({"pid": 4242, "host": "dead-node", "since": 0, "token": "z"}))
    ctx = multiprocessing.get_context("fork")
    start, spans = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=racer, args=(str(tmp_path), start, spans)) for _ in range(4)]
    for proc in procs:
        proc.start()
    held = sorted(spans.get(timeout=30) for _ in procs)
    for proc in procs:
        proc.join(10)
        assert proc.exitcode == 0
    assert all(later[0] >= earlier[1] for earlier, later in zip(held, held[1:])), held
    assert not (tmp_path / "build.owner").exists()


def test_a_moving_heartbeat_is_not_taken_over(tmp_path):
    """A live owner on another host, its heartbeat moving faster than the stale limit, keeps its
    lock however old its start: the waiter times out instead."""
    import threading

    path = tmp_path / "build.owner"
    path.write_text(json.dumps({"pid": 1, "host": "busy-node", "since": 0, "token": "y"}))
    done = threading.Event()

    def beat():
        while not done.wait(0.1):
            os.utime(path)

    threading.Thread(target=beat, daemon=True).start()
    try:
        with pytest.raises(LockTimeout):
            with build_lock(tmp_path, timeout=0.8, stale_after=0.3, poll=0.05):
                pass
    finally:
        done.set()
    assert json.loads(path.read_text())["host"] == "busy-node"


@pytest.mark.parametrize("flock", ["flock", "no flock"])
def test_a_live_owner_blocks_a_waiter_until_the_timeout_then_one_line(tmp_path, monkeypatch, capsys, flock):
    if flock == "no flock":  # a filesystem without flock (Lustre mounted without it): the lease alone decides
        monkeypatch.setattr(data.lock, "try_flock", lambda path: -1)
    proc = owner_process(tmp_path, seconds=30)
    try:
        start = time.monotonic()
        with pytest.raises(LockTimeout) as err:
            # a live owner on this host is never stale, however still its heartbeat (10 s > 0.3 s)
            with build_lock(tmp_path, timeout=1.0, stale_after=0.3, poll=0.1):
                pytest.fail("the lock was taken from a live owner")
        assert 1.0 <= time.monotonic() - start < 3
        message = str(err.value)
        assert "\n" not in message
        assert message.startswith(f"{tmp_path}: gave up waiting for the token cache after data.lock_timeout=1 s: it "
                                  f"is being built by pid {proc.pid} on ")
        assert message.endswith("or raise data.lock_timeout (a lock whose heartbeat stops for 0.3 s is taken over)")
        assert lease(tmp_path)["pid"] == proc.pid  # the owner's lease is untouched
    finally:
        proc.kill()
        proc.join(10)


def test_the_holders_heartbeat_moves(tmp_path, monkeypatch):
    monkeypatch.setattr(data.lock, "HEARTBEAT", 0.05)
    with build_lock(tmp_path, timeout=1):
        first = (tmp_path / "build.owner").stat().st_mtime_ns
        time.sleep(0.3)
        assert (tmp_path / "build.owner").stat().st_mtime_ns > first


@pytest.mark.parametrize("bad", [0, -5])
def test_a_bad_lock_timeout_is_refused_in_one_line(bad):
    from hydra import compose, initialize_config_dir

    from pelab.config import ConfigError, plain
    from pelab.lit import model_config
    from pelab.validate import build_data

    root = Path(__file__).resolve().parents[2]
    import pelab.run  # noqa: F401 - the resolvers conf/ uses

    with initialize_config_dir(str(root / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"data.lock_timeout={bad}"])
    with pytest.raises(ConfigError) as err:
        build_data(cfg, model_config({"vocab_size": 1, **plain(cfg.model)}))
    message = str(err.value)
    assert "\n" not in message and "data.lock_timeout" in message and "positive number of seconds" in message, message
