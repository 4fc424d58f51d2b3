"""The replay service's faults as inputs, on a real process of its own: a /dev/shm with no room for its snapshot (a
2 MiB tmpfs in a private mount namespace) and the service SIGSTOPped and continued while an actor inserts and a
learner samples. Each has its outcome: the service serves on and says so once; what the actor sent lands exactly
once; nothing waits for ever. A caller with no room in /dev/shm for its shared-memory lane, or a service that
cannot see the caller's /dev/shm (another host), sends its tensors on the socket instead."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest
import torch
from helpers import Launched, ProcessScope, fixture

from convoy.parallel.transport import Credentials, Identity
from convoy.workloads.rl.replay_client import ReplayClient

MOUNT = "mount -t tmpfs -o size=2m tmpfs /dev/shm"


def transitions(first: int, count: int) -> dict[str, torch.Tensor]:
    ids = torch.arange(first, first + count)
    return {"obs": ids.float().unsqueeze(1).repeat(1, 4), "action": ids % 2, "reward": ids.float(),
            "next_obs": ids.float().unsqueeze(1).repeat(1, 4), "discount": torch.full((count,), 0.9)}


def serve(procs: ProcessScope, secret: Credentials, capacity: int, every_s: float,
          small_shm: bool = False) -> tuple[Launched, str]:
    command = [sys.executable, fixture("replay_serve.py")]
    if small_shm:
        command = ["unshare", "-m", "sh", "-c", f'{MOUNT} && exec "$0" "$@"', *command]
    launched = procs.start([capacity, every_s], command=command,
                           env={"REPLAY_SECRET": secret.secret.hex(), "REPLAY_JOB": f"rlfault{uuid.uuid4().hex[:8]}"})
    address = launched.wait_output(r"serving (\S+)", timeout=60).group(1)
    return launched, address


def stats_at_end(launched: Launched) -> dict[str, object]:
    launched.proc.send_signal(signal.SIGTERM)
    result = launched.wait(timeout=30)
    assert result.returncode == 0, result.explain()
    line = next(line for line in result.stdout.splitlines() if line.startswith("stats "))
    return dict(json.loads(line[len("stats "):]))


def test_a_buffer_with_no_room_for_its_snapshot_serves_on_and_its_actors_hold_a_bounded_tail(
        procs: ProcessScope) -> None:
    probe = subprocess.run(["unshare", "-m", "sh", "-c", MOUNT], capture_output=True)
    if probe.returncode:
        pytest.skip(f"cannot mount a tmpfs on /dev/shm in a private mount namespace: {probe.stderr.decode().strip()}")
    secret = Credentials.fresh()
    launched, address = serve(procs, secret, capacity=100_000, every_s=0.1, small_shm=True)  # ~6 MiB a snapshot
    actor = ReplayClient(lambda: address, secret.as_process(Identity("actor", 0, 1)), find_s=10, lane_bytes=1 << 20)
    learner = ReplayClient(lambda: address, secret.as_process(Identity("learner", 0, 1)), find_s=10,
                           lane_bytes=1 << 20)
    for batch in range(300):
        actor.insert(transitions(batch * 1000, 1000), env_steps=1000)
        if batch == 5:
            launched.wait_output(r"replay: no room for its snapshot", timeout=30)
    drawn = learner.sample(64)
    assert drawn is not None and len(drawn.tensors["action"]) == 64, "it still serves samples"
    for client in (actor, learner):  # a /dev/shm of its own, as on another host: no shared-memory lane
        assert client.conn is not None and client.conn.lane is None and "cannot open" in client.conn.lane_why
    assert learner.ring is None and learner.ring_why == "the service keeps no shared ring"
    held = sum(len(batch["action"]) for _, batch, _ in actor.unkept)
    assert 100_000 <= held <= 101_000, f"the actor holds the ring's worth of what no snapshot has, not more: {held}"
    stats = stats_at_end(launched)
    assert stats["inserted"] == 300_000 and stats["duplicates"] == 0 and stats["snapshots"] == 0, stats
    assert int(stats["snapshot_failures"]) >= 1, stats  # type: ignore[call-overload]
    out = launched.stdout()
    assert out.count("replay: no room for its snapshot") == 1, "said once, not at every try: " + out
    assert "replay: no room in /dev/shm for the replay ring" in out and "over the transport" in out, out
    assert "serving on without one: the actors keep what they sent until a snapshot holds it" in out, out


def test_a_stopped_and_continued_buffer_takes_every_insert_exactly_once(procs: ProcessScope) -> None:
    """Stopped for 2 s, longer than the actor's request time-out (0.5 s): the actor gives up on the request and
    connects again until the buffer is continued, then sends the batch again; the buffer keeps it once whether or
    not it also read the request given up on. The learner's sample waits through the stop and is answered."""
    secret = Credentials.fresh()
    launched, address = serve(procs, secret, capacity=50_000, every_s=3600)
    actor = ReplayClient(lambda: address, secret.as_process(Identity("actor", 0, 1)), find_s=30, request_s=0.5)
    learner = ReplayClient(lambda: address, secret.as_process(Identity("learner", 0, 1)), find_s=30)
    actor.insert(transitions(0, 100), env_steps=100)
    sampled: list[int] = []
    sampler = threading.Thread(target=lambda: sampled.append(len(learner.sample(32).tensors["action"])))  # type: ignore[union-attr]
    launched.proc.send_signal(signal.SIGSTOP)
    began = time.monotonic()
    sampler.start()
    threading.Timer(2.0, launched.proc.send_signal, (signal.SIGCONT,)).start()
    for batch in range(1, 11):
        actor.insert(transitions(batch * 100, 100), env_steps=100)
    sampler.join(timeout=30)
    assert time.monotonic() - began >= 2.0 and sampled == [32]
    assert actor.reconnects >= 2, "the actor's request timed out in the stop and it connected again"
    stats = stats_at_end(launched)
    assert stats["inserted"] == 1100 and stats["by_source"] == {"actor0.1": 1100}, "each transition once: " + str(stats)


