"""The RL job's one script: each role process asks ``convoy.role()`` who it is and runs its part (``replay``,
``actor``, ``learner``, ``controller``). ``examples/rl_dqn.toml`` declares the roles; ``examples/rl_dqn.py`` calls
``main``."""

from __future__ import annotations

import os
import secrets
import sys
import time
from pathlib import Path

from convoy.errors import ConfigError
from convoy.parallel.transport import Credentials, IncarnationFence
from convoy.parallel.transport.errors import StaleIncarnation
from convoy.shm import SHM_DIR, segment_path
from convoy.worker.role_env import SERVICE_HOST_ENV
from convoy.worker.live_config import train_config
from convoy.worker.role_env import role
from convoy.workloads.rl.actor import Actor
from convoy.workloads.rl.buffer import Layout, ReplayBuffer
from convoy.workloads.rl.config import RLConfig
from convoy.workloads.rl.controller import Controller
from convoy.workloads.rl.envs import EnvSpec, make
from convoy.workloads.rl.learner import Learner
from convoy.workloads.rl.plot import plot_curve
from convoy.workloads.rl.rates import Throttle
from convoy.workloads.rl.replay_client import ReplayClient
from convoy.workloads.rl.replay_service import ReplayService
from convoy.workloads.rl.replay_snapshots import BufferSnapshots
from convoy.workloads.rl.ring import RingNoSpace, SharedRing

ROLES = ("replay", "actor", "learner", "controller")


def say(line: str) -> None:
    print(line, flush=True)


def env_spec(cfg: RLConfig) -> EnvSpec:
    env = make(cfg.env)
    try:
        return EnvSpec.of(env)
    finally:
        env.close()


def replay_address() -> str:
    """The replay service's address as the job publishes it now ('' while it has none)."""
    peers = role().refresh().peers("replay")
    return peers[0] if peers else ""


def run_replay(cfg: RLConfig) -> int:
    env = os.environ
    me = role()
    snapshots = BufferSnapshots.for_rank(env["CONVOY_JOB_ID"], me.rank)
    for problem in snapshots.problems():
        say(f"replay: ignoring an unreadable snapshot: {problem}")
    restored = snapshots.restore(seed=cfg.seed)
    if restored is not None:
        buffer, extra = restored
        say(f"replay: restored {buffer.size} transitions ({buffer.counters.inserted} inserted before) from "
            f"{snapshots.segment}")
    else:
        spec = env_spec(cfg)
        buffer, extra = ReplayBuffer(Layout.for_dqn((spec.obs_size,)), cfg.capacity, cfg.capacity_bytes, cfg.alpha,
                                     cfg.beta, seed=cfg.seed), {}
    throttle = None
    if cfg.mode == "throttle":
        error = cfg.throttle_error or (cfg.batch + cfg.insert_batch * cfg.target_ratio)
        throttle = Throttle(cfg.target_ratio, min_size=cfg.learning_starts, error=error)
    ring = shared_ring(env["CONVOY_JOB_ID"], me.rank, buffer)
    service = ReplayService(buffer, env[SERVICE_HOST_ENV], int(env["CONVOY_ROLE_PORT"]), snapshots=snapshots,
                            snapshot_every_s=cfg.snapshot_every_s, throttle=throttle, say=say,
                            credentials=Credentials.from_env(), admit=IncarnationFence(me).check, kept=extra,
                            ring=ring)
    say(f"replay: serving {buffer.capacity} transitions at {service.address} ({cfg.mode} mode)"
        + (f"; learners on this host gather samples from {ring.path}" if ring is not None else ""))
    service.wait()
    service.close()
    return 0


def shared_ring(job_id: str, rank: int, buffer: ReplayBuffer) -> SharedRing | None:
    """The buffer's ring in /dev/shm (an earlier incarnation's removed first); None, said once, without room."""
    for old in SHM_DIR.glob(f"{segment_path(job_id, f'replay{rank}-ring-').name}*"):
        old.unlink(missing_ok=True)  # a learner that still maps it keeps its pages until it lets go
    try:
        return SharedRing.create(segment_path(job_id, f"replay{rank}-ring-{secrets.token_hex(6)}"), buffer.layout,
                                 buffer.capacity)
    except RingNoSpace as exc:
        say(f"replay: {exc}; learners get their samples over the transport")
        return None


def run_learner(cfg: RLConfig, replay: ReplayClient) -> int:
    me = role()
    learner = Learner(cfg, replay, env_spec(cfg), say, lambda: me.preempted)
    say(f"learner {learner.ctx.rank}: training {cfg.env} (pid {os.getpid()}), world size {learner.ctx.world_size}, "
        f"from step {learner.start}; samples {learner.prefetch.client.sample_route()}")
    began = time.monotonic()
    steps = learner.run()
    if learner.left:
        say(f"learner {learner.ctx.rank}: left at {steps} steps trained, as told (a member preempted); the group "
            "forms again from its snapshot")
    elif learner.ctx.rank == 0:
        stats = replay.stats()
        mean = stats.get("mean_return")
        said = f"{mean:.1f}" if isinstance(mean, float) else "none (no episode finished)"
        say(f"learner: {steps} steps in {time.monotonic() - began:.1f} s; buffer inserted {stats['inserted']}, "
            f"sampled {stats['sampled']}, refused {stats['refused']}, {stats['duplicates']} sent twice (skipped), "
            f"waited {stats['waited_insert_s']:.1f} s "
            f"(inserts) and {stats['waited_sample_s']:.1f} s (samples)")
        if cfg.plot:
            path = Path(cfg.plot) if Path(cfg.plot).is_absolute() else Path(os.environ["CONVOY_RUN_DIR"]) / cfg.plot
            plot_curve(learner.curve.points, path, f"DQN on {cfg.env}")
            say(f"learner: learning curve written to {path}")
        say(f"final: mean return {said} over the last {stats['returns_kept']} episodes after {stats['env_steps']} "
            "environment steps")
    learner.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    me = role()
    if me.name not in ROLES:
        raise ConfigError(f"role {me.name!r} is not part of the RL job; its roles are {', '.join(ROLES)} "
                          "(see examples/rl_dqn.toml)")
    cfg = train_config(RLConfig)  # every role can restart: the buffer from its snapshot, the rest as they start
    cfg.validate()
    if me.name == "replay":
        return run_replay(cfg)
    replay = ReplayClient(replay_address)
    try:
        if me.name == "learner":
            return run_learner(cfg, replay)
        if me.name == "controller":
            Controller(cfg, replay, say).run()
            return 0
        actor = Actor(cfg, replay, me.rank, say, me.incarnation, lambda: me.preempted)
        say(f"actor {me.rank}: stepping {cfg.env} (pid {os.getpid()}, incarnation {me.incarnation}); transitions to "
            f"the replay service {replay.route()}")
        why = actor.run()
        say(f"actor {me.rank}: {why}")
        return 0
    except StaleIncarnation as exc:  # this process was stopped and a newer one runs its rank: it writes nothing
        say(f"{me.name} {me.rank}: stops: {exc}")
        return 0
    finally:
        replay.close()


if __name__ == "__main__":
    sys.exit(main())
