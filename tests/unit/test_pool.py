"""The CPU pool the jobs of one machine share: what a job may take and must give back (pure), the pool's file
(a grant taken in one transaction, a claim of a dead process dropped), and ``convoy preempt``'s bad input."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from convoy.cli.main import main
from convoy.control.pool.claims import Claim, PoolView, give_back, room_for
from convoy.control.pool.scheduler import PoolScheduler
from convoy.control.pool.store import PoolStore
from convoy.errors import ConfigError


def view(*claims: Claim, capacity: float = 4.0) -> PoolView:
    return PoolView(capacity, claims)


def test_jobs_below_the_asker_give_back_down_to_their_floor_lowest_priority_first() -> None:
    pool = view(Claim("high", 10, wants=3.0), Claim("low", 0, held=2.0, floor=0.5, since=1.0),
                Claim("mid", 5, held=2.0, floor=1.0, since=2.0))
    assert give_back(pool, "low") == 1.5, "the lowest gives what it can above its floor"
    assert give_back(pool, "mid") == 1.0, "then the next, for the rest of the deficit"
    assert give_back(pool, "high") == 0.0
    assert room_for(pool, "low", 0) == 0.0 and room_for(pool, "high", 10) == 0.0


def test_no_one_gives_back_for_a_job_of_equal_or_lower_priority_or_when_there_is_room() -> None:
    assert give_back(view(Claim("a", 0, wants=3.0), Claim("b", 0, held=4.0)), "b") == 0.0
    assert give_back(view(Claim("a", 0, wants=3.0), Claim("b", 1, held=4.0)), "b") == 0.0
    assert give_back(view(Claim("a", 9, wants=1.0), Claim("b", 0, held=2.0)), "b") == 0.0, "2 CPUs are free"
    assert give_back(view(Claim("b", 0, held=2.0, wants=1.0), Claim("a", 9, held=2.0)), "b") == 0.0, \
        "a job's own wish to grow back is no reason to give back"


def test_among_equal_priorities_the_newest_claim_gives_first() -> None:
    pool = view(Claim("high", 10, wants=1.0), Claim("old", 0, held=2.0, since=1.0),
                Claim("new", 0, held=2.0, since=2.0))
    assert (give_back(pool, "new"), give_back(pool, "old")) == (1.0, 0.0)


def test_a_grant_is_taken_in_the_pool_at_once_and_a_dead_claim_is_dropped(tmp_path: Path) -> None:
    store = PoolStore(tmp_path / "pool.db", capacity=2.0)
    first = PoolScheduler(store, "job1", 0)
    second = PoolScheduler(PoolStore(tmp_path / "pool.db", capacity=2.0), "job2", 0)
    assert first.take(1.5) and not second.take(1.0), "the second job sees the first's grant, not a stale view"
    assert second.take(0.5)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    store.put(Claim("gone", 0, held=2.0, pid=int(dead.stdout)))
    assert [claim.job_id for claim in store.view().claims] == ["job1", "job2"], "a dead process holds nothing"
    first.close()
    assert store.view().held == 0.5


def test_preempt_refuses_more_than_the_pool_and_a_bad_count(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVOY_POOL", str(tmp_path / "pool.db"))
    monkeypatch.setenv("CONVOY_POOL_CPUS", "2")
    assert main(["preempt", "--cpus", "3", "--priority", "5"]) == 2
    assert "--cpus 3 is more than the pool's 2 CPU(s)" in capsys.readouterr().err
    assert main(["preempt", "--cpus", "-1", "--priority", "5"]) == 2
    assert "--cpus -1: give a positive number of CPUs" in capsys.readouterr().err
    monkeypatch.setenv("CONVOY_POOL_CPUS", "lots")
    with pytest.raises(ConfigError, match="CONVOY_POOL_CPUS='lots': give the pool's CPUs as a positive number"):
        PoolStore(tmp_path / "other.db")


def test_preempt_takes_what_is_free_and_the_pool_lists_it_then_gives_it_back(tmp_path: Path) -> None:
    env = {**os.environ, "CONVOY_POOL": str(tmp_path / "pool.db"), "CONVOY_POOL_CPUS": "2"}
    held = subprocess.Popen([sys.executable, "-m", "convoy", "preempt", "--cpus", "1.5", "--priority", "3"],
                            stdout=subprocess.PIPE, text=True, env=env)
    assert held.stdout is not None
    assert "asks for 1.5 CPU(s) at priority 3" in held.stdout.readline()
    line = held.stdout.readline()
    assert line.startswith("convoy preempt: 1.5 CPU(s) free after ") and line.endswith(" s (priority 3)\n"), line
    listed = subprocess.run([sys.executable, "-m", "convoy", "pool"], capture_output=True, text=True, env=env).stdout
    assert "2 CPU(s), 1.5 held, 0.5 free" in listed and "priority 3    holds 1.5 CPU(s)" in listed, listed
    timed_out = subprocess.run([sys.executable, "-m", "convoy", "preempt", "--cpus", "1", "--priority", "3",
                                "--timeout", "0.3"], capture_output=True, text=True, env=env)
    assert timed_out.returncode == 2, timed_out
    assert "only 0.5 of 1 CPU(s) free after 0.3 s: jobs of priority 3 or more hold the rest" in timed_out.stderr
    held.terminate()
    assert held.wait(timeout=10) == 0
    listed = subprocess.run([sys.executable, "-m", "convoy", "pool"], capture_output=True, text=True, env=env).stdout
    assert "0 held, 2 free" in listed and "no claims" in listed, listed
