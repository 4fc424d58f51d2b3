"""``convoy manager --run-dirs D1 D2 ...``: watch several running jobs, apply their rules' proposals, push a config.

Each master judges its own job's status with the same rules (``control/training/rules.py``); the manager reads
every job's newest status and open proposals each ``--interval``, prints a line per job and per new proposal,
applies the proposals of the rules named by ``--auto-apply``, and sends ``--set KEY=VALUE`` to every job once.
It ends when every job has ended (or after one look with ``--once``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from convoy.errors import ConfigError, ConvoyError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dirs", type=Path, nargs="+", required=True, metavar="RUN_DIR",
                        help="the run directories of the jobs to watch")
    parser.add_argument("--auto-apply", default="", metavar="RULES",
                        help="apply the proposals of these rules (e.g. nan,divergence) in every job")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="set this training config value in every job once, at the start (repeatable)")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between looks (default %(default)s)")
    parser.add_argument("--once", action="store_true", help="look once, then exit")


def run(args: argparse.Namespace) -> int:
    from convoy.cli.live_config import job_client
    from convoy.control.protocol import training as tp
    from convoy.control.training.versions import parse_assignments
    from convoy.control.training.rules import RULES

    rules = {rule.strip() for rule in args.auto_apply.split(",") if rule.strip()}
    if rules - set(RULES):
        raise ConfigError(f"--auto-apply {','.join(sorted(rules - set(RULES)))}: not a status rule (the rules: "
                          f"{', '.join(RULES)})")
    if not args.interval > 0:
        raise ConfigError(f"--interval {args.interval}: give a number of seconds above 0")
    values = parse_assignments(args.set)
    jobs = {run_dir: job_client(run_dir) for run_dir in args.run_dirs}  # every run dir checked before anything
    if values:
        for run_dir, (client, job) in jobs.items():
            _say(run_dir, _push(client, tp.ConfigSet(values=values, author="convoy manager",
                                                     reason="convoy manager --set")))
    seen: dict[Path, set[int]] = {run_dir: set() for run_dir in jobs}
    while True:
        running = 0
        for run_dir, (client, job) in jobs.items():
            try:
                state = client.get("/config")
                metrics = client.get("/metrics?limit=1")
            except ConvoyError as exc:  # the job ended (its master is gone), or its master is slow
                _say(run_dir, f"not answering ({str(exc).splitlines()[0]})")
                continue
            running += state["job_status"] == "running"
            _say(run_dir, summary(job["job_id"], state, metrics["latest"]))
            for item in state["proposals"]:
                if item["id"] in seen[run_dir]:
                    continue
                seen[run_dir].add(item["id"])
                _say(run_dir, f"proposal {item['id']} ({item['status']}): {item['rule']} at step {item['step']}: "
                              f"{item['evidence']}")
                if item["status"] == "open" and item["rule"] in rules:
                    action = tp.ProposalAction(proposal=item["id"], action="apply", author="convoy manager")
                    _say(run_dir, _push(client, action, "/config/proposals"))
        if args.once or not running:
            return 0
        time.sleep(args.interval)


def summary(job_id: str, state: dict[str, Any], latest: list[dict[str, Any]]) -> str:
    """One line: the job's status, its config version, and its ranks' newest step and loss."""
    steps = [row["step"] for row in latest]
    losses = [row["loss"] for row in latest if isinstance(row["loss"], (int, float))]
    where = f"step {min(steps)}..{max(steps)}" if steps else "no status yet"
    loss = f", loss {sum(losses) / len(losses):.4g}" if losses else ""
    pending = sum(item["status"] == "open" for item in state["proposals"])
    return (f"job {job_id} {state['job_status']}: config v{state['version']}, {len(latest)} ranks at {where}{loss}"
            f"{f', {pending} open proposal(s)' if pending else ''}")


def _push(client: Any, request: Any, path: str = "/config") -> str:
    from convoy.control.protocol import training as tp

    try:
        version = client.call(path, request, tp.VersionInfo)
    except ConvoyError as exc:
        return f"refused: {str(exc).split(': ', 1)[-1]}"
    changed = ", ".join(f"{name}={value!r}" for name, value in version.changed.items())
    return f"config version {version.number} ({changed or 'a rollback'}) from step {version.at_step}"


def _say(run_dir: Path, line: str) -> None:
    print(f"convoy manager: {run_dir}: {line}", flush=True)
