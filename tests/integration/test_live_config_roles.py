"""The live training config in a job of roles, end to end: a hot field switches each role at a step planned from
its own pace, a worker scaled away no longer counts, and a restart field restarts the processes of the roles
that declared the config (from the step before it, none lost or redone, no role restart spent)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import ProcessScope, fixture, wait_for

from convoy.control.store import read_status

pytestmark = pytest.mark.slow
SCRIPT = fixture("live_roles_train.py")
Row = tuple[int, float, int, int]


def logs(log_dir: Path) -> dict[str, list[Row]]:
    """Each process's ``(step, lr, batch_size, incarnation)`` lines, by ``worker0``, ``learner0``, ..."""
    out = {}
    for path in sorted(log_dir.glob("*.log")):
        rows = [line.split() for line in path.read_text().splitlines() if line.strip()]
        out[path.stem] = [(int(r[0]), float(r[1]), int(r[2]), int(r[3])) for r in rows]
    return out


def past(log_dir: Path, steps: dict[str, int]) -> bool:
    """Every process named has logged the step given for it."""
    found = logs(log_dir)
    return all(found.get(name) and found[name][-1][0] >= step for name, step in steps.items())


def config(procs: ProcessScope, run_dir: Path, *args: object) -> str:
    result = procs.run(["config", *args, "--run-dir", run_dir], timeout=60)
    assert result.returncode == 0, result.explain()
    return result.output


def version(procs: ProcessScope, run_dir: Path, number: int) -> dict:
    versions = json.loads(config(procs, run_dir, "history", "--json"))["versions"]
    return next(v for v in versions if v["number"] == number)


def first(rows: list[Row], column: int, value: object) -> int:
    return next(row[0] for row in rows if row[column] == value)


def test_a_job_of_roles_switches_each_role_at_its_step_and_restarts_its_roles_for_a_restart_field(
        procs: ProcessScope, run_dir: Path, tmp_path: Path) -> None:
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    job = procs.start(["run", "--workers", "1:2", "--role", "learner=1", "--preload", "", "--stop-grace", "1",
                       "--run-dir", run_dir, SCRIPT, "--log-dir", log_dir])
    wait_for(lambda: past(log_dir, {"worker0": 0}), 60, "worker 0 to run")
    assert procs.run(["scale", "--run-dir", run_dir, "worker=2"]).returncode == 0
    wait_for(lambda: past(log_dir, {"worker1": 5, "learner0": 5}), 60, "worker 1 and the learner to run 5 steps")

    number = int(re.search(r"config version (\d+)", config(procs, run_dir, "set", "lr=0.05")).group(1))
    hot = version(procs, run_dir, number)["role_steps"]
    assert hot["learner"] < hot["worker"], f"the learner's step is planned from its own pace: {hot}"
    wait_for(lambda: past(log_dir, {"worker0": hot["worker"], "worker1": hot["worker"], "learner0": hot["learner"]}),
             60, "every process to pass its role's step of the hot version")
    assert procs.run(["scale", "--run-dir", run_dir, "worker=1"]).returncode == 0
    wait_for(lambda: any(e["kind"] == "role_exited" and e["message"].startswith("worker 1 ")
                         for e in read_status(run_dir, recent=1000)["events"]), 60, "worker 1 to stop")

    output = config(procs, run_dir, "set", "batch_size=16")
    number = int(re.search(r"config version (\d+)", output).group(1))
    again = version(procs, run_dir, number)["role_steps"]
    wait_for(lambda: past(log_dir, {"worker0": again["worker"] + 3, "learner0": again["learner"] + 3}), 60,
             "worker 0 and the learner to run 3 steps with the restart field")
    config(procs, run_dir, "set", "stop=true")
    result = job.wait()
    assert result.returncode == 0, result.explain()

    found = logs(log_dir)
    for name, role in (("worker0", "worker"), ("learner0", "learner")):
        rows = found[name]
        assert [row[0] for row in rows] == list(range(len(rows))), f"{name} lost or redid a step"
        assert first(rows, 1, 0.05) == hot[role], f"{name} took lr 0.05 at its role's step {hot[role]}"
        assert first(rows, 2, 16) == again[role], f"{name} took batch_size 16 at its role's step {again[role]}"
        before, after = {row[3] for row in rows if row[0] < again[role]}, {row[3] for row in rows
                                                                           if row[0] >= again[role]}
        assert len(after) == 1 and max(before) < min(after), f"{name} restarted as a new incarnation for it"
    events = read_status(run_dir, recent=1000)["events"]
    restarts = [e["message"] for e in events if e["kind"] == "reconfigure"]
    assert len(restarts) == 1 and "every rank finished the step before it" in restarts[0] \
        and "role(s) learner, worker start again" in restarts[0], restarts
    applied = [e["message"] for e in events if e["kind"] == "config_applied"]
    assert any("runs on all 3 ranks from step" in m for m in applied), applied
    assert any("runs on all 2 ranks from step" in m for m in applied), applied
    assert not [e for e in events if e["kind"] in ("config_split", "role_failed")], "no split, no role restart"
