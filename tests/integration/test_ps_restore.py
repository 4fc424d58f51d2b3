"""A parameter server SIGKILLed mid-training in the example's job of roles (2 PS, 2 async workers): the master
restarts it with CONVOY_ROLE_RESTORE=1, it comes back from its in-memory snapshot, the workers resend what it
had not kept, and the job finishes with every push applied exactly once (counted per worker and server); once on
its old port, once with that port taken, where it comes back on another one and the workers follow it there."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from pathlib import Path

import psutil
import pytest
from helpers import REPO, Launched, ProcessScope, agent_of, wait_for

from convoy.control.store import read_status
from convoy.control.token import TOKEN_FILE, read_token
from convoy.parallel.transport import Connection, ConnectionLost, Credentials, Identity, Message
from convoy.worker.role_env import service_secret

pytestmark = pytest.mark.slow
EXAMPLE = str(REPO / "examples" / "train_ps.py")
STEPS = 40
ARGS = ["--steps", STEPS, "--batch", 32, "--rows", 1000, "--dim", 8, "--held-out", 512, "--snapshot-every", 5]
HELD = re.compile(r"\[worker(\d)\]: worker \d: pushes held per server \[(\d+), (\d+)\], resent \[(\d+), (\d+)\], "
                  r"lost \[(\d+), (\d+)\], servers moved (.*)")


def serving_ports(run_dir: Path, rank: int) -> list[int]:
    log = run_dir / "logs" / "roles" / f"ps{rank}.log"
    text = log.read_text() if log.exists() else ""
    return [int(port) for port in re.findall(rf"parameter server {rank} serving on port (\d+)", text)]


def owner(run_dir: Path) -> Credentials:
    """The job's owner may ask its role services: it reads the job's token and derives their secret, as agents do."""
    return Credentials(bytes.fromhex(service_secret(read_token(run_dir / TOKEN_FILE))), Identity("test", 0, 0))


def status_when_training(run_dir: Path, port: int, pushes: int) -> dict | None:
    """The server's status once it has applied ``pushes`` pushes and holds a push its newest snapshot lacks (so
    that a kill now loses one that must be resent), with ``kept_by_all``: the pushes its newest snapshot holds;
    None before, or while it cannot be reached."""
    try:
        connection = Connection(f"127.0.0.1:{port}", timeout=5, credentials=owner(run_dir))
    except ConnectionLost:
        return None
    try:
        metas = [connection.request(Message("status", {"worker": f"worker{rank}"})).meta for rank in (0, 1)]
    except ConnectionLost:
        return None
    finally:
        connection.close()
    unkept = any(meta["applied"] > meta["kept"] for meta in metas)
    kept = sum(int(meta["kept"]) for meta in metas)
    return {**metas[0], "kept_by_all": kept} if metas[0]["version"] >= pushes and unkept else None


def workers_of(run_dir: Path) -> list[psutil.Process]:
    """The job's worker processes, by the pids the master's events name (``worker N is running (NODE, pid P)``;
    a forked process's /proc environment is its fork server's, so it cannot tell)."""
    events = [e["message"] for e in read_status(run_dir, recent=500)["events"] if e["kind"] == "role_started"]
    return [psutil.Process(int(pid)) for message in events
            for pid in re.findall(r"^worker \d+ is running.*pid (\d+)", message)]


def frozen_status(run_dir: Path, port: int, workers: list[psutil.Process]) -> dict | None:
    """With the workers stopped (SIGSTOP), the server's status once a push or snapshot sent before the stop has
    landed (two reads alike), if it still holds a push its snapshot lacks: nothing changes it until the kill."""
    for worker in workers:
        worker.suspend()
    before = None
    for _ in range(100):
        status = status_when_training(run_dir, port, STEPS)
        if status is None or status == before:
            return status
        before = status
        time.sleep(0.05)
    raise AssertionError(f"the server's status kept changing with its workers stopped: {before}")


def kill_mid_training(procs: ProcessScope, run_dir: Path, rank: int,
                      take_port: bool = False) -> tuple[Launched, int, dict, socket.socket | None]:
    """SIGKILL PS ``rank`` once it has applied half of all pushes and holds one its snapshot lacks (the workers
    stopped meanwhile, so that the status read is the server's state at the kill); ``take_port``: with its agent
    stopped too, so that the test listens on the old port before the agent can start the PS again."""
    job = procs.start(["run", "--ps", 2, "--workers", 2, "--preload", "", "--stop-grace", 1, "--run-dir", run_dir,
                       EXAMPLE, *ARGS])
    port = wait_for(lambda: serving_ports(run_dir, rank), 60, f"ps{rank} to serve")[0]
    wait_for(lambda: status_when_training(run_dir, port, STEPS), 60, f"ps{rank} to apply {STEPS} pushes",
             interval=0.02)
    workers = workers_of(run_dir)
    assert len(workers) == 2, workers
    try:
        status = wait_for(lambda: frozen_status(run_dir, port, workers) or thaw(workers), 60,
                          f"ps{rank} to hold an unkept push with its workers stopped")
        agent = agent_of(status["pid"])
        if take_port:
            agent.suspend()
        try:
            os.kill(status["pid"], signal.SIGKILL)
            taker = wait_for(lambda: _listen(port), 5, f"port {port} to be free to take") if take_port else None
        finally:
            agent.resume()
    finally:
        thaw(workers)
    return job, port, status, taker


def thaw(workers: list[psutil.Process]) -> None:
    """SIGCONT the workers (returns None, so that a poll goes on)."""
    for worker in workers:
        worker.resume()


def assert_every_push_applied_once(out: str, killed: int) -> list[re.Match[str]]:
    held = sorted(HELD.finditer(out), key=lambda m: m.group(1))
    assert len(held) == 2, out
    # the workers share the epoch's shards as they ask, so one may train more of it than the other
    per_server = [sum(int(found.group(2 + server)) for found in held) for server in (0, 1)]
    assert per_server == [2 * STEPS, 2 * STEPS], f"every batch of the epoch pushed once to each server: {held}"
    for found in held:
        assert [int(found.group(6)), int(found.group(7))] == [0, 0], found.group(0)
    resent = [sum(int(found.group(4 + server)) for found in held) for server in (0, 1)]
    assert resent[killed] >= 1 and resent[1 - killed] == 0, f"only the killed server's unkept pushes resent: {held}"
    assert re.search(rf"\[worker0\]: held-out AUC [\d.]+ \(teacher [\d.]+\) after {2 * STEPS} pushes per server", out)
    assert f"[worker0]: exactly once: each of the {2 * STEPS} batches applied once on each of 2 servers" in out, out
    return held


def test_a_killed_ps_comes_back_with_its_shard_and_no_push_is_lost(procs: ProcessScope, run_dir: Path) -> None:
    job, port, status, _ = kill_mid_training(procs, run_dir, 0)
    result = job.wait(120)
    assert result.returncode == 0, result.explain()
    out = result.stdout
    assert "convoy: ps 0 failed (was killed by SIGKILL); restarting only it with its state" in out, out
    restored = re.search(r"\[ps0\]: parameter server 0 restored from its in-memory snapshot at version (\d+) "
                         r"\(pushes held \{'worker0': (\d+), 'worker1': (\d+)\}\)", out)
    assert restored, out
    version, kept = int(restored.group(1)), int(restored.group(2)) + int(restored.group(3))
    assert 0 < version == kept == status["kept_by_all"] < status["version"], "its newest snapshot, before the kill"
    assert serving_ports(run_dir, 0) == [port, port], "restarted on its node and port"
    held = assert_every_push_applied_once(out, killed=0)
    assert all(found.group(8) == "[]" for found in held), "nobody moved"
    assert (run_dir / "checkpoints" / "ps0" / "shard.pt").is_file(), "the chief's persistent save at the end"
    assert result.stdout.index("job succeeded")
    procs.wait_no_leftovers()


def test_a_ps_whose_port_is_taken_comes_back_on_another_and_the_workers_follow(procs: ProcessScope,
                                                                                run_dir: Path) -> None:
    job, port, _, taker = kill_mid_training(procs, run_dir, 1, take_port=True)
    assert taker is not None
    try:
        result = job.wait(120)
    finally:
        taker.close()
    assert result.returncode == 0, result.explain()
    out = result.stdout
    first, again = serving_ports(run_dir, 1)
    assert first == port and again != port, "the second incarnation got another port"
    assert "[ps1]: parameter server 1 restored from its in-memory snapshot" in out, out
    held = assert_every_push_applied_once(out, killed=1)
    moved = f"[(1, '127.0.0.1:{port}', '127.0.0.1:{again}')]"
    assert all(found.group(8) == moved for found in held), held
    files = list((run_dir / "roles").glob("addresses-*.json"))
    assert len(files) == 1, files
    current = json.loads(files[0].read_text())
    assert current["addresses"]["ps"][1] == f"127.0.0.1:{again}" and current["version"] >= 2, current
    procs.wait_no_leftovers()


def test_a_ps_whose_node_is_lost_comes_back_on_the_other_node(procs: ProcessScope, run_dir: Path) -> None:
    """Two nodes: the agent of the node that runs ps 0 is SIGKILLed mid-training, and its processes die with it.
    The master places them on the other node; ps 0 takes its shard back there (from its in-memory snapshot: both
    nodes share this machine's /dev/shm), a worker lost with the node starts again on its rank, and every batch
    still lands exactly once on each server (what the dead worker had pushed only after ps 0's snapshot, the
    chief trains again at the end: ``repair``)."""
    job = procs.start(["run", "--nnodes", "1:2", "--rdzv-wait", 1, "--ps", 2, "--workers", 2, "--preload", "",
                       "--stop-grace", 1, "--run-dir", run_dir, EXAMPLE, *ARGS])
    port = wait_for(lambda: serving_ports(run_dir, 0), 60, "ps0 to serve")[0]
    status = wait_for(lambda: status_when_training(run_dir, port, STEPS), 60, f"ps0 to apply {STEPS} pushes",
                      interval=0.02)
    agent = agent_of(status["pid"])
    lost = agent.cmdline()[agent.cmdline().index("--node-id") + 1]
    agent.kill()
    result = job.wait(180)
    assert result.returncode == 0, result.explain()
    out = result.stdout
    assert f"convoy: node {lost} left (agent killed by SIGKILL)" in out, out
    events = [e["message"] for e in read_status(run_dir, recent=500)["events"] if e["kind"] == "role_placed"]
    again = [m for m in events if m.startswith("ps 0 ") and "(restored)" in m]
    assert len(again) == 1 and f"on node {lost}" not in again[0], events
    assert "[ps0]: parameter server 0 restored from its in-memory snapshot" in out, out
    assert f"[worker0]: exactly once: each of the {2 * STEPS} batches applied once on each of 2 servers" in out, out
    assert "job succeeded" in out, out
    procs.wait_no_leftovers()


def _listen(port: int) -> socket.socket | None:
    """A listener on ``port`` once the killed server's socket is gone."""
    try:
        return socket.create_server(("127.0.0.1", port))
    except OSError:
        return None
