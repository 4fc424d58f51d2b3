"""The buffer section of ``benchmarks/rl.py`` (issue 51): convoy's replay buffer as a job runs it (service, actor
and learner a process each, ``scripts/replay_procs.py``), over its shared ring, lanes or the socket, and in one
process, against RLlib's ``PrioritizedEpisodeReplayBuffer`` (``rl_rllib.time_rllib``), for CartPole transitions and
Atari-size frames. Run through ``python benchmarks/rl.py --only buffer``."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from convoy.parallel.transport import Credentials  # noqa: E402
from convoy.workloads.rl.buffer import Layout, ReplayBuffer  # noqa: E402
from rl_rllib import BATCH, CAPACITY, CHUNK, SAMPLES_PER_CHUNK, time_rllib  # noqa: E402


@dataclass(frozen=True)
class Shape:
    """One buffer case: what a transition's observation is, and the sizes that go with it."""

    name: str
    obs: tuple[int, ...]
    dtype: torch.dtype
    capacity: int
    batch: int


CARTPOLE = Shape("CartPole (4 floats)", (4,), torch.float32, CAPACITY, BATCH)
FRAMES = Shape("frames (4x84x84 uint8, Atari's)", (4, 84, 84), torch.uint8, 10_000, 32)


def chunk(shape: Shape) -> dict[str, torch.Tensor]:
    if shape.dtype == torch.uint8:
        obs = torch.randint(0, 256, (CHUNK + 1, *shape.obs), dtype=torch.uint8)
    else:
        obs = torch.randn(CHUNK + 1, *shape.obs)
    return {"obs": obs[:-1].contiguous(), "action": torch.randint(2, (CHUNK,)), "reward": torch.ones(CHUNK),
            "next_obs": obs[1:].contiguous(), "discount": torch.full((CHUNK,), 0.99)}


def new_buffer(shape: Shape) -> ReplayBuffer:
    return ReplayBuffer(Layout.for_dqn(shape.obs, shape.dtype), shape.capacity, alpha=0.6)


def time_convoy_in_process(rounds: int, shape: Shape) -> float:
    buffer, chunks = new_buffer(shape), [chunk(shape) for _ in range(8)]
    for i in range(shape.capacity // CHUNK + 1):
        buffer.insert(chunks[i % 8])
    began, done = time.perf_counter(), 0
    for i in range(rounds):
        buffer.insert(chunks[i % 8])
        done += CHUNK
        for _ in range(SAMPLES_PER_CHUNK):
            drawn = buffer.sample(shape.batch)
            buffer.update_priorities(drawn.slots, drawn.written, torch.rand(shape.batch))
            done += shape.batch
    return done / (time.perf_counter() - began)


def time_convoy_service(rounds: int, shape: Shape, lane: bool, ring: bool) -> float:
    """The service as a job runs it: the service, an actor and a learner, a process each (``scripts/replay_procs.py``);
    ``ring``: the buffer's ring in /dev/shm, the learner gathering its samples from it (the default on one host);
    ``lane``: the other tensors through each connection's shared-memory lane, else on the socket. Transitions
    inserted + sampled over the time until both are done."""
    script = [sys.executable, str(REPO / "benchmarks" / "scripts" / "replay_procs.py")]
    env = {**os.environ, "REPLAY_SECRET": Credentials.fresh().secret.hex(), "OMP_NUM_THREADS": "1"}  # as in a job
    obs, dtype = "x".join(map(str, shape.obs)), str(shape.dtype).removeprefix("torch.")
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True, "env": env}
    service = subprocess.Popen([*script, "serve", obs, dtype, str(shape.capacity), str(int(ring))], **pipes)  # type: ignore[call-overload]
    try:
        address = service.stdout.readline().split()[1]
        actor = subprocess.Popen([*script, "act", address, obs, dtype, str(rounds), str(int(lane))], **pipes)  # type: ignore[call-overload]
        learner = subprocess.Popen([*script, "learn", address, str(shape.batch), str(rounds * SAMPLES_PER_CHUNK),
                                    str(int(lane))], **pipes)  # type: ignore[call-overload]
        for proc in (actor, learner):
            assert proc.stdout.readline().strip() == "ready"
        for proc in (actor, learner):
            proc.stdin.write("go\n")
            proc.stdin.flush()
        done = [proc.stdout.readline().split() for proc in (actor, learner)]
        for proc in (actor, learner):
            assert proc.wait(60) == 0
        return sum(int(line[1]) for line in done) / max(float(line[2]) for line in done)
    finally:
        service.terminate()
        service.wait(30)


SHARED, SOCKET = "convoy service, shared ring", "convoy service, socket"


def bench_buffer(quick: bool) -> list[str]:
    lines = []
    for shape in (CARTPOLE, FRAMES):
        rounds = (200 if quick else 1000) if shape is CARTPOLE else (50 if quick else 200)
        runs = 3 if quick else 5
        ways = {SHARED: (False, True), "convoy service, ring + lanes": (True, True), SOCKET: (False, False),
                "convoy service, lanes": (True, False)}
        results: dict[str, list[float]] = {**{name: [] for name in ways}, "convoy in-process": [], "RLlib": []}
        skipped = ""
        for run in range(runs):
            for name in (list(ways) if run % 2 == 0 else list(ways)[::-1]):  # A/B/B/A: no side always first
                results[name].append(time_convoy_service(rounds, shape, *ways[name]))
            results["convoy in-process"].append(time_convoy_in_process(rounds, shape))
            peer = time_rllib(rounds, shape.obs, shape.dtype == torch.uint8, shape.capacity, shape.batch)
            if isinstance(peer, str):
                skipped = peer
            else:
                results["RLlib"].append(peer)
        print(f"\n## buffer, {shape.name}: transitions inserted + sampled per second ({runs} runs, median; capacity "
              f"{shape.capacity}, chunks of {CHUNK}, batches of {shape.batch}, {SAMPLES_PER_CHUNK} samples per chunk)")
        medians = {name: statistics.median(rates) for name, rates in results.items() if rates}
        for name, median in medians.items():
            print(f"  {name:<35} {median:>12,.0f} /s   runs {', '.join(f'{r:,.0f}' for r in results[name])}")
        print(f"  learner gathering from the shared ring / everything on the socket: "
              f"{medians[SHARED] / medians[SOCKET]:.2f}x; lanes / socket: "
              f"{medians['convoy service, lanes'] / medians[SOCKET]:.2f}x")
        if "RLlib" not in medians:
            print(f"  RLlib: {skipped}")
            lines.append(f"target buffer throughput vs RLlib, {shape.name}: {skipped} (goal >= 1x) missed")
            continue
        ratio = medians[SHARED] / medians["RLlib"]
        lines.append(f"target buffer throughput, {shape.name}, service with its shared ring / RLlib in-process: "
                     f"{ratio:.2f}x (goal >= 1x) {'met' if ratio >= 1 else 'missed'}")
    return lines
