"""An agent's call to a master that has exited after the job ended (the defect of stop 69's note: a role process's
exit reported in the job's last moments held the agent, and ``convoy run`` with it, for the client's whole 30 s of
retries). Once its heartbeat has heard the end, a call that cannot reach the master raises ``JobEndedError`` at once;
before that, the same call retries to its deadline, as a master that restarts needs."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from convoy.agent.agent import Agent
from convoy.agent.agent_config import AgentConfig
from convoy.config import WorkerConfig
from convoy.control.protocol import messages as p
from convoy.control.protocol.client import MasterClient
from convoy.errors import JobEndedError, MasterUnreachableError
from convoy.ports import free_port

REPORT = p.Ack()


def test_a_call_after_the_end_gives_up_at_once_and_one_before_it_retries_to_its_deadline() -> None:
    client = MasterClient("127.0.0.1", free_port("127.0.0.1"), "t" * 32, give_up_after_s=30.0)
    client.ended = lambda: True
    started = time.monotonic()
    with pytest.raises(JobEndedError, match="gone after the job ended"):
        client.call("/role_report", REPORT, p.Ack)
    assert time.monotonic() - started < 1.0

    client.ended, client.give_up_after_s = (lambda: False), 2.0
    started = time.monotonic()
    with pytest.raises(MasterUnreachableError) as raised:
        client.call("/role_report", REPORT, p.Ack)
    assert not isinstance(raised.value, JobEndedError)
    assert time.monotonic() - started >= 0.5  # it stops once its next pause (at most 1.5 s) would pass 2 s


def test_the_agent_stops_retrying_once_its_heartbeat_has_heard_the_end(tmp_path: Path) -> None:
    config = AgentConfig(master_host="127.0.0.1", master_port=free_port("127.0.0.1"), token="t" * 32, node_id="n0",
                         host="127.0.0.1", run_dir=tmp_path, workers=WorkerConfig(entrypoint="x.py"), roles=True)
    agent = Agent(config)
    try:
        assert not agent.client.ended()
        agent.heartbeat.latest = p.HeartbeatResponse(job_status="running", round_id=1)
        assert not agent.client.ended()
        agent.heartbeat.latest = p.HeartbeatResponse(job_status="failed", round_id=1)
        started = time.monotonic()
        with pytest.raises(JobEndedError):
            agent.client.call("/role_report", REPORT, p.Ack)
        assert time.monotonic() - started < 1.0
    finally:
        agent.group.close()
