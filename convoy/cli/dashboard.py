"""``convoy dashboard --run-dirs D1 D2 ...``: the dashboard's pages for several jobs, running or finished, read from
their state files; actions (abort, apply a proposal, scale) reach a running job's master with its token."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dirs", type=Path, nargs="+", required=True, metavar="RUN_DIR",
                        help="the run directories of the jobs to show (one that holds no job is listed as such)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default: any free one)")


def run(args: argparse.Namespace) -> int:
    from convoy.control.dashboard.actions import through_api
    from convoy.control.dashboard.server import Dashboard, JobEntry
    from convoy.control.dashboard.views import not_a_job
    from convoy.control.limits import FrontDoor, Limits
    from convoy.control.store import read_status
    from convoy.procs import Interrupted, raise_interrupted

    entries: list[JobEntry] = []
    for index, run_dir in enumerate(args.run_dirs):
        key = f"dir{index + 1}"
        if not not_a_job(run_dir):
            key = str(read_status(run_dir, recent=0)["job"]["job_id"])
        while key in {entry.key for entry in entries}:
            key += "-2"
        entries.append(JobEntry(key, run_dir.resolve(), call=through_api(run_dir.resolve())))
    dashboard = Dashboard(entries)
    limits = Limits()
    front = FrontDoor(args.host, args.port, limits, dashboard.screen, dashboard.serve)
    front.start()
    for entry in entries:
        problem = not_a_job(entry.run_dir)
        print(f"convoy: {entry.key}: {problem or entry.run_dir}", flush=True)
    print(f"convoy: dashboard of {len(entries)} run dir(s) at {dashboard.login_link(*front.address)} (a one-time "
          "login link); Ctrl-C stops it", flush=True)
    previous = {s: signal.signal(s, raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        signal.pause()
    except Interrupted:
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        front.stop()
        dashboard.stop()
    return 0
