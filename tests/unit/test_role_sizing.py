"""Sizing a role from one measured iteration, on a real RoleMaster, Job and Rendezvous (no processes): rank 0
alone first, the prediction and placement once it reports, the limits the others start with, a limit below the
need refused, an OOM-killed process relaunched with a raised limit outside the restart budget, a measuring
process that dies failing the job, the margin learnt from clean exits, and what status shows."""

from __future__ import annotations

import pytest

from convoy.control.job import FAILED, RUNNING, Job
from convoy.control.protocol import messages as p
from convoy.control.rendezvous import Rendezvous
from convoy.control.roles.master import RoleMaster
from convoy.control.roles.memory_model import PRIOR_SPREAD, SPREAD_FACTOR
from convoy.control.roles.sizing import MAX_OOM_RELAUNCHES
from convoy.control.status import format_memory
from convoy.roles_config import RoleSpec, parse_count

MIB = 1024 * 1024
PEAK = 100 * MIB
FIGURES = p.MeasuredIterationReport(batch_size=64, sample_bytes=4096, state_bytes=40 * MIB, peak_rss_bytes=PEAK,
                                    peak_uss_bytes=90 * MIB, baseline_rss_bytes=30 * MIB,
                                    baseline_uss_bytes=25 * MIB, duration_s=0.2, num_samples=40)
PRIOR_LIMIT = PEAK * (1 + SPREAD_FACTOR * PRIOR_SPREAD)


def job_of(free: dict[str, tuple[int, int]], workers: str = "auto", **worker: object) -> RoleMaster:
    """A PS and a worker role on nodes named in ``free`` (node -> (free bytes, cpus)), the round closed."""
    job = Job("j1", Rendezvous(len(free), len(free), 0.0, 0.0), max_restarts=3, join_timeout_s=60)
    for index, node in enumerate(sorted(free)):
        job.join(node, "127.0.0.1", 1, 1000 + index, 0.0)
    specs = (RoleSpec("ps"), RoleSpec("worker", count=parse_count(workers), **worker))
    master = RoleMaster(job, specs, max_restarts=0)
    for node, (available, cpus) in free.items():
        master.sizing.node_memory(node, available, 0, cpus)
    return master


def deliver(master: RoleMaster) -> list[tuple[str, p.RoleAssignment]]:
    """Every assignment not sent yet, each reported started (port 5000 + rank)."""
    sent = []
    for node in sorted(master.sizing.nodes):
        for assignment in master.deliver(node, 0.0)[0]:
            master.report(p.RoleReport(node_id=node, role=assignment.role, rank=assignment.rank,
                                       incarnation=assignment.incarnation, state="started",
                                       address=f"127.0.0.1:{5000 + assignment.rank}"))
            sent.append((node, assignment))
    return sent


def measure(master: RoleMaster, node: str, figures: p.MeasuredIterationReport = FIGURES) -> list:
    return master.memory(p.MemoryReport(node_id=node, processes=[p.ProcessMemory(
        role="worker", rank=0, incarnation=0, peak_rss_bytes=figures.peak_rss_bytes, measured=figures)]))


def exit_report(node: str, assignment: p.RoleAssignment, code: int | None, **more: object) -> p.RoleReport:
    return p.RoleReport(node_id=node, role=assignment.role, rank=assignment.rank, incarnation=assignment.incarnation,
                        state="exited", exitcode=code, **more)


def chief_running(master: RoleMaster, limit: int = 0) -> tuple[str, p.RoleAssignment]:
    """The PS and the chief started; the chief alone of its role, sampled from its start, with no limit but
    the role's explicit one."""
    master.advance()
    placed = [(node, a) for node, a in deliver(master) + deliver(master) if a.role == "worker"]
    assert [(a.rank, a.measure, a.memory_limit_bytes) for _, a in placed] == [(0, True, limit)]
    return placed[0]


