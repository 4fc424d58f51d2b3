"""The CPU pool the jobs of one machine share: what a job may take and must give back (pure), the pool's file
(a grant taken in one transaction, a claim of a dead process dropped), and ``convoy preempt``'s bad input."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from convoy.cli.main import main
from convoy.control.pool.claims import Amount, Claim, PoolView, give_back, room_for
from convoy.control.pool.scheduler import PoolScheduler
from convoy.control.pool.store import PoolStore
from convoy.errors import ConfigError


def cpus(n: float) -> Amount:
    return Amount(n, 0.0)


FOUR_CPUS = Amount(4.0, 8e9)


def view(*claims: Claim, capacity: Amount = FOUR_CPUS) -> PoolView:
    return PoolView(capacity, claims)


def test_jobs_below_the_asker_give_back_down_to_their_floor_lowest_priority_first() -> None:
    pool = view(Claim("high", 10, wants=cpus(3.0)), Claim("low", 0, held=cpus(2.0), floor=cpus(0.5), since=1.0),
                Claim("mid", 5, held=cpus(2.0), floor=cpus(1.0), since=2.0))
    assert give_back(pool, "low") == cpus(1.5), "the lowest gives what it can above its floor"
    assert give_back(pool, "mid") == cpus(1.0), "then the next, for the rest of the deficit"
    assert give_back(pool, "high") == Amount()
    assert room_for(pool, "low", 0) == Amount(0.0, 8e9) and room_for(pool, "high", 10).cpus == 0.0


def test_no_one_gives_back_for_a_job_of_equal_or_lower_priority_or_when_there_is_room() -> None:
    nothing = Amount()
    assert give_back(view(Claim("a", 0, wants=cpus(3.0)), Claim("b", 0, held=cpus(4.0))), "b") == nothing
    assert give_back(view(Claim("a", 0, wants=cpus(3.0)), Claim("b", 1, held=cpus(4.0))), "b") == nothing
    assert give_back(view(Claim("a", 9, wants=cpus(1.0)), Claim("b", 0, held=cpus(2.0))), "b") == nothing, "2 are free"
    assert give_back(view(Claim("b", 0, held=cpus(2.0), wants=cpus(1.0)), Claim("a", 9, held=cpus(2.0))), "b") == \
        nothing, "a job's own wish to grow back is no reason to give back"


def test_memory_is_claimed_and_given_back_like_cpus() -> None:
    pool = view(Claim("high", 10, wants=Amount(0.0, 3e9)),
                Claim("low", 0, held=Amount(1.0, 7e9), floor=Amount(0.5, 2e9)), capacity=Amount(4.0, 8e9))
    assert give_back(pool, "low") == Amount(0.0, 2e9), "1 GB is free: 2 GB more, and no CPU, is owed"
    assert room_for(pool, "low", 0) == Amount(3.0, 0.0)


def test_among_equal_priorities_the_newest_claim_gives_first() -> None:
    pool = view(Claim("high", 10, wants=cpus(1.0)), Claim("old", 0, held=cpus(2.0), since=1.0),
                Claim("new", 0, held=cpus(2.0), since=2.0))
    assert (give_back(pool, "new"), give_back(pool, "old")) == (cpus(1.0), Amount())


def test_a_grant_is_taken_in_the_pool_at_once_and_a_dead_claim_is_dropped(tmp_path: Path) -> None:
    store = PoolStore(tmp_path / "pool.db", capacity=Amount(2.0, 4e9))
    first = PoolScheduler(store, "job1", 0)
    second = PoolScheduler(PoolStore(tmp_path / "pool.db", capacity=Amount(2.0, 4e9)), "job2", 0)
    assert first.take(cpus(1.5)) and not second.take(cpus(1.0)), "the second sees the first's grant, not a stale view"
    assert not second.take(Amount(0.5, 5e9)) and second.take(Amount(0.5, 1e9))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    store.put(Claim("gone", 0, held=cpus(2.0), pid=int(dead.stdout)))
    assert [claim.job_id for claim in store.view().claims] == ["job1", "job2"], "a dead process holds nothing"
    first.close()
    assert store.view().held == Amount(0.5, 1e9)


def test_preempt_refuses_more_than_the_pool_and_a_bad_count(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVOY_POOL", str(tmp_path / "pool.db"))
    monkeypatch.setenv("CONVOY_POOL_CPUS", "2")
    monkeypatch.setenv("CONVOY_POOL_MEMORY", "4GiB")
    assert main(["preempt", "--cpus", "3", "--priority", "5"]) == 2
    assert "--cpus 3 --memory 0 is more than the pool's 2 CPU(s) and 4.00 GiB" in capsys.readouterr().err
    assert main(["preempt", "--cpus", "1", "--memory", "5GiB", "--priority", "5"]) == 2
    assert "--cpus 1 --memory 5GiB is more than the pool's" in capsys.readouterr().err
    assert main(["preempt", "--cpus", "-1", "--priority", "5"]) == 2
    assert "--cpus -1: give a positive number of CPUs (or --memory)" in capsys.readouterr().err
    monkeypatch.setenv("CONVOY_POOL_CPUS", "lots")
    with pytest.raises(ConfigError, match="CONVOY_POOL_CPUS='lots': give the pool's CPUs as a positive number"):
        PoolStore(tmp_path / "other.db")


def test_preempt_takes_what_is_free_and_the_pool_lists_it_then_gives_it_back(tmp_path: Path) -> None:
    env = {**os.environ, "CONVOY_POOL": str(tmp_path / "pool.db"), "CONVOY_POOL_CPUS": "2",
           "CONVOY_POOL_MEMORY": "4GiB"}
    held = subprocess.Popen([sys.executable, "-m", "convoy", "preempt", "--cpus", "1.5", "--priority", "3"],
                            stdout=subprocess.PIPE, text=True, env=env)
    assert held.stdout is not None
    assert "asks for 1.5 CPU(s) at priority 3" in held.stdout.readline()
    line = held.stdout.readline()
    assert line.startswith("convoy preempt: 1.5 CPU(s) free after ") and line.endswith(" s (priority 3)\n"), line
    listed = subprocess.run([sys.executable, "-m", "convoy", "pool"], capture_output=True, text=True, env=env).stdout
    assert "2 CPU(s) and 4.00 GiB; 1.5 CPU(s) held, 0.5 CPU(s) and 4.00 GiB free" in listed, listed
    assert "priority 3    holds 1.5 CPU(s) (floor 1.5 CPU(s)), asks nothing more" in listed, listed
    timed_out = subprocess.run([sys.executable, "-m", "convoy", "preempt", "--cpus", "1", "--priority", "3",
                                "--timeout", "0.3"], capture_output=True, text=True, env=env)
    assert timed_out.returncode == 2, timed_out
    assert "only 0.5 CPU(s) of 1 CPU(s) free after 0.3 s: jobs of priority 3 or more hold the rest" in timed_out.stderr
    held.terminate()
    assert held.wait(timeout=10) == 0
    listed = subprocess.run([sys.executable, "-m", "convoy", "pool"], capture_output=True, text=True, env=env).stdout
    assert "nothing held, 2 CPU(s) and 4.00 GiB free" in listed and "no claims" in listed, listed
