"""A burst of changes a restarted master recovers without its state file (process starts, repeated joins) is
written in a few transactions, not one each (issue 54: at 4096 role processes, a write per start held the master's
lock for seconds): such a change within ``WRITE_DEFER_S`` of a write waits for the next one, and the master's tick
writes it within ``TICK_S``; a stopping master writes what is owed."""

from __future__ import annotations

import time
from pathlib import Path

from convoy.control.job import Event, Job
from convoy.control.rendezvous import Rendezvous
from convoy.control.store import WRITE_DEFER_S, Store, read_status

from test_master_resume_join import join, start_master


def kinds(run_dir: Path) -> list[str]:
    return [event["kind"] for event in read_status(run_dir, recent=100)["events"]]


def test_a_change_right_after_a_write_waits_for_the_next_and_keeps_its_order(tmp_path: Path) -> None:
    store = Store(tmp_path)
    try:
        job = Job("feedbeef", Rendezvous(2, 2, 0.0, opened_at=0.0), max_restarts=3, join_timeout_s=60.0)
        assert not store.may_defer()  # nothing written yet
        store.save(job, [Event("master_started", "up")], "127.0.0.1:1", [])
        assert store.may_defer() and not store.write_owed
        store.defer([Event("one", "first"), Event("two", "second")])
        assert store.write_owed and kinds(tmp_path) == ["master_started"]
        store.save(job, [Event("three", "third")], "127.0.0.1:1", [])
        assert kinds(tmp_path) == ["master_started", "one", "two", "three"] and not store.write_owed
        time.sleep(WRITE_DEFER_S * 1.5)
        assert not store.may_defer()  # the last write is too old: the next lazy change is written at once
    finally:
        store.close()


def test_the_master_writes_a_deferred_change_at_its_tick_or_at_the_latest_at_its_stop(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    master = start_master(run_dir)
    try:
        join(master, "a", "agent-a")  # waits for a second node: decides nothing, may wait for a write
        join(master, "a", "agent-a")  # the same agent again: a repeated join
        began = time.monotonic()
        while master.store.write_owed and time.monotonic() - began < 5.0:
            time.sleep(0.02)
        assert not master.store.write_owed and time.monotonic() - began < 1.0  # the tick wrote it (TICK_S: 0.1 s)
        assert kinds(run_dir) == ["master_started", "node_joined", "node_joined"]  # both, in order
        with master._changed:  # a change deferred just now, with no tick before the stop
            master.store._written_at = time.monotonic()
            master._apply([Event("late", "deferred at the stop")], lazy_parts=True)
            assert master.store.write_owed
        master._stopping.set()  # the ticker ends (unless it is writing it now): the stop writes it
    finally:
        master.stop()
    assert kinds(run_dir)[-1] == "late"
