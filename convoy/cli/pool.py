"""``convoy preempt`` and ``convoy pool``: the pool of CPUs and memory that the jobs of this machine share.

``convoy preempt --cpus N [--memory SIZE] --priority P [--seconds S]`` stands for a job of priority P that needs N
CPUs (and SIZE of memory): it asks the pool for them, waits until jobs of lower priority have given them back (their
elastic roles down to MIN), says how long that took, holds them for S seconds (until SIGINT or SIGTERM without
``--seconds``), and gives them back. ``convoy pool`` lists every claim.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
import uuid

from convoy import log
from convoy.control.pool.claims import Amount, Claim, describe
from convoy.control.pool.store import PoolStore
from convoy.errors import ConfigError
from convoy.ray_config import parse_size
from convoy.procs import Wakeup

POLL_S = 0.02


def add_pool_commands(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    preempt = commands.add_parser("preempt", help="stand for a job of higher priority: take CPUs and memory from the "
                                                  "pool, preempting jobs of lower priority")
    preempt.add_argument("--cpus", type=float, default=0.0, help="CPUs to take")
    preempt.add_argument("--memory", default="", help="memory to take, e.g. 4GiB")
    preempt.add_argument("--priority", type=int, required=True, help="its priority (jobs below it give back)")
    preempt.add_argument("--seconds", type=float, default=None,
                         help="hold the CPUs this long, then give them back (default: until SIGINT or SIGTERM)")
    preempt.add_argument("--timeout", type=float, default=60.0,
                         help="give up when the CPUs are not free within this many seconds (default %(default)s)")
    commands.add_parser("pool", help="list the claims of the jobs that share this machine's CPU pool")


def show_pool(args: argparse.Namespace) -> int:
    store = PoolStore()
    view = store.view()
    print(f"convoy pool {store.path}: {view.capacity.describe()}; {view.held.describe()} held, {view.free.describe()} "
          "free")
    for line in describe(view.claims) or ["  no claims"]:
        print(line)
    return 0


def preempt(args: argparse.Namespace) -> int:
    store = PoolStore()
    need = Amount(args.cpus, float(parse_size(args.memory, "--memory")))
    if not (args.cpus >= 0 and args.cpus < float("inf")) or not need.any():
        raise ConfigError(f"--cpus {args.cpus:g}: give a positive number of CPUs (or --memory), e.g. --cpus 2")
    if not need.within(store.capacity):
        raise ConfigError(f"--cpus {args.cpus:g} --memory {args.memory or 0} is more than the pool's "
                          f"{store.capacity.describe()} ({store.path}): it could never be free; ask for at most that")
    if args.seconds is not None and not args.seconds >= 0:
        raise ConfigError(f"--seconds {args.seconds}: give 0 or more seconds")
    stop = Wakeup()  # a handler that sets a threading.Event can deadlock on the lock its wait holds
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    job_id = f"preempt-{uuid.uuid4().hex[:8]}"
    asked = Claim(job_id, args.priority, Amount(), Amount(), need, time.time(), os.getpid(), "")
    began = time.monotonic()
    try:
        store.put(asked)
        log.info(f"convoy preempt: {job_id} asks for {need.describe()} at priority {args.priority}")
        while not store.take(asked, need):
            if stop.wait(POLL_S):
                return 130
            if time.monotonic() - began > args.timeout:
                free = store.view().free.least(need)
                raise ConfigError(f"only {free.describe()} of {need.describe()} free after {args.timeout:g} s: jobs of "
                                  f"priority {args.priority} or more hold the rest (convoy pool lists them)")
        store.put(Claim(job_id, args.priority, need, need, Amount(), asked.since, os.getpid(), ""))
        print(f"convoy preempt: {need.describe()} free after {time.monotonic() - began:.3f} s (priority "
              f"{args.priority})", flush=True)
        stop.wait(args.seconds)
        return 0
    finally:
        store.remove(job_id)
        store.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        stop.close()
