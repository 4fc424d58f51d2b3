"""The RLHF job's one script: each role process asks ``convoy.role()`` who it is and runs its part: ``store`` (the
prompts and samples service), ``rollout`` (generates), ``trainer`` (GRPO). ``examples/grpo.toml`` declares the
roles; ``examples/grpo.py`` calls ``main``."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from convoy.errors import ConfigError
from convoy.parallel.transport import ConnectionLost, Credentials, IncarnationFence
from convoy.parallel.transport.errors import StaleIncarnation
from convoy.shm import segment_path
from convoy.worker.allocator import keep_freed_memory
from convoy.worker.live_config import train_config
from convoy.worker.role_env import SERVICE_HOST_ENV, role
from convoy.workloads.lookahead.model import load_model
from convoy.workloads.rlhf.config import GRPOConfig
from convoy.workloads.rlhf.evaluate import plot_reward
from convoy.workloads.rlhf.prompts import PromptQueue
from convoy.workloads.rlhf.rollout import Rollout
from convoy.workloads.rlhf.store import SampleStore
from convoy.workloads.rlhf.store_client import StoreClient
from convoy.workloads.rlhf.store_service import StoreService
from convoy.workloads.rlhf.trainer import Trainer

ROLES = ("store", "rollout", "trainer")


def say(line: str) -> None:
    print(line, flush=True)


def store_address() -> str:
    """The store's address as the job publishes it now ('' while it has none)."""
    peers = role().refresh().addresses.get("store", ())
    return peers[0] if peers else ""


def board_path() -> Path:
    return segment_path(os.environ["CONVOY_JOB_ID"], "rlhf-weights")


def run_store(cfg: GRPOConfig) -> int:
    me, env = role(), os.environ
    service = StoreService(SampleStore(cfg.capacity, cfg.max_lag), PromptQueue(cfg.lease_s), cfg.group_size,
                           env[SERVICE_HOST_ENV], int(env["CONVOY_ROLE_PORT"]), per_step=cfg.groups_per_step,
                           credentials=Credentials.from_env(), admit=IncarnationFence(me).check, say=say)
    say(f"store: serving at {service.address}: {cfg.groups_per_step} groups of {cfg.group_size} a step, k = "
        f"{cfg.max_lag}, capacity {cfg.capacity} groups")
    stopped: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stopped.append(True))  # the job's end: say the counts, then exit
    while not stopped and not service.stopped.wait(0.2):
        pass
    stats = service.stats()
    say(f"store: {stats['issued']} prompts issued, {stats['put']} groups put, {stats['taken']} taken, "
        f"{stats['dropped_stale']} dropped as stale (never trained on), {stats['late_groups']} late, "
        f"{stats['prompts_requeued']} prompts requeued, dropped {stats['dropped_prompts'] or 'none'}")
    service.close()
    return 0


def models(cfg: GRPOConfig, copies: int) -> tuple[Any, ...]:
    """``copies`` loads of the policy, then its tokenizer."""
    loaded = [load_model(cfg.model) for _ in range(copies)]
    return (*[model for model, _ in loaded], loaded[0][1])


def run_rollout(cfg: GRPOConfig, store: StoreClient) -> int:
    me = role()
    name = f"rollout {me.rank}"
    stopped: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stopped.append(True))  # the job's end: finish the group, then exit
    store.stopping = lambda: bool(stopped) or me.preempted
    links = (store, StoreClient(store_address, stopping=store.stopping),
             StoreClient(store_address, stopping=store.stopping))
    rollout = Rollout(cfg, links, board_path(), models(cfg, 2), name, say)
    say(f"{name}: pid {os.getpid()}, incarnation {me.incarnation}")
    try:
        rollout.run(store.stopping)
    except ConnectionLost:
        if not store.stopping():
            raise
    finally:
        pauses = sorted(rollout.pauses_ms)
        median = f"{pauses[len(pauses) // 2]:.2f} ms" if pauses else "none"
        checked = rollout.checked
        taken = f" (versions {checked[0]}..{checked[-1]})" if checked else ""
        say(f"{name}: {rollout.groups} groups kept, refused {rollout.refused or 'none'}, {rollout.reward_failures} "
            f"dropped for a reward function that raised; {len(checked)} versions taken{taken}, each bit for bit the "
            f"trainer's; pause per swap median {median}, max {max(pauses, default=0.0):.2f} ms")
        rollout.close()
    return 0


def run_trainer(cfg: GRPOConfig, store: StoreClient) -> int:
    began = time.monotonic()
    keep_freed_memory()  # a step's logits and activations reuse the last step's pages: none zeroed afresh
    trainer = Trainer(cfg, store, board_path(), models(cfg, 1), say)
    rank = trainer.ctx.rank
    say(f"trainer {rank}: world size {trainer.ctx.world_size}, from step {trainer.start}, {trainer.share} groups a "
        f"step (pid {os.getpid()})")
    steps = trainer.run()
    if rank == 0:
        stats = store.call("stats").meta
        say(f"trainer: {steps} steps, {trainer.progress.samples} samples in {time.monotonic() - began:.0f} s, last "
            f"version {trainer.progress.version}, waited {trainer.waited_s:.0f} s for groups (longest "
            f"{trainer.longest_wait_s:.1f} s); store: {stats['taken']} groups taken, {stats['dropped_stale']} dropped "
            f"as stale (k = {cfg.max_lag}), none trained beyond k")
        curve = trainer.progress.curve
        if cfg.plot:
            path = Path(cfg.plot) if Path(cfg.plot).is_absolute() else Path(os.environ["CONVOY_RUN_DIR"]) / cfg.plot
            plot_reward(curve, path, f"GRPO on arithmetic ({cfg.model})")
            say(f"trainer: reward curve written to {path}")
        if curve:
            say(f"final: held-out reward {100 * curve[0][1]:.1f}% -> {100 * curve[-1][1]:.1f}% after "
                f"{curve[-1][0]} samples")
    trainer.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    me = role()
    if me.name not in ROLES:
        raise ConfigError(f"role {me.name!r} is not part of the RLHF job; its roles are {', '.join(ROLES)} "
                          "(see examples/grpo.toml)")
    cfg = train_config(GRPOConfig)
    cfg.validate()
    if me.name == "store":
        return run_store(cfg)
    store = StoreClient(store_address)
    try:
        return run_rollout(cfg, store) if me.name == "rollout" else run_trainer(cfg, store)
    except StaleIncarnation as exc:  # stopped, and a newer process runs this rank: it writes nothing more
        say(f"{me.name} {me.rank}: stops: {exc}")
        return 0


if __name__ == "__main__":
    sys.exit(main())
