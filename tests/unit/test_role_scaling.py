"""Scaling from inside the job, the parts that need no job: outside convoy the calls say how to scale from
outside; ``wait_changed`` returns once the agent's file shows a change (a new world size), and times out
otherwise."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from convoy.errors import ConfigError
from convoy.worker.role_env import ADDRESSES_FILE_ENV, role, write_addresses
from convoy.worker.scaling import roles, scale


def test_scaling_outside_a_job_of_roles_says_how_to_scale_from_outside() -> None:
    with pytest.raises(ConfigError, match=r"convoy.scale works in a process of a convoy job of roles .* from outside "
                                          r"the job, run: convoy scale --run-dir RUN_DIR ROLE=COUNT"):
        scale("actor", 2, env={})
    with pytest.raises(ConfigError, match=r"convoy.roles\(\) works in a process of a convoy job of roles"):
        roles(env={"CONVOY_AGENT_URL": "http://127.0.0.1:1"})  # a plain worker: no role incarnation
    with pytest.raises(ConfigError, match=r"convoy.scale\('actor', -1\): a count is 0 or more"):
        scale("actor", -1, env={})
    with pytest.raises(ConfigError, match="give the count as a whole number"):
        scale("actor", 2.5, env={})  # type: ignore[arg-type]


def test_wait_changed_returns_the_new_world_size_once_the_agent_writes_it(tmp_path: Path) -> None:
    path = tmp_path / "addresses.json"
    write_addresses(path, 3, {"actor": ["h:1", "h:2"], "replay": ["h:9"]}, {"actor": [0, 1], "replay": [0]})
    env = {"ROLE_NAME": "actor", "ROLE_RANK": "0", "ROLE_WORLD_SIZE": "2", ADDRESSES_FILE_ENV: str(path)}
    me = role(env)
    assert (me.world_size, me.addresses_version) == (2, 3)
    assert me.wait_changed(timeout=0.1) is None, "nothing changed"
    timer = threading.Timer(0.2, write_addresses, (path, 4, {"actor": ["h:1", "h:2", "h:3"], "replay": ["h:9"]},
                                                      {"actor": [0, 1, 2], "replay": [0]}))
    timer.start()
    began = time.monotonic()
    changed = me.wait_changed(timeout=10)
    timer.join()
    assert changed is not None and changed.world_size == 3 and changed.addresses["actor"][2] == "h:3"
    assert time.monotonic() - began < 1.0, "seen within a few polls"


def test_wait_changed_without_a_job_needs_a_timeout() -> None:
    me = role({})
    with pytest.raises(ConfigError, match="without a timeout outside a convoy job of roles would never return"):
        me.wait_changed()
    assert me.wait_changed(timeout=0.01) is None
