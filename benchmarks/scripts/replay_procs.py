"""The replay buffer's service as a job runs it, for the buffer section of benchmarks/rl.py: one process each for the
service, an actor and a learner (three processes on the machine's cores, as in a job).

    replay_procs.py serve OBS DTYPE CAPACITY RING      prints ``serving HOST:PORT``; ends at SIGTERM
    replay_procs.py act ADDRESS OBS DTYPE ROUNDS LANE   fills the buffer, prints ``ready``, waits for a line on stdin,
                                                       inserts ROUNDS chunks of 32, prints ``inserted N SECONDS``
    replay_procs.py learn ADDRESS BATCH SAMPLES LANE    waits for a line on stdin, samples SAMPLES batches
                                                       (priorities updated with each), prints ``sampled N SECONDS``

OBS is a shape like ``4`` or ``4x84x84``; DTYPE ``float32`` or ``uint8``; RING 1 keeps the buffer's ring in
/dev/shm, where the learner gathers its samples itself (the service sends the slots); LANE 1 sends the tensors
through the connection's shared-memory lane, 0 on the socket. The secret is ``REPLAY_SECRET`` (hex).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from convoy.parallel.transport import Credentials, Identity  # noqa: E402
from convoy.shm import SHM_DIR  # noqa: E402
from convoy.workloads.rl.buffer import Layout, ReplayBuffer  # noqa: E402
from convoy.workloads.rl.replay_client import ReplayClient  # noqa: E402
from convoy.workloads.rl.replay_service import ReplayService  # noqa: E402
from convoy.workloads.rl.ring import SharedRing  # noqa: E402

CHUNK = 32


def shape_of(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split("x"))


def chunk(obs: tuple[int, ...], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    if dtype == torch.uint8:
        seen = torch.randint(0, 256, (CHUNK + 1, *obs), dtype=torch.uint8)
    else:
        seen = torch.randn(CHUNK + 1, *obs)
    return {"obs": seen[:-1].contiguous(), "action": torch.randint(2, (CHUNK,)), "reward": torch.ones(CHUNK),
            "next_obs": seen[1:].contiguous(), "discount": torch.full((CHUNK,), 0.99)}


def secret(role: str) -> Credentials:
    return Credentials(bytes.fromhex(os.environ["REPLAY_SECRET"]), Identity(role, 0, 1))


def client(address: str, role: str, lane: str) -> ReplayClient:
    return ReplayClient(lambda: address, secret(role), lane_bytes=(1 << 20) * int(lane))


def serve(obs: str, dtype: str, capacity: str, ring: str) -> None:
    layout = Layout.for_dqn(shape_of(obs), getattr(torch, dtype))
    buffer = ReplayBuffer(layout, int(capacity), alpha=0.6)
    shared = SharedRing.create(SHM_DIR / f"convoy-bench{os.getpid()}-replay0-ring", layout, int(capacity)) \
        if ring == "1" else None
    service = ReplayService(buffer, credentials=secret("replay"), ring=shared)
    ended = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: ended.set())
    print(f"serving {service.address}", flush=True)
    ended.wait()
    service.close()


def act(address: str, obs: str, dtype: str, rounds: str, lane: str) -> None:
    actor = client(address, "actor", lane)
    chunks = [chunk(shape_of(obs), getattr(torch, dtype)) for _ in range(8)]
    size = int(actor.stats()["capacity"])
    for i in range(size // CHUNK + 1):
        actor.insert(chunks[i % 8])
    print("ready", flush=True)
    sys.stdin.readline()
    began = time.perf_counter()
    for i in range(int(rounds)):
        actor.insert(chunks[i % 8])
    took = time.perf_counter() - began
    assert actor.conn is not None and (actor.conn.lane is not None) == (lane == "1"), actor.conn.lane_why
    print(f"inserted {int(rounds) * CHUNK} {took:.6f}", flush=True)


def learn(address: str, batch: str, samples: str, lane: str) -> None:
    learner = client(address, "learner", lane)
    learner.stats()
    print("ready", flush=True)
    sys.stdin.readline()
    count, began = int(batch), time.perf_counter()
    for _ in range(int(samples)):
        reply = learner.sample(count)
        assert reply is not None
        slots = reply.tensors["_slots"]  # fewer than asked when rows were dropped as torn
        learner.priorities(slots, reply.tensors["_written"], torch.rand(len(slots)))
    took = time.perf_counter() - began
    print(f"sampled {count * int(samples) - learner.torn} {took:.6f}", flush=True)


if __name__ == "__main__":
    {"serve": serve, "act": act, "learn": learn}[sys.argv[1]](*sys.argv[2:])
