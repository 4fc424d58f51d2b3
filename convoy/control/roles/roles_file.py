"""The job's roles as the launcher hands them to the master: ``RUN_DIR/roles.json`` (``convoy run`` starts the
master as a process of its own), read back into RoleSpecs, each checked again."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from convoy.errors import ConfigError
from convoy.roles_config import RoleCount, RoleSpec

ROLES_FILE = "roles.json"
"""Where the launcher leaves the job's roles in the run dir for the master (a job without it has none)."""
ROLES_PART = "roles"
"""The name of the roles' state among the master's saved parts (``Store.parts``)."""


def save_roles(run_dir: Path, roles: tuple[RoleSpec, ...]) -> None:
    """Write the roles for the master (``convoy run`` starts the master as a process of its own)."""
    (Path(run_dir) / ROLES_FILE).write_text(json.dumps([asdict(role) for role in roles], indent=1))


def load_roles(run_dir: Path) -> tuple[RoleSpec, ...]:
    """The roles ``save_roles`` wrote; none for a job without the file."""
    path = Path(run_dir) / ROLES_FILE
    if not path.is_file():
        return ()
    try:
        listed = json.loads(path.read_text())
        roles = tuple(RoleSpec(**{**role, "args": tuple(role["args"]), "count": RoleCount(**role["count"])})
                      for role in listed)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"{path} does not hold the job's roles ({exc}); start the job again with convoy run") from exc
    for role in roles:
        role.validate()
    return roles
