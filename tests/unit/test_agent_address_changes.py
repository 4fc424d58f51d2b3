"""The agent's side of role addresses sent as changes (issue 54): changes from the version it holds are applied and
written for its processes; changes from another version (a reply it missed, a master that restarted) are not
applied: the agent drops to version 0, so the next reply sends every address, and its processes keep the file
they have until then."""

from __future__ import annotations

from pathlib import Path

from convoy.agent.agent_config import AgentConfig
from convoy.agent.heartbeat import Heartbeat
from convoy.config import WorkerConfig
from convoy.control.protocol import messages as p
from convoy.worker.role_env import addresses_file, read_published


def heartbeat(tmp_path: Path) -> Heartbeat:
    config = AgentConfig(master_host="127.0.0.1", master_port=1, token="t" * 32, node_id="n0", host="127.0.0.1",
                         run_dir=tmp_path, workers=WorkerConfig(entrypoint="x.py"), roles=True)
    return Heartbeat(config)


def reply(version: int, **fields: object) -> p.HeartbeatResponse:
    return p.HeartbeatResponse(job_status="running", round_id=1, addresses_version=version, **fields)


def test_changes_from_the_held_version_apply_and_changes_from_another_ask_for_everything(tmp_path: Path) -> None:
    beat = heartbeat(tmp_path)
    path = addresses_file(tmp_path, "n0")
    beat._publish_addresses(reply(3, addresses={"actor": ["h:1", "h:2"]}, incarnations={"actor": [1, 1]}))
    assert (beat.addresses_version, read_published(path).addresses) == (3, {"actor": ("h:1", "h:2")})

    moved = p.AddressChanges(since=3, sizes={"actor": 3}, addresses={"actor": {1: "h:9", 2: "h:3"}},
                             incarnations={"actor": {1: 2, 2: 1}})
    beat._publish_addresses(reply(5, address_changes=moved))
    published = read_published(path)
    assert published.version == 5 and published.addresses == {"actor": ("h:1", "h:9", "h:3")}
    assert beat.incarnations == {"actor": [1, 2, 1]}

    # changes counted from version 4, which this node never held: not applied, the file stays at 5, version 0 asked
    skipped = p.AddressChanges(since=4, sizes={"actor": 3}, addresses={"actor": {0: "h:7"}})
    beat._publish_addresses(reply(6, address_changes=skipped))
    assert beat.addresses_version == 0
    assert read_published(path).version == 5 and read_published(path).addresses["actor"][0] == "h:1"

    # the master's next reply to version 0 carries every address: applied whole, the older held lists replaced
    beat._publish_addresses(reply(6, addresses={"actor": ["h:7", "h:9"]}, incarnations={"actor": [3, 2]}))
    assert beat.addresses_version == 6 and read_published(path).addresses == {"actor": ("h:7", "h:9")}
    assert beat.addresses == {"actor": ["h:7", "h:9"]}


def test_an_older_or_equal_version_is_ignored(tmp_path: Path) -> None:
    """A reply that was overtaken (its version not newer than the file's) changes nothing."""
    beat = heartbeat(tmp_path)
    beat._publish_addresses(reply(4, addresses={"actor": ["h:1"]}))
    beat._publish_addresses(reply(4, addresses={"actor": ["h:2"]}))
    beat._publish_addresses(reply(2, addresses={"actor": ["h:3"]}))
    assert read_published(addresses_file(tmp_path, "n0")).addresses == {"actor": ("h:1",)}
