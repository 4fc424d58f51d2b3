"""A master rebuilt from its state file tells a join it never answered (the agent repeats it) from an agent that
restarted: the first keeps the node's place in the running round, the second restarts the job."""

from __future__ import annotations

from pathlib import Path

from convoy.config import MasterConfig, RendezvousConfig
from convoy.control.master import JobMaster
from convoy.control.protocol import messages as p
from convoy.control.protocol.client import MasterClient
from convoy.control.store import read_status


def start_master(run_dir: Path, resume: bool = False) -> JobMaster:
    config = MasterConfig(host="127.0.0.1", port=0, run_dir=run_dir, rendezvous=RendezvousConfig(2, 2, 0, 60))
    config.validate(resume=resume)
    master = JobMaster(config, console=lambda line: None, resume=resume)
    master.start()
    return master


def join(master: JobMaster, node_id: str, instance: str) -> p.JoinResponse:
    host, port = master.api.address
    client = MasterClient(host, port, master.token, 5.0)
    try:
        return client.call("/join", p.JoinRequest(node_id=node_id, host="127.0.0.1", nproc=1, port=29500,
                                                  instance=instance), p.JoinResponse)
    finally:
        client.close()


def a_round_of_two_then_the_master_rebuilt(run_dir: Path) -> JobMaster:
    first = start_master(run_dir)
    try:
        assert join(first, "a", "agent-a").round_id == 1
        assert join(first, "b", "agent-b").round_id == 1
        assert first.job.membership is not None and first.job.membership.round_id == 1
    finally:
        first.stop()  # as a SIGKILL would leave it: the state file holds the closed round
    return start_master(run_dir, resume=True)


def test_a_join_repeated_by_the_same_agent_keeps_its_place_in_the_running_round(tmp_path: Path) -> None:
    master = a_round_of_two_then_the_master_rebuilt(tmp_path / "run")
    try:
        assert join(master, "b", "agent-b").round_id == 1
        assert master.job.restart_count == 0 and master.job.round_id == 1
        assert master.job.membership is not None and master.job.membership.node_ids() == {"a", "b"}
    finally:
        master.stop()
    kinds = [e["kind"] for e in read_status(tmp_path / "run", recent=100)["events"]]
    assert "join_repeated" in kinds and "restart" not in " ".join(kinds)


def test_a_join_by_a_restarted_agent_of_a_member_restarts_the_job(tmp_path: Path) -> None:
    master = a_round_of_two_then_the_master_rebuilt(tmp_path / "run")
    try:
        master.nodes.nodes["b"].last_seen -= 60  # the old agent stopped checking in: its node id is free
        assert join(master, "b", "agent-b-relaunched").round_id == 2
        assert master.job.restart_count == 1
    finally:
        master.stop()
    messages = [e["message"] for e in read_status(tmp_path / "run", recent=100)["events"]]
    assert any("node b rejoined while its round was running" in m for m in messages), messages
