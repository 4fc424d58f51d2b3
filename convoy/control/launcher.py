"""``convoy run``: the embedded local default, a master in this process plus N local agents."""

from __future__ import annotations

import signal
import time
from typing import Callable

from convoy.config import JobConfig
from convoy.control.job import SUCCEEDED
from convoy.control.master import TOKEN_FILE, JobMaster
from convoy.control.schedulers.local import LocalScheduler
from convoy.procs import Interrupted, raise_interrupted
from convoy.shm import remove_segments

AGENT_EXIT_GRACE_S = 5.0


def run_local_job(config: JobConfig, console: Callable[[str], None] = print) -> int:
    """Run the job to its end; return 0 on success, 1 on failure, 128+N on signal N."""
    config.validate()
    master = JobMaster(config.master, console)
    master.start()
    run_dir = config.master.run_dir
    scheduler = LocalScheduler(master.url, run_dir / TOKEN_FILE, run_dir, config.workers)
    previous = {s: signal.signal(s, raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    started = time.monotonic()
    try:
        console(
            f"convoy: job {master.job.job_id}: {config.num_agents} nodes x {config.workers.nproc_per_node} "
            f"workers, max restarts {config.master.max_restarts}, run dir {run_dir}"
        )
        for index in range(config.num_agents):
            scheduler.start_node(index)
        while not master.wait_ended(0.05):
            if not scheduler.running():
                master.abort("every agent exited before the job ended; see the lines above")
        if not scheduler.wait(config.workers.stop_grace_s + AGENT_EXIT_GRACE_S):
            scheduler.stop(AGENT_EXIT_GRACE_S)
        elapsed = time.monotonic() - started
        succeeded = master.job.status == SUCCEEDED
        console(f"convoy: finished in {elapsed:.1f} s with {master.job.restart_count} restart(s)")
        return 0 if succeeded else 1
    except Interrupted as exc:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        master.abort(f"interrupted by {exc}")
        scheduler.stop(config.workers.stop_grace_s + AGENT_EXIT_GRACE_S)
        return exc.exit_code
    finally:
        if scheduler.running():
            scheduler.stop(AGENT_EXIT_GRACE_S)
        remove_segments(master.job.job_id)  # in case an agent died before it could clean up
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        master.stop()
