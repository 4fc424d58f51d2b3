"""Text for ``convoy status``: the job, its nodes, the last round, and recent events."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from convoy.sanitize import printable

MEMORY_FILE = "memory.json"
"""Where the master leaves each role process's predicted memory, limit and measured peak for ``convoy status``."""


def _clock(ts: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts)) if ts else "-"


def write_memory(run_dir: Path, rows: list[dict[str, object]], margin: float) -> None:
    path = Path(run_dir) / MEMORY_FILE
    temporary = path.with_suffix(".tmp")
    try:
        temporary.write_text(json.dumps({"margin": margin, "processes": rows}))
        os.chmod(temporary, 0o600)  # private, as the job's state is
        os.replace(temporary, path)
    except OSError:
        pass  # a full disk: status shows the last table written; the job goes on


def read_memory(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(run_dir) / MEMORY_FILE).read_text())
    except (OSError, ValueError):
        return None


def format_memory(table: dict[str, Any] | None) -> list[str]:
    """Per role process: the memory predicted from the measuring iteration, its limit, its measured peak."""
    if not table or not table.get("processes"):
        return []
    lines = [f"memory (MiB; margin {table['margin']:.1%}):",
             f"  {'process':<28} {'predicted':>9} {'limit':>9} {'peak':>9}  state"]
    for row in table["processes"]:
        name = f"{row['role']} {row['rank']} (incarnation {row['incarnation']})"
        how = f" ({row['mechanism']})" if row["limit_bytes"] and row["mechanism"] else ""
        lines.append(f"  {name:<28} {_mib(row['predicted_bytes']):>9} {_mib(row['limit_bytes']):>9} "
                     f"{_mib(row['peak_bytes']):>9}  {row['state']} on {row['node']}{how}")
    return lines


def _mib(value: int) -> str:
    return f"{value / 2**20:.1f}" if value else "-"


def _line(text: object) -> str:
    """One line of a recorded text, its control characters escaped: what agents sent cannot forge lines."""
    return printable(str(text).splitlines()[0] if str(text) else "")


def format_training(latest: list[dict[str, Any]], versions: list[dict[str, Any]]) -> list[str]:
    """Each rank's newest status (``convoy.report``) and the training config's version in use."""
    if not latest and not versions:
        return []
    lines = []
    if versions:
        current = versions[-1]
        changed = ", ".join(f"{name}={value!r}" for name, value in current["changed"].items())
        lines.append(f"training config: version {current['number']} ({current['status']}, from step "
                     f"{current['at_step']}): {_line(changed)}")
    if latest:
        lines.append(f"  {'rank':<16} {'step':>8} {'loss':>12} {'step s':>8} {'samples/s':>10} {'RSS MiB':>8}")
    for row in latest:
        loss = row["loss"] if isinstance(row["loss"], str) else f"{row['loss']:.5g}" if row["loss"] is not None else "-"
        numbers = [f"{row['step_time_s']:.3f}" if row["step_time_s"] is not None else "-",
                   f"{row['samples_per_s']:.0f}" if row["samples_per_s"] is not None else "-",
                   _mib(row["memory_bytes"] or 0)]
        lines.append(f"  {_line(row['task']):<16} {row['step']:>8} {loss:>12} {numbers[0]:>8} {numbers[1]:>10} "
                     f"{numbers[2]:>8}")
    return lines


def format_status(state: dict[str, Any], memory: dict[str, Any] | None = None,
                  training: list[str] | None = None) -> str:
    job = state["job"]
    if job is None:
        return "no job recorded yet"
    lines = [
        f"job {_line(job['job_id'])}: {job['status']}, round {job['round_id']}, "
        f"restarts {job['restart_count']}/{job['max_restarts']}, nodes {job['min_nodes']}:{job['max_nodes']}, "
        f"master {_line(job['master_url'])}",
    ]
    if job["outcome"]:
        lines.append(f"  {_line(job['outcome'])}")
    round_row = state["round"]
    if round_row:
        members = ", ".join(f"node{rank}={_line(host)}x{nproc}"
                            for rank, _, host, nproc in json.loads(round_row["members"]))
        lines.append(f"round {round_row['round_id']}: world size {round_row['world_size']}, "
                     f"store {_line(round_row['master_addr'])}:{round_row['master_port']} [{members}]")
    lines.append("nodes:")
    for node in state["nodes"]:
        rank = "-" if node["node_rank"] is None else node["node_rank"]
        lines.append(f"  {_line(node['node_id']):<20} rank {rank:<3} {_line(node['host']):<15} x{node['nproc']} "
                     f"{_line(node['state']):<6} last seen {_clock(node['last_seen'])}")
    lines += format_memory(memory)
    lines += training or []
    interval = state.get("snapshot_interval")
    if interval:  # Checkpointer(max_overhead=...): how often it snapshots, and the steps a failure may cost
        lines.append(f"{_line(interval['message'])} (said {_clock(interval['ts'])})")
    lines.append("recent events:")
    for event in state["events"]:
        lines.append(f"  {_clock(event['ts'])} {_line(event['kind']):<14} {_line(event['message'])}")
    return "\n".join(lines)

