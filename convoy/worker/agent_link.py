"""This process's link to its node's agent (``CONVOY_AGENT_URL``): who it is among the job's processes, and a
client of the agent's local API; None outside convoy. Torch-free."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from convoy.errors import ConfigError


@dataclass
class Link:
    """This process under convoy: who it is, and how it reaches its agent."""

    backend: Any
    task: dict[str, Any]
    run_dir: str
    node_id: str


_link: Link | None = None
_link_made = False


def link() -> Link | None:
    """This process's link to its agent (None outside convoy)."""
    global _link, _link_made
    if _link_made:
        return _link
    from convoy.worker.role_env import DEFAULT_ROLE, role
    from convoy.worker.shards import AGENT_TOKEN_ENV, AGENT_URL_ENV, AgentBackend

    env = os.environ
    url = env.get(AGENT_URL_ENV)
    _link_made = True
    if not url:
        return None
    incarnation = env.get("CONVOY_ROLE_INCARNATION", env.get("CONVOY_ROUND", "0"))
    if not incarnation.isdigit():
        raise ConfigError(f"CONVOY_ROLE_INCARNATION/CONVOY_ROUND {incarnation!r} is not a whole number")
    info = role(env)
    name = info.name if "CONVOY_ROLE_INCARNATION" in env else DEFAULT_ROLE  # a plain worker, whatever its ROLE_NAME
    _link = Link(AgentBackend(url, env.get(AGENT_TOKEN_ENV, "")), {"role": name, "rank": info.rank,
                                                                  "incarnation": int(incarnation)},
                 env.get("CONVOY_RUN_DIR", "."), env.get("CONVOY_NODE_ID", "node"))
    return _link
