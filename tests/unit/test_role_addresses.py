"""The current role addresses: the master's version grows when a process's address changes (a PS down, back on a
new port), the agent's file is replaced whole, convoy.role() and RoleInfo.refresh() read it, and bad files are named (which ports the agent takes:
test_ports)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_role_master import exited, ps_job, running_job, started

from convoy.errors import ConfigError
from convoy.worker.role_env import (ADDRESSES_FILE_ENV, INCARNATION_ENV, addresses_file, read_addresses, role, role_env,
                                    write_addresses)


def test_the_published_version_grows_only_when_an_address_changes() -> None:
    master = ps_job()
    placed = running_job(master)
    version, addresses, incarnations = master.published()
    assert incarnations == {"ps": [0], "worker": [0, 1]}
    assert addresses == {"ps": ["127.0.0.1:5000"], "worker": ["127.0.0.1:6000", "127.0.0.1:6001"]}
    assert master.published()[0] == version, "nothing changed: same version"
    ps_node, ps = placed[("ps", 0)]
    exited(master, ps_node, ps, -9)
    down_version, down, down_incarnations = master.published()
    assert down_version == version + 1 and down["ps"] == [""], "a PS that is down has no address"
    assert down_incarnations["ps"] == [1], "the restarted PS is a new incarnation of rank 0"
    again = master.deliver(ps_node, 10.0)[0]
    assert [(a.role, a.rank, a.restore) for a in again] == [("ps", 0, True)]
    started(master, ps_node, again[0], 5999)
    assert master.published()[:2] == (version + 2, {**addresses, "ps": ["127.0.0.1:5999"]})


def test_the_addresses_file_is_replaced_whole_and_read_back(tmp_path: Path) -> None:
    path = addresses_file(tmp_path, "node/1")
    assert path == tmp_path / "roles" / "addresses-node_1.json"
    assert read_addresses(path) == (0, {}), "no file yet: nothing newer than the environment"
    write_addresses(path, 3, {"ps": ["h:1", ""]})
    write_addresses(path, 4, {"ps": ["h:1", "h:2"]})
    assert read_addresses(path) == (4, {"ps": ("h:1", "h:2")})
    assert [p.name for p in path.parent.iterdir()] == [path.name], "no partial file left behind"


def test_role_and_refresh_read_the_current_addresses_over_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "addresses.json"
    env = {**role_env("worker", 1, 2, {"ps": ["h:1", "h:2"]}), ADDRESSES_FILE_ENV: str(path)}
    info = role(env)
    assert info.peers("ps") == ("h:1", "h:2") and info.addresses_version == 0, "no file: the environment's"
    assert info.refresh() is info
    write_addresses(path, 2, {"ps": ["h:1", "h:9"]})
    fresh = info.refresh()
    assert fresh.peers("ps") == ("h:1", "h:9") and fresh.addresses_version == 2 and fresh.rank == 1
    assert role(env).peers("ps") == ("h:1", "h:9"), "convoy.role() reads the file too"
    write_addresses(path, 1, {"ps": ["old:1", "old:2"]})
    assert fresh.refresh() is fresh, "an older version is not taken"
    path.write_text(json.dumps({"addresses": {}}))
    with pytest.raises(ConfigError, match=r"addresses.json does not hold role addresses .*do not edit it"):
        fresh.refresh()


def test_a_process_knows_its_incarnation_and_reads_every_ranks_current_one(tmp_path: Path) -> None:
    path = tmp_path / "addresses.json"
    env = {**role_env("worker", 1, 2, {}), ADDRESSES_FILE_ENV: str(path), INCARNATION_ENV: "3"}
    info = role(env)
    assert info.incarnation == 3 and info.current_incarnation("ps", 0) is None, "no file yet: not known"
    write_addresses(path, 1, {"ps": ["h:1"], "worker": ["h:2", "h:3"]}, {"ps": [4], "worker": [0, 3]})
    fresh = info.refresh()
    assert fresh.current_incarnation("ps", 0) == 4 and fresh.current_incarnation("worker", 1) == 3
    assert fresh.current_incarnation("worker", 2) is None and fresh.current_incarnation("chief", 0) is None
    with pytest.raises(ConfigError, match="CONVOY_ROLE_INCARNATION='x' is not a whole number"):
        role({**env, INCARNATION_ENV: "x"})
