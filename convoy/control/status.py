"""Text for ``convoy status``: the job, its nodes, the last round, and recent events."""

from __future__ import annotations

import json
import time
from typing import Any

from convoy.control.sanitize import printable


def _clock(ts: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts)) if ts else "-"


def _line(text: object) -> str:
    """One line of a recorded text, its control characters escaped: what agents sent cannot forge lines."""
    return printable(str(text).splitlines()[0] if str(text) else "")


def format_status(state: dict[str, Any]) -> str:
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
    lines.append("recent events:")
    for event in state["events"]:
        lines.append(f"  {_clock(event['ts'])} {_line(event['kind']):<14} {_line(event['message'])}")
    return "\n".join(lines)

