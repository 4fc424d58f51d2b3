"""The round lease's expiry and its watcher, against a real lease file written by the agent's LeaseWriter."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from convoy.worker.lease import Lease, LeaseWriter, lease_clock, own_round, read_lease
from convoy.worker.lease_watch import POLL_S, LeaseWatch, expiry_line, next_read_in, watch_lease


@pytest.fixture
def lease(tmp_path: Path) -> Iterator[LeaseWriter]:
    writer = LeaseWriter(tmp_path / "lease")
    yield writer
    writer.close()


def test_a_grant_is_valid_for_writes_until_the_margin_and_expires_a_term_after_the_answer(lease: LeaseWriter) -> None:
    sent_at = time.monotonic() - 2.0  # the answered request left 2 s ago (a long poll), timed as the agent does
    before = lease_clock()
    lease.grant(7, sent_at, 10.0)
    after = lease_clock()
    read = read_lease(lease.path)
    assert read is not None and read.round_id == 7
    assert before - 2.0 + 8.0 - 0.01 <= read.valid_until <= after - 2.0 + 8.0 + 0.01, "sent at + 80% of the term"
    assert before + 10.0 <= read.expires_at <= after + 10.0, "a term from the answer, not from the request"



def test_expiry_is_decided_by_round_and_time() -> None:
    granted = Lease(3, valid_until=100.0, expires_at=102.0)
    assert not granted.expired(3, 101.9) and granted.expired(3, 102.0)
    assert not granted.expired(4, 500.0), "another round's lease never stops this process: the agent does"
    assert not Lease(0, 0.0, 0.0).expired(3, 500.0), "a revoked lease: the agent ended the round and stops it"
    assert granted.expired(None, 102.0) and not Lease(0, 0.0, 0.0).expired(None, 500.0), "a role process: any round"


def test_the_watcher_reads_again_at_the_expiry_or_within_a_poll() -> None:
    granted = Lease(3, valid_until=100.0, expires_at=102.0)
    assert next_read_in(granted, 3, 101.5) == pytest.approx(0.5)
    assert next_read_in(granted, 3, 90.0) == POLL_S, "a lease re-granted shorter is seen within a poll"
    assert next_read_in(granted, 3, 102.5) == 0.0
    assert next_read_in(None, 3, 0.0) is None and next_read_in(Lease(0, 0.0), 3, 0.0) is None
    assert next_read_in(granted, 2, 0.0) is None


def test_a_record_that_does_not_check_out_reads_as_revoked(lease: LeaseWriter) -> None:
    lease.grant(3, time.monotonic(), 30.0)
    data = bytearray(lease.path.read_bytes())
    data[-1] ^= 0xFF  # the checksum no longer matches (as a read torn by a rewrite would, were it to last)
    lease.path.write_bytes(bytes(data))
    assert read_lease(lease.path) == Lease(0, 0.0)


def test_own_round_is_none_for_a_process_that_lives_across_rounds() -> None:
    assert own_round({"CONVOY_ROUND": "4"}) == 4
    assert own_round({}) is None


def test_no_lease_no_watcher() -> None:
    assert watch_lease({"CONVOY_ROUND": "1"}) is None
    assert not [t for t in threading.enumerate() if t.name == "convoy-lease-watch"]


def _watch(lease: LeaseWriter, round_id: int | None) -> tuple[LeaseWatch, list[str], threading.Event]:
    said: list[str] = []
    fired = threading.Event()

    def on_expiry(line: str) -> None:
        said.append(line)
        fired.set()

    return LeaseWatch(str(lease.path), round_id, on_expiry, pid=4242).start(), said, fired


def test_an_expired_lease_stops_the_process_with_one_line_saying_why(lease: LeaseWriter) -> None:
    lease.grant(3, time.monotonic(), 60.0)
    watch, said, fired = _watch(lease, 3)
    assert watch.thread.is_alive() and not fired.is_set(), "a lease renewed a term ahead is held"
    lease.grant(3, time.monotonic() - 60.0, 0.05)  # the agent stopped renewing: its last term runs out
    assert fired.wait(10.0), "the watcher did not act on the expired lease"
    watch.thread.join(10.0)
    assert len(said) == 1 and said[0].startswith("convoy: round 3's lease expired ")
    assert "heard nothing from the master for a whole heartbeat timeout" in said[0]
    assert said[0].endswith("stopping process 4242 now (exit code 75)")


def test_a_revoked_lease_ends_the_watch_without_stopping(lease: LeaseWriter) -> None:
    lease.grant(3, time.monotonic(), 60.0)
    watch, said, _ = _watch(lease, 3)
    lease.revoke()  # the agent ended the round: it stops the process itself (SIGTERM, its grace)
    watch.thread.join(10.0)
    assert not watch.thread.is_alive() and said == []


def test_a_stopped_watch_says_nothing(lease: LeaseWriter) -> None:
    lease.grant(3, time.monotonic(), 60.0)
    watch, said, _ = _watch(lease, 3)
    watch.stop()
    watch.thread.join(10.0)
    assert not watch.thread.is_alive() and said == []


def test_expiry_line_for_a_role_process() -> None:
    line = expiry_line(Lease(5, 1.0, 2.0), None, 2.5, os.getpid(), "SIGKILL")
    assert line.startswith("convoy: the job's lease expired 0.5 s ago") and line.endswith("now (SIGKILL)")