def test_auto_workers_start_the_chief_alone_then_as_many_as_the_free_memory_and_cpus_take() -> None:
    master = job_of({"n0": (10 * 1024 * MIB, 2), "n1": (250 * MIB, 8)})
    chief_node, _ = chief_running(master)
    events = measure(master, chief_node)
    assert any(e.kind == "role_predicted" and "predicted 100.0 MiB" in e.message for e in events), events
    started = deliver(master)
    limit = started[0][1].memory_limit_bytes
    assert limit == pytest.approx(PRIOR_LIMIT, abs=4096), "the prediction plus the prior margin"
    by_node = {node: sum(1 for n, _ in started if n == node) for node in ("n0", "n1")}
    assert chief_node == "n1", "the PS went to n0, the chief to the less loaded n1"
    # n0: memory for ~96 limits, but 2 CPUs; n1: 8 CPUs (one the chief's), but 250 MiB less the reserve holds 2
    assert by_node == {"n0": 2, "n1": 2}
    assert sorted(a.rank for _, a in started) == list(range(1, 1 + len(started)))
    assert all(a.memory_limit_bytes == limit and not a.measure for _, a in started)
    assert master.roles.world_size("worker") == 1 + len(started)


def test_a_measured_gpu_peak_is_said_with_the_prediction() -> None:
    master = job_of({"n0": (10 * 1024 * MIB, 2), "n1": (10 * 1024 * MIB, 2)})
    chief_node, _ = chief_running(master)
    events = measure(master, chief_node, FIGURES.model_copy(update={"gpu_peak_bytes": 3 * 1024 * MIB}))
    predicted = [e.message for e in events if e.kind == "role_predicted"]
    assert predicted and "GPU memory 3072.0 MiB per process" in predicted[0], predicted


def test_memory_auto_holds_the_requested_ranks_until_measured_then_places_them_with_the_limit() -> None:
    master = job_of({"n0": (2048 * MIB, 4), "n1": (4096 * MIB, 4)}, workers="3", memory_auto=True)
    chief_node, _ = chief_running(master)
    assert deliver(master) == [], "ranks 1 and 2 wait for the measurement"
    measure(master, chief_node)
    started = deliver(master)
    assert sorted(a.rank for _, a in started) == [1, 2]
    assert {node for node, _ in started} == {"n1"}, "the node with the most free memory takes both"
    assert master.roles.world_size("worker") == 3


def test_an_explicit_limit_below_the_measured_need_fails_the_job_quoting_the_measurement() -> None:
    master = job_of({"n0": (4096 * MIB, 4)}, memory_bytes=64 * MIB)
    chief_node, _ = chief_running(master, limit=64 * MIB)
    measure(master, chief_node)
    assert master.job.status == FAILED
    assert "memory limit 64.0 MiB for role worker is below its measured need 100.0 MiB" in master.job.outcome
    assert "peaked at 100.0 MiB RSS" in master.job.outcome
    assert deliver(master) == []


def test_workers_that_do_not_fit_fail_the_job_with_what_fits() -> None:
    master = job_of({"n0": (150 * MIB, 4)}, workers="4", memory_auto=True)
    chief_node, _ = chief_running(master)
    measure(master, chief_node)
    assert master.job.status == FAILED and "3 workers of" in master.job.outcome and "holds 1" in master.job.outcome


def test_an_oom_killed_worker_is_relaunched_with_a_raised_limit_outside_the_restart_budget() -> None:
    master = job_of({"n0": (10 * 1024 * MIB, 2)})
    chief_node, _ = chief_running(master)
    measure(master, chief_node)
    (node, worker), = deliver(master)
    limit = worker.memory_limit_bytes
    for relaunch in range(1, MAX_OOM_RELAUNCHES + 1):
        events = master.report(exit_report(node, worker, None, signal="SIGKILL", oom_killed=True,
                                           overshoot_bytes=8 * MIB))
        assert master.job.status == RUNNING, "not counted against max_restarts 0"
        assert any(e.kind == "role_relaunched" and f"OOM relaunch {relaunch} of" in e.message for e in events)
        (node, worker), = deliver(master)
        assert worker.memory_limit_bytes >= limit + 8 * MIB, "raised by at least the overshoot"
        limit = worker.memory_limit_bytes
    master.report(exit_report(node, worker, None, signal="SIGKILL", oom_killed=True))
    assert master.job.status == FAILED and "OOM-killed" in master.job.outcome, "then it counts as a failure"


@pytest.mark.parametrize("begun, words", [(True, "crashed in the measuring iteration"),
                                          (False, "ended before its measuring iteration")])
