"""The round fence's decision against a real lease file written by the agent's LeaseWriter."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

import pytest

from convoy.runtime.fence import RoundFence
from convoy.worker import events as worker_events
from convoy.worker.lease import LeaseWriter


@pytest.fixture
def lease(tmp_path: Path) -> Iterator[LeaseWriter]:
    writer = LeaseWriter(tmp_path / "lease")
    yield writer
    writer.close()


def _events(err: str) -> list[tuple[str, str]]:
    return [event for line in err.splitlines() if (event := worker_events.parse(line))]


def test_no_lease_means_no_agent_and_every_commit_is_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CONVOY_LEASE", raising=False)
    said: list[str] = []
    assert RoundFence(said.append, round_id=3).allows("snapshot of step 1") and not said


def test_granted_lease_of_this_round_allows(lease: LeaseWriter) -> None:
    lease.grant(3, time.monotonic(), 30.0)
    said: list[str] = []
    assert RoundFence(said.append, lease.path, 3).allows("snapshot of step 1") and not said


def test_lapsed_lease_refuses_once_until_renewed(lease: LeaseWriter, capsys: pytest.CaptureFixture[str]) -> None:
    lease.grant(3, time.monotonic() - 100.0, 30.0)  # the master last heard this node 100 s ago
    said: list[str] = []
    fence = RoundFence(said.append, lease.path, 3)
    assert not fence.allows("step 7") and not fence.allows("step 8")
    assert len(said) == 1 and said[0].startswith("round lease lapsed") and "not committing step 7 until" in said[0]
    assert [kind for kind, _ in _events(capsys.readouterr().err)] == ["lease_lapsed"]
    lease.grant(3, time.monotonic(), 30.0)
    assert fence.allows("step 9")


@pytest.mark.parametrize("ended", ["revoked", "other round"])
def test_revoked_or_other_round_refuses_as_stale(lease: LeaseWriter, capsys: pytest.CaptureFixture[str],
                                                 ended: str) -> None:
    if ended == "revoked":
        lease.grant(3, time.monotonic(), 30.0)
        lease.revoke()
    else:
        lease.grant(4, time.monotonic(), 30.0)
    said: list[str] = []
    fence = RoundFence(said.append, lease.path, 3)
    assert not fence.allows("snapshot of step 5") and not fence.allows("snapshot of step 6")
    assert said == ["round 3 is no longer current: snapshot of step 5 not committed; the agent will stop this worker"]
    assert [kind for kind, _ in _events(capsys.readouterr().err)] == ["stale_round"]


def test_removed_lease_file_reads_as_ended(lease: LeaseWriter) -> None:
    lease.grant(3, time.monotonic(), 30.0)
    fence = RoundFence(lambda message: None, lease.path, 3)
    lease.close()  # the agent removed it: its round is over
    assert not fence.allows("snapshot of step 1") and "stale_round" in fence.refused


def test_a_process_of_no_round_is_fenced_by_whichever_round_is_current(lease: LeaseWriter,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CONVOY_ROUND", raising=False)  # a role process lives across its job's rounds
    lease.grant(5, time.monotonic(), 30.0)
    said: list[str] = []
    fence = RoundFence(said.append, lease.path)
    assert fence.round_id is None and fence.allows("snapshot of step 1")
    lease.grant(6, time.monotonic(), 30.0)  # a node joined: a new round, the process goes on
    assert fence.allows("snapshot of step 2")
    lease.revoke()
    assert not fence.allows("snapshot of step 3")
    assert said == ["this node runs no round of the job any more: snapshot of step 3 not committed; the agent "
                    "will stop this worker"]
