"""The live training config in real jobs: a hot field switches at one step on every rank, a restart field by a
restart from that step's snapshot (no step lost or redone, no restart counted), a config that makes the
workers fail is reverted, and bad input changes nothing."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from helpers import ProcessScope, wait_for

from convoy.control.store import read_status
from convoy.control.token import TOKEN_FILE

pytestmark = pytest.mark.slow
EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "train_live_config.py")


def rank_logs(log_dir: Path) -> dict[int, list[tuple[int, float, int, int]]]:
    """Each rank's ``(step, lr, batch_size, round)`` lines."""
    out = {}
    for path in sorted(log_dir.glob("rank*.log")):
        rows = [line.split() for line in path.read_text().splitlines() if line.strip()]
        out[int(path.stem.removeprefix("rank"))] = [(int(r[0]), float(r[1]), int(r[2]), int(r[4])) for r in rows]
    return out


def newest_step(log_dir: Path) -> int:
    logs = rank_logs(log_dir)
    return min((rows[-1][0] for rows in logs.values() if rows), default=-1) if logs else -1


def config(procs: ProcessScope, run_dir: Path, *args: object) -> tuple[int, str]:
    result = procs.run(["config", *args, "--run-dir", run_dir], timeout=60)
    return result.returncode, result.output


def test_hot_and_restart_fields_switch_at_one_step_on_every_rank(procs: ProcessScope, run_dir: Path,
                                                                 tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    job = procs.start(["run", "--nnodes", "2", "--nproc-per-node", "2", "--run-dir", run_dir, "--stop-grace", "2",
                       "--set", "steps=100000", EXAMPLE, "--step-time", "0.03", "--log-dir", logs])
    wait_for(lambda: newest_step(logs) >= 15, 120, "every rank to run 15 steps")

    for bad, named in (("lr=abc", "'lr' is float"), ("nope=1", "no field 'nope'"), ("lr=1000", "above its maximum"),
                       ("batch_size=0", "below its minimum"), ("lr", "not KEY=VALUE")):
        code, output = config(procs, run_dir, "set", bad)
        assert code == 2 and named in output and output.count("\n") == 1, (bad, output)
    code, output = config(procs, run_dir, "history", "--json")
    assert code == 0 and len(json.loads(output)["versions"]) == 1, "a refused set made a version"

    code, output = config(procs, run_dir, "set", "lr=0.005", "--reason", "test")
    assert code == 0, output
    hot_step = int(re.search(r"applied in place from step (\d+)", output).group(1))
    wait_for(lambda: newest_step(logs) >= hot_step + 5, 120, "the ranks to pass the hot change")
    code, output = config(procs, run_dir, "set", "batch_size=48")
    assert code == 0, output
    restart_step = int(re.search(r"applied by a restart of the round from step (\d+)", output).group(1))
    wait_for(lambda: newest_step(logs) >= restart_step + 3, 120, "the ranks to resume with the restart field")
    code, output = config(procs, run_dir, "set", f"steps={restart_step + 10}")
    assert code == 0, output
    steps = int(re.search(r"from step (\d+)", output).group(1))
    steps = max(steps, restart_step + 10)

    result = job.wait()
    assert result.returncode == 0, result.explain()
    ranks = rank_logs(logs)
    assert sorted(ranks) == [0, 1, 2, 3]
    for rank, rows in ranks.items():
        assert [row[0] for row in rows] == list(range(steps)), f"rank {rank} lost or redid a step"
        switched = [step for step, lr, _, _ in rows if lr == 0.005]
        assert switched and switched[0] == hot_step, f"rank {rank} took lr 0.005 at {switched[:1]}, not {hot_step}"
        assert all(lr == 0.01 for step, lr, _, _ in rows if step < hot_step)
        assert [step for step, _, batch, _ in rows if batch == 48][0] == restart_step, f"rank {rank}"
        assert {r for step, _, _, r in rows if step >= restart_step} == {2}, "the restart field came by a new round"
    state = read_status(run_dir, recent=1000)
    assert state["job"]["restart_count"] == 0, "applying a restart field used a restart"
    kinds = [event["kind"] for event in state["events"]]
    assert kinds.count("reconfigure") == 1 and kinds.count("config_split") == 0, kinds
    applied = [e["message"] for e in state["events"] if e["kind"] == "config_applied"]
    assert any(f"runs on all 4 ranks from step {hot_step}" in m for m in applied), applied
    code, output = config(procs, run_dir, "set", "lr=0.1")
    assert code == 2 and "succeeded" in output, output


def test_a_config_that_fails_the_workers_is_reverted(procs: ProcessScope, run_dir: Path, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    job = procs.start(["run", "--nnodes", "2", "--run-dir", run_dir, "--set", "crash_above_lr=0.05", "--stop-grace",
                       "2", "--set", "steps=100000", EXAMPLE, "--step-time", "0.03", "--log-dir", logs])
    wait_for(lambda: newest_step(logs) >= 10, 120, "both ranks to run 10 steps")
    # the steps reach the master through the agent, every FLUSH_S, so they may trail the rank logs
    metrics = wait_for(lambda: metrics_of_both_ranks(run_dir), 30, "five steps of rank 0 and both ranks at the master")
    assert all(p["loss"] is not None for p in metrics["points"]), metrics
    assert {row["task"] for row in metrics["latest"]} == {"default:0", "default:1"}
    with pytest.raises(urllib.error.HTTPError) as refused:
        api(run_dir, "/config", {"values": {"lr": "x"}})
    assert refused.value.code == 400 and "'lr' is float" in refused.value.read().decode()

    code, output = config(procs, run_dir, "set", "lr=0.1")
    assert code == 0, output
    bad_step = int(re.search(r"from step (\d+)", output).group(1))
    wait_for(lambda: newest_step(logs) >= bad_step + 5, 120, "the ranks to go on after the revert")
    code, output = config(procs, run_dir, "set", f"steps={bad_step + 10}")
    assert code == 0, output
    steps = max(int(re.search(r"from step (\d+)", output).group(1)), bad_step + 10)
    result = job.wait()
    assert result.returncode == 0, result.explain()
    assert "makes the worker fail" in result.output
    state = read_status(run_dir, recent=1000)
    reverted = [e["message"] for e in state["events"] if e["kind"] == "config_reverted"]
    assert len(reverted) == 1 and "puts back lr=0.01" in reverted[0], reverted
    for rank, rows in rank_logs(logs).items():
        assert [row[0] for row in rows] == list(range(steps)), f"rank {rank} lost or redid a step"
        assert all(lr == 0.01 for _, lr, _, _ in rows), f"rank {rank} trained a step with the failing lr"
    code, output = config(procs, run_dir, "history")
    assert code == 0 and re.search(r"v2 .* reverted .*lr=0\.1", output) and re.search(r"v3 .* revert .*lr=0\.01",
                                                                                     output), output
    assert bad_step >= 10
    status = procs.run(["status", "--run-dir", run_dir]).stdout
    assert "training config: version 4 (" in status and re.search(rf"default:1 +{steps - 1} ", status), status


def metrics_of_both_ranks(run_dir: Path) -> dict | None:
    """The master's last five steps of rank 0, once it has five of them and a step of each rank; else None."""
    metrics = api(run_dir, "/metrics?task=default:0&limit=5")
    return metrics if len(metrics["points"]) == 5 and len(metrics["latest"]) == 2 else None


def api(run_dir: Path, path: str, body: dict | None = None) -> dict:
    job = read_status(run_dir, recent=0)["job"]
    token = (run_dir / TOKEN_FILE).read_text().strip()
    request = urllib.request.Request(f"http://{job['master_url']}/v1{path}", method="PUT" if body else "GET",
                                     data=json.dumps(body).encode() if body else None,
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.loads(answer.read())


def test_an_injected_divergence_is_rolled_back_by_the_opted_in_rule(procs: ProcessScope, run_dir: Path,
                                                                    tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    job = procs.start(["run", "--nnodes", "2", "--run-dir", run_dir, "--auto-apply", "divergence", "--stop-grace",
                       "2", "--set", "steps=100000", EXAMPLE, "--persist-every", 10, "--step-time", "0.03",
                       "--log-dir", logs])
    wait_for(lambda: newest_step(logs) >= 35, 120, "both ranks to run 35 steps")
    code, output = config(procs, run_dir, "set", "lr=1.0", "--reason", "a 100x learning rate")
    assert code == 0, output
    bad_step = int(re.search(r"from step (\d+)", output).group(1))
    wait_for(lambda: all(any(row[3] == 2 for row in rows) for rows in rank_logs(logs).values()), 120,
             "the round of the rollback to run")
    code, output = config(procs, run_dir, "set", f"steps={bad_step + 20}")
    assert code == 0, output
    result = job.wait()
    assert result.returncode == 0, result.explain()
    assert "resumed from persistent checkpoint" in result.output
    state = read_status(run_dir, recent=1000)
    proposals = [e["message"] for e in state["events"] if e["kind"] == "proposal"]
    assert proposals and "divergence at step" in proposals[0], proposals
    detected = int(re.search(r"divergence at step (\d+)", proposals[0]).group(1))
    assert detected - bad_step <= 5, f"detected at step {detected}, {detected - bad_step} steps after the change"
    rollback = int(re.search(r"roll back to step (\d+)", proposals[0]).group(1))
    assert rollback < bad_step and rollback % 10 == 9, "back to a persistent checkpoint before the change"
    assert state["job"]["restart_count"] == 0
    for rank, rows in rank_logs(logs).items():
        resumed = [row for row in rows if row[3] == 2]
        assert resumed[0][0] == rollback + 1 and all(lr == 0.01 for _, lr, _, _ in resumed), f"rank {rank}"


def test_a_manager_watches_two_jobs_applies_a_rule_and_pushes_a_config(procs: ProcessScope, tmp_path: Path) -> None:
    runs, jobs = [tmp_path / "a", tmp_path / "b"], []
    for run_dir in runs:
        (run_dir.parent / f"{run_dir.name}-logs").mkdir()
        jobs.append(procs.start(["run", "--run-dir", run_dir, "--set", "steps=100000", "--stop-grace", "2", EXAMPLE,
                                 "--persist-every", 10, "--step-time", "0.03", "--log-dir",
                                 run_dir.parent / f"{run_dir.name}-logs"]))
    for run_dir in runs:
        wait_for(lambda run_dir=run_dir: newest_step(run_dir.parent / f"{run_dir.name}-logs") >= 30, 120,
                 f"job {run_dir.name} to run 30 steps")
    manager = procs.start(["manager", "--run-dirs", *runs, "--auto-apply", "divergence", "--interval", "0.3"])
    manager.wait_output(r"b: job \w+ running: config v1")
    code, output = config(procs, runs[0], "set", "lr=1.0")
    assert code == 0, output
    manager.wait_output(r"a: config version \d+ \(lr=0\.01\) from step \d+")
    for run_dir in runs:  # job a may still be applying its rollback (refused with that reason until it is active)
        wait_for(lambda run_dir=run_dir: config(procs, run_dir, "set", "steps=120")[0] == 0, 60,
                 f"job {run_dir.name} to take steps=120")
    for job in jobs:
        assert job.wait().returncode == 0
    result = manager.wait(60)
    assert result.returncode == 0, result.explain()
    # a throughput proposal may come first on a loaded machine, so the divergence's number is not fixed
    assert re.search(r"a: proposal \d+ \(\w+\): divergence at step", result.stdout), result.stdout
    assert not re.search(r"b: proposal \d+ \(\w+\): (nan|divergence)", result.stdout), \
        "the job without a change did not diverge (a throughput proposal may come: job a's restart takes its CPU)"
    applied = [e for e in read_status(runs[0], recent=1000)["events"] if e["kind"] in ("config_rollback", "config_set")
               and "by convoy manager" in e["message"] and "lr=0.01" in e["message"]]
    assert len(applied) == 1, "the manager applied job a's proposal (with a rollback if a checkpoint before it is kept)"