def test_a_measuring_chief_that_dies_fails_the_job_naming_the_iteration(begun: bool, words: str) -> None:
    master = job_of({"n0": (4096 * MIB, 4)})
    node, chief = chief_running(master)
    if begun:
        master.memory(p.MemoryReport(node_id=node, processes=[p.ProcessMemory(
            role="worker", rank=0, incarnation=0, peak_rss_bytes=MIB, measuring=True)]))
    master.report(exit_report(node, chief, 1, log_path="logs/roles/worker0.log"))
    assert master.job.status == FAILED
    assert master.job.outcome.startswith(f"job failed: worker 0 {words} (convoy.measure_iteration), which sizes "
                                         "role worker: it exited with code 1; no other worker was started")
    assert deliver(master) == [] and master.roles.roles["worker"].restarts == 0, "not restarted by its policy"


def test_clean_exits_teach_the_margin_and_a_later_worker_starts_under_it() -> None:
    master = job_of({"n0": (10 * 1024 * MIB, 2)}, workers="auto")
    chief_node, chief = chief_running(master)
    measure(master, chief_node)
    (node, worker), = deliver(master)
    prior = master.sizing.margin.margin()
    assert master.report(exit_report(chief_node, chief, 0, memory_peak_bytes=3 * PEAK)) is not None
    assert master.sizing.margin.margin() == prior, "the chief's peak (its evaluation too) teaches nothing"
    master.memory(p.MemoryReport(node_id=node, processes=[p.ProcessMemory(
        role="worker", rank=1, incarnation=worker.incarnation, peak_rss_bytes=110 * MIB)]))
    events = master.report(exit_report(node, worker, 0, memory_peak_bytes=110 * MIB))
    assert any(e.kind == "memory_measured" and "(+10.0%)" in e.message for e in events), events
    assert master.sizing.margin.margin() >= 0.10, "never below the worst underestimate seen"
    master.scale("worker", 3)
    later = [a for _, a in deliver(master) if a.rank == 2]
    assert later and later[0].memory_limit_bytes >= 110 * MIB
    rows = master.sizing.rows()
    assert [(r["role"], r["rank"], r["predicted_bytes"], r["peak_bytes"]) for r in rows if r["rank"] == 1] == \
        [("worker", 1, PEAK, 110 * MIB)]


def test_status_lists_predicted_limit_and_peak_per_process() -> None:
    table = {"margin": 0.06, "processes": [
        {"role": "worker", "rank": 1, "incarnation": 2, "node": "n0", "predicted_bytes": PEAK,
         "limit_bytes": 106 * MIB, "peak_bytes": 98 * MIB, "mechanism": "cgroup-v1", "state": "running"}]}
    lines = format_memory(table)
    assert lines[0] == "memory (MiB; margin 6.0%):"
    assert lines[2].split() == ["worker", "1", "(incarnation", "2)", "100.0", "106.0", "98.0", "running", "on", "n0",
                                "(cgroup-v1)"]
    assert format_memory(None) == [] and format_memory({"margin": 0.0, "processes": []}) == []


def test_a_restarted_master_keeps_the_prediction_limits_and_margin() -> None:
    import json

    master = job_of({"n0": (10 * 1024 * MIB, 4), "n1": (10 * 1024 * MIB, 4)}, workers="3", memory_auto=True)
    chief_node, _ = chief_running(master)
    measure(master, chief_node)
    started = deliver(master)
    node, worker = next((n, a) for n, a in started if a.rank == 1)
    master.report(exit_report(node, worker, None, signal="SIGKILL", oom_killed=True, overshoot_bytes=8 * MIB))
    saved = json.loads(json.dumps(master.state()))
    again = RoleMaster(master.job, tuple(master.specs.values()), max_restarts=0)
    again.load_state(saved)
    assert again.sizing.rows() == master.sizing.rows()
    assert again.sizing.margin.margin() == master.sizing.margin.margin()
    for rank in (0, 1, 2):
        assert again.sizing.limit_for("worker", rank) == master.sizing.limit_for("worker", rank)
    assert again.sizing.limit_for("worker", 1) > again.sizing.limit_for("worker", 2), "the raised limit is kept"
