"""Each role as its users see it (``convoy.roles()``, ``convoy status``, the dashboard): the count it wants, how
many run and how many wait, its group's round, its policy and what its failures cost. Made from the specs and
from what ``Roles.state()`` saved (pure), so a live master and a reader of the state file
(``read_role_views``) say the same."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from convoy.control.roles.members import RUNNING, STARTING
from convoy.control.roles.roles_file import ROLES_PART, load_roles
from convoy.control.store import read_part
from convoy.roles_config import RoleSpec


def role_views(specs: tuple[RoleSpec, ...], saved: dict[str, Any] | None) -> list[dict[str, Any]]:
    """One row per role, in the job file's order; ``saved``: ``Roles.state()`` (None: the roles have not started)."""
    states = (saved or {}).get("roles", {})
    rows = []
    for spec in specs:
        state = states.get(spec.name, {})
        members = state.get("members", {}).values()
        rows.append({
            "name": spec.name, "count": str(spec.count), "wanted": state.get("target", 0),
            "running": sum(member["state"] == RUNNING for member in members),
            "pending": sum(member["state"] == STARTING for member in members),
            "minimum": spec.count.minimum, "maximum": spec.count.maximum, "service": bool(spec.service),
            "group_round": state.get("group_round", 0) if spec.group else 0, "failure_policy": spec.failure_policy,
            "restarts": state.get("restarts", 0), "replacements": state.get("replacements", 0),
            "preempted": state.get("preempted", 0),
        })
    return rows


def format_roles(rows: list[dict[str, Any]]) -> list[str]:
    """``convoy status``'s lines for the roles."""
    if not rows:
        return []
    lines = ["roles:"]
    for row in rows:
        kind = " (service)" if row["service"] else f" (group round {row['group_round']})" if row["group_round"] else ""
        costs = ", ".join(f"{key} {row[key]}" for key in ("restarts", "replacements", "preempted") if row[key])
        lines.append(f"  {row['name']}{kind}: {row['running']} running, {row['pending']} pending of {row['wanted']} "
                     f"wanted (count {row['count']}); on failure {row['failure_policy']}"
                     + (f"; {costs}" if costs else ""))
    return lines


def read_role_views(run_dir: Path) -> list[dict[str, Any]]:
    """The roles of the job in ``run_dir`` as its master last saved them (none for a job without roles)."""
    specs = load_roles(run_dir)
    if not specs:
        return []
    saved = json.loads(read_part(run_dir, ROLES_PART) or "null")
    return role_views(specs, saved["roles"] if saved else None)