LANE_CALLER = """
import torch
from convoy.parallel.transport import Connection, Credentials, Identity, Listener, Message
job = Credentials.fresh()
service = Listener(lambda message, caller: Message("back", {}, message.tensors), credentials=job)
conn = Connection(service.address, credentials=job.as_process(Identity("actor", 0, 1)), lane_bytes=4 << 20)
reply = conn.request(Message("x", {}, {"x": torch.arange(1000.0)}))
assert torch.equal(reply.tensors["x"], torch.arange(1000.0))
print("lane", conn.lane is not None, "why", conn.lane_why, "laned", conn.laned)
service.close()
"""


def test_a_caller_with_no_room_in_dev_shm_for_its_lane_sends_on_the_socket() -> None:
    probe = subprocess.run(["unshare", "-m", "sh", "-c", MOUNT], capture_output=True)
    if probe.returncode:
        pytest.skip(f"cannot mount a tmpfs on /dev/shm in a private mount namespace: {probe.stderr.decode().strip()}")
    done = subprocess.run(["unshare", "-m", "sh", "-c", f'{MOUNT} && exec "$0" "$@"', sys.executable, "-c",
                           LANE_CALLER], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "lane False why no segment of 4194304 bytes in /dev/shm (No space left on device) laned 0" in done.stdout


def test_a_learner_gathering_from_the_shared_ring_never_keeps_a_row_torn_by_a_wrapping_insert(
        procs: ProcessScope) -> None:
    """The buffer in a process of its own, a ring of 2000 rows that an actor wraps every few batches, a learner in
    this process gathering its samples from the ring: every row it keeps is whole (each column encodes the insert
    number the service drew it with), and the rows it dropped as torn are counted."""
    secret = Credentials.fresh()
    launched, address = serve(procs, secret, capacity=2000, every_s=3600)
    actor = ReplayClient(lambda: address, secret.as_process(Identity("actor", 0, 1)), find_s=10)
    learner = ReplayClient(lambda: address, secret.as_process(Identity("learner", 0, 1)), find_s=10)
    actor.insert(transitions(0, 2000))
    stop = threading.Event()

    def insert() -> None:
        first = 2000
        while not stop.is_set():
            actor.insert(transitions(first, 500))
            first += 500

    inserting = threading.Thread(target=insert)
    inserting.start()
    kept = 0
    try:
        for _ in range(300):
            drawn = learner.sample(256)
            assert drawn is not None and drawn.meta["direct"]
            ids = drawn.tensors["_written"]
            assert torch.equal(drawn.tensors["reward"], ids.float()) and torch.equal(drawn.tensors["action"], ids % 2)
            assert torch.equal(drawn.tensors["obs"], ids.float().unsqueeze(1).repeat(1, 4))
            kept += len(ids)
    finally:
        stop.set()
        inserting.join()
    assert kept + learner.torn == 300 * 256
    stats_at_end(launched)
