"""A full run-dir disk: the master answers 503 and keeps going in memory, writes what it kept once
space returns, fails the job with one line if it never does; a worker's log pump drops lines
instead of blocking the worker; ``convoy run`` refuses a full run dir. Real processes, real tmpfs."""

from __future__ import annotations

import http.client
import json
import re
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest
from helpers import JOB_TIMEOUT_S, Launched, ProcessScope, fixture, one_error_line, wait_for

from convoy.control.protocol import messages as p
from convoy.control.store import read_status

pytestmark = pytest.mark.slow


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MB tmpfs of the test's own, unmounted at the end."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill (needs root): {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)


def fill(disk: Path) -> Path:
    """Write a file until the disk has no room left; delete it to give the space back."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as handle:
        try:
            while True:
                handle.write(b"\0" * 65536)
        except OSError:
            pass
        try:
            while True:
                handle.write(b"\0" * 512)
        except OSError:
            return filler


def post(port: int, token: str, path: str, body: p.BaseModel, key: str) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", p.API_PREFIX + path, body=body.model_dump_json().encode(),
                     headers={p.TOKEN_HEADER: f"Bearer {token}", p.IDEMPOTENCY_HEADER: key})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def start_master(procs: ProcessScope, run_dir: Path, *options: object) -> tuple[Launched, int, str]:
    master = procs.start(["master", "--host", "127.0.0.1", "--port", "0", "--nnodes", "2", "--run-dir", run_dir,
                          *options])
    port = int(master.wait_output(r"master of job \w+ at 127\.0\.0\.1:(\d+)").group(1))
    return master, port, (run_dir / "token").read_text().strip()


def test_master_answers_503_on_a_full_disk_and_records_what_it_kept_once_space_returns(
        procs: ProcessScope, small_disk: Path) -> None:
    run_dir = small_disk / "run"
    master, port, token = start_master(procs, run_dir)
    filler = fill(small_disk)
    join_a = p.JoinRequest(node_id="a", host="10.0.0.1", nproc=1, port=1111)
    status, reply = post(port, token, "/join", join_a, "a-1")
    assert status == 503 and re.search(r"state .* cannot be written: .*(disk is full|No space left)", reply["error"])
    status, _ = post(port, token, "/join", p.JoinRequest(node_id="b", host="10.0.0.2", nproc=1, port=2222), "b-1")
    assert status == 503
    assert post(port, token, "/join", join_a, "a-1")[0] == 503, "a retry is answered 503 until the state is written"
    master.wait_output(r"convoy: round 1: 2 nodes", timeout=10)  # the job goes on in memory and says so
    assert re.search(r"convoy: the job.s state in .* cannot be written: .*; the job goes on in memory", master.stdout())

    filler.unlink()
    status, reply = wait_for(lambda: (lambda r: r if r[0] == 200 else None)(post(port, token, "/join", join_a, "a-1")),
                             10.0, "the retried join to be answered once space is back")
    assert reply == {"job_id": reply["job_id"], "round_id": 1}, "the first call's answer: handled once"
    events = read_status(run_dir, recent=100)["events"]
    kinds = [e["kind"] for e in events]
    assert kinds[:4] == ["master_started", "node_joined", "node_joined", "round_closed"], kinds
    assert "state_written" in kinds and "restart" not in kinds
    assert re.search(r"convoy: the job's state is written again", master.stdout())
    post(port, token, "/abort", p.AbortRequest(reason="test over"), "x-1")
    assert master.wait(JOB_TIMEOUT_S).returncode == 1


def test_a_disk_that_stays_full_fails_the_job_with_one_line(procs: ProcessScope, small_disk: Path) -> None:
    run_dir = small_disk / "run"
    master, port, token = start_master(procs, run_dir, "--heartbeat-timeout", "2")
    fill(small_disk)
    post(port, token, "/join", p.JoinRequest(node_id="a", host="10.0.0.1", nproc=1, port=1111), "a-1")
    result = master.wait(30.0)
    assert result.returncode == 1, result.explain()
    failed = [line for line in result.stdout.splitlines() if "job failed" in line]
    assert len(failed) == 1 and "cannot be written" in failed[0] and "free space" in failed[0], result.explain()


def test_convoy_run_on_a_full_run_dir_is_one_error_line_and_leaves_no_token(procs: ProcessScope,
                                                                          small_disk: Path) -> None:
    fill(small_disk)
    run_dir = small_disk / "run"
    result = procs.run(["run", "--preload", "", "--run-dir", run_dir, fixture("worker.py")], timeout=30)
    line = one_error_line(result)
    assert "run dir" in line and "No space left on device" in line, line
    assert not (run_dir / "token").exists()


def test_a_worker_that_prints_into_a_full_disk_finishes(procs: ProcessScope, small_disk: Path,
                                                        tmp_path: Path) -> None:
    run_dir, go, done = small_disk / "run", tmp_path / "go", tmp_path / "done"
    job = procs.start(["run", "--nnodes", "1", "--nproc-per-node", "1", "--preload", "", "--stop-grace", "1",
                       "--run-dir", run_dir, fixture("full_disk_printer.py"), go, done, 40000])
    job.wait_output(r"printer rank 0 waiting")
    filler = fill(small_disk)
    go.write_text("")
    wait_for(done.exists, 30.0, "the worker to print everything into a full disk")
    assert re.search(r"\[rank0\]: convoy: cannot write to .*rank0\.log .*dropping", job.stdout()), job.stdout()[-2000:]
    filler.unlink()
    result = job.wait(JOB_TIMEOUT_S)
    assert result.returncode == 0, result.explain()[-3000:]
    assert "convoy: job succeeded" in result.stdout
    assert re.search(r"\[rank0\]: convoy: .*\d+ lines? not written to .*rank0\.log", result.stdout) or \
        re.search(r"dropped \d+ lines", result.stdout), result.stdout[-2000:]


def test_convoy_run_on_a_disk_that_stays_full_ends_and_says_what_was_not_written(
        procs: ProcessScope, small_disk: Path, tmp_path: Path) -> None:
    run_dir, go, done = small_disk / "run", tmp_path / "go", tmp_path / "done"
    job = procs.start(["run", "--nnodes", "1", "--nproc-per-node", "1", "--preload", "", "--stop-grace", "1",
                       "--heartbeat-timeout", "4", "--run-dir", run_dir, fixture("full_disk_printer.py"), go, done,
                       100])
    job.wait_output(r"printer rank 0 waiting")
    fill(small_disk)
    go.write_text("")
    result = job.wait(60.0)
    assert result.returncode == 0, result.explain()
    assert "convoy: job succeeded: all 1 workers finished" in result.stdout, "in memory the job went on"
    assert re.search(r"convoy: \d+ events of the job could not be written to .*state\.db", result.stdout)


def test_events_kept_while_the_disk_is_full_are_bounded_written_in_order_and_the_rest_counted(
        small_disk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from convoy.control import store as store_module
    from convoy.control.job import Event, Job
    from convoy.control.rendezvous import Rendezvous
    from convoy.errors import StateWriteError

    monkeypatch.setattr(store_module, "MAX_PENDING_EVENTS", 3)
    store = store_module.Store(small_disk)
    job = Job("feedbeef", Rendezvous(1, 1, 0.0, opened_at=0.0), max_restarts=3, join_timeout_s=60.0)
    try:
        store.save(job, [Event("master_started", "up")], "127.0.0.1:1", [])
        filler = fill(small_disk)
        for index in range(5):
            with pytest.raises(StateWriteError, match="cannot be written"):
                store.save(job, [Event("chatter", f"event {index}")], "127.0.0.1:1", [])
        assert store.pending == 3 and store.lost_events == 2
        filler.unlink()
        note = store.save(job, [], "127.0.0.1:1", [])
        assert note is not None and "3 events kept in memory" in note and "2 older ones were lost" in note
        assert store.pending == 0 and store.failing_since is None
    finally:
        store.close()
    events = [(e["kind"], e["message"]) for e in read_status(small_disk, recent=100)["events"]]
    assert events[:4] == [("master_started", "up"), ("chatter", "event 2"), ("chatter", "event 3"),
                          ("chatter", "event 4")], "the newest are kept, in order"
    assert events[4][0] == "state_written" and "2 older ones were lost" in events[4][1]


def test_rounds_that_closed_while_the_disk_was_full_are_recorded(small_disk: Path) -> None:
    from convoy.control.job import Job
    from convoy.control.protocol.messages import WorkerExit
    from convoy.control.rendezvous import Rendezvous
    from convoy.control.store import Store
    from convoy.errors import StateWriteError

    store = Store(small_disk)
    job = Job("feedbeef", Rendezvous(1, 1, 0.0, opened_at=0.0), max_restarts=3, join_timeout_s=60.0)
    try:
        store.save(job, [], "127.0.0.1:1", [])
        filler = fill(small_disk)
        for now in (1.0, 3.0):
            _, events = job.join("n0", "10.0.0.1", 1, 1000 + int(now), now)
            with pytest.raises(StateWriteError):
                store.save(job, events, "127.0.0.1:1", [])
            if now == 1.0:
                report = WorkerExit(node_id="n0", round_id=1, rank=0, local_rank=0, exitcode=1)
                with pytest.raises(StateWriteError):
                    store.save(job, job.worker_exited(report, now + 1.0), "127.0.0.1:1", [])
        filler.unlink()
        store.save(job, [], "127.0.0.1:1", [])
    finally:
        store.close()
    import sqlite3
    db = sqlite3.connect(small_disk / "state.db")
    ports = db.execute("SELECT round_id, master_port FROM rounds ORDER BY round_id").fetchall()
    db.close()
    assert ports == [(1, 1001), (2, 1003)]
