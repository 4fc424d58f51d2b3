"""A worker of an ended round never writes state: a stopped agent's workers are fenced by the
round lease, stop themselves once it has expired, and the readmitted node resumes where the job is.

Also: what workers record with ``convoy.worker.events.emit`` reaches the job's events.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import time
from pathlib import Path

import pytest
from helpers import ProcessScope, fixture, gone, wait_for

from convoy.worker.lease import read_lease

pytestmark = pytest.mark.slow

FENCED = fixture("fenced_train.py")
HEARTBEAT_TIMEOUT_S = 4.0


def lines(run_dir: Path, round_id: int, rank: int) -> list[dict]:
    path = run_dir / "logs" / f"round{round_id}" / f"rank{rank}.log"
    if not path.exists():
        return []
    found = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                found.append(json.loads(line))
            except ValueError:
                continue
    return found


def events(run_dir: Path) -> list[tuple[float, str, str]]:
    db = sqlite3.connect(f"file:{run_dir / 'state.db'}?mode=ro", uri=True)
    try:
        return db.execute("SELECT ts, kind, message FROM events ORDER BY id").fetchall()
    finally:
        db.close()


def _readmitted(run_dir: Path) -> bool:
    """Both ranks have trained a step in a round after the one without the node (round 3 on)."""
    rounds = [int(p.name.removeprefix("round")) for p in (run_dir / "logs").iterdir() if p.name.startswith("round")]
    return any(all(any("step" in s for s in lines(run_dir, round_id, rank)) for rank in (0, 1))
               for round_id in rounds if round_id >= 3)


def test_a_stopped_agents_worker_stops_itself_once_its_lease_expires(procs: ProcessScope, tmp_path: Path) -> None:
    """Its agent SIGSTOPped past the heartbeat timeout, the worker commits nothing once its lease lapsed and stops
    itself (one line) once it expired, while the agent is still stopped: it used to train on until the agent woke
    and killed it."""
    run_dir = tmp_path / "run"
    job = procs.start(["run", "--nnodes", "1:2", "--nproc-per-node", 1, "--rdzv-wait", 5, "--stop-grace", 1,
                       "--heartbeat-timeout", HEARTBEAT_TIMEOUT_S, "--run-dir", run_dir,
                       FENCED, "--steps", 100000, "--until", tmp_path / "end", "--sleep", 0.05])
    wait_for(lambda: len([s for s in lines(run_dir, 1, 1) if "step" in s]) >= 10, 90, "rank 1 to train 10 steps")
    started = next(s for s in lines(run_dir, 1, 1) if "agent" in s)
    agent, worker = started["agent"], started["pid"]
    os.kill(agent, signal.SIGSTOP)
    stopped_at = time.time()
    try:
        wait_for(lambda: gone(worker), 30, "the stopped agent's worker to stop itself")
        lease = read_lease(started["lease"])  # as the stopped agent left it
        wait_for(lambda: any(kind == "regroup" and "sent no heartbeat" in message
                             for _, kind, message in events(run_dir)), 30, "the stopped node to be declared lost")
        lost_at = next(ts for ts, kind, message in events(run_dir) if kind == "regroup" and "sent no heartbeat" in message)
        wait_for(lambda: [s for s in lines(run_dir, 2, 0) if "step" in s], 60, "the job to go on without the node")
    finally:
        os.kill(agent, signal.SIGCONT)
    wait_for(lambda: _readmitted(run_dir), 60, "the node to be readmitted and both ranks to train in that round")
    (tmp_path / "end").touch()  # the steps were a clock: the job ends after the ranks' next step
    result = job.wait(timeout=90)
    assert result.returncode == 0, result.explain()

    stale = [s for s in lines(run_dir, 1, 1) if "step" in s]
    committed = [s for s in stale if not s["refused"]]
    assert committed and committed[-1]["t"] < lost_at, "no step is committed once the node may be declared lost"
    lapsed = [s for s in stale if s["asked"] > lease.valid_until]
    assert lapsed and all("lease_lapsed" in s["refused"] for s in lapsed), lapsed[:3]
    past_expiry = [s["step"] for s in stale if s["mono"] > lease.expires_at]
    assert len(past_expiry) <= 2, f"{len(past_expiry)} steps after the lease expired (the one under way at most)"
    log = (run_dir / "logs" / "round1" / "rank1.log").read_text()
    said = [line for line in log.splitlines() if "lease expired" in line]
    assert len(said) == 1 and said[0].startswith("convoy: round 1's lease expired") and \
        f"stopping process {worker} now (exit code 75)" in said[0], log[-2000:]
    assert lost_at - stopped_at >= HEARTBEAT_TIMEOUT_S - 1.0

    # the node is readmitted: its snapshot holds only steps it committed before the loss, and it
    # resumes at the step the job reached
    last_round = max(int(p.name.removeprefix("round")) for p in (run_dir / "logs").iterdir())
    assert last_round >= 3, "lost (round 2 without the node), then readmitted (round 3)"
    rejoined = lines(run_dir, last_round, 1)
    holds = next(s["holds"] for s in rejoined if "holds" in s)
    assert holds and max(holds) <= committed[-1]["step"], (holds, committed[-1])
    resumed = {rank: next(s for s in lines(run_dir, last_round, rank) if "resumed" in s) for rank in (0, 1)}
    assert resumed[1]["resumed"] == resumed[0]["resumed"], resumed
    # rank 0 resumes after the newest step it holds whole. Stopped (SIGTERM) at the end of round 2, that is
    # the last step it committed (not one the fence refused once the round ended: a copy in flight lands
    # first, so its state, which no peer shares, needs no step redone); or the one after, when the stop came
    # between ``ckpt.step()`` returning and the step's line being printed
    own = next(s["holds"] for s in lines(run_dir, last_round, 0) if "holds" in s)
    before = [s for s in lines(run_dir, last_round - 1, 0) if "step" in s and not s["refused"]]
    assert own and resumed[0]["resumed"] == max(own) + 1, (resumed[0], own)
    assert before[-1]["step"] <= max(own) <= before[-1]["step"] + 1, (own, before[-1])
    assert procs.wait_no_leftovers(timeout=10) == []


def test_events_a_worker_emits_are_recorded_by_the_master(procs: ProcessScope, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    script = tmp_path / "emit.py"
    script.write_text("import os\nfrom convoy.worker.events import emit\n"
                      "emit('data_skew', 'shard ' + os.environ['RANK'] + ' is 3x the others')\n"
                      "print('convoy-event {not json', flush=True)\n")
    result = procs.run(["run", "--nnodes", 1, "--nproc-per-node", 2, "--preload", "", "--run-dir", run_dir, script])
    assert result.returncode == 0, result.explain()
    recorded = [message for _, kind, message in events(run_dir) if kind == "data_skew"]
    assert sorted(recorded) == ["rank 0: shard 0 is 3x the others", "rank 1: shard 1 is 3x the others"]
