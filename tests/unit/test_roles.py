"""The roles state machine: stable ranks, failure policy per role, scaling, services ended last, stale reports."""

from __future__ import annotations

import pytest

from convoy.control.roles.members import FailJob, RestartJob, RestartRole, Roles, Start, Stop
from convoy.errors import ConfigError
from convoy.roles_config import RoleSpec, parse_count


def ps_job(workers: str = "3", max_restarts: int = 2) -> Roles:
    specs = [RoleSpec("ps", count=parse_count(2)), RoleSpec("chief"), RoleSpec("worker", count=parse_count(workers))]
    return Roles(specs, max_restarts)


def started(roles: Roles, decisions: list) -> None:
    for decision in decisions:
        assert isinstance(decision, Start)
        roles.started(decision.role, decision.rank, decision.incarnation, f"h:{decision.rank}")


def test_the_job_starts_every_role_at_its_count_and_waits_to_size_auto_roles() -> None:
    roles = ps_job("auto")
    decisions, events = roles.start()
    assert [(d.role, d.rank) for d in decisions] == [("ps", 0), ("ps", 1), ("chief", 0)]
    assert any("worker: auto" in e.message for e in events)
    started(roles, decisions)
    sized, events = roles.size("worker", 3, "3 fit in 12 GiB free at 3.1 GiB each")
    assert [(d.role, d.rank) for d in sized] == [("worker", 0), ("worker", 1), ("worker", 2)]
    assert events[0].kind == "role_sized" and "3.1 GiB" in events[0].message


def test_a_worker_failure_restarts_only_that_worker_on_its_rank() -> None:
    roles = ps_job()
    decisions, _ = roles.start()
    started(roles, decisions)
    worker1 = next(d for d in decisions if d.role == "worker" and d.rank == 1)
    again, events = roles.failed("worker", 1, worker1.incarnation, "exit code 1")
    assert len(again) == 1 and isinstance(again[0], Start)
    assert (again[0].role, again[0].rank, again[0].restore) == ("worker", 1, False)
    assert again[0].incarnation != worker1.incarnation
    assert "restarting only it" in events[0].message and events[0].console


def test_a_ps_failure_restores_that_ps_and_a_chief_failure_restarts_the_job() -> None:
    roles = ps_job()
    decisions, _ = roles.start()
    started(roles, decisions)
    ps0 = next(d for d in decisions if d.role == "ps" and d.rank == 0)
    chief = next(d for d in decisions if d.role == "chief")
    again, _ = roles.failed("ps", 0, ps0.incarnation, "SIGKILL")
    assert again == [Start("ps", 0, True, again[0].reason, again[0].incarnation)]
    restart, _ = roles.failed("chief", 0, chief.incarnation, "exit code 1")
    assert isinstance(restart[0], RestartJob) and "chief 0 failed" in restart[0].reason


def test_a_role_past_its_restart_budget_fails_the_job_once() -> None:
    roles = ps_job(max_restarts=1)
    decisions, _ = roles.start()
    started(roles, decisions)
    first = next(d for d in decisions if d.role == "worker" and d.rank == 0)
    (again,), _ = roles.failed("worker", 0, first.incarnation, "exit code 1")
    roles.started("worker", 0, again.incarnation)
    (failed,), events = roles.failed("worker", 0, again.incarnation, "exit code 1")
    assert isinstance(failed, FailJob) and "used its 1 restart" in failed.reason
    assert roles.failed("worker", 1, 0, "exit code 1") == ([], [])  # the job has failed: nothing more follows


def test_a_late_report_of_a_replaced_or_stopped_process_is_ignored() -> None:
    roles = ps_job("2:3")
    decisions, _ = roles.start()
    started(roles, decisions)
    more, _ = roles.scale("worker", 3)
    started(roles, more)
    decisions += more
    old = next(d for d in decisions if d.role == "worker" and d.rank == 2)
    roles.failed("worker", 2, old.incarnation, "exit code 1")
    assert roles.failed("worker", 2, old.incarnation, "exit code 1") == ([], [])  # the same exit, reported again
    stops, _ = roles.scale("worker", 2)
    assert [(d.role, d.rank) for d in stops] == [("worker", 2)] and isinstance(stops[0], Stop)
    back, _ = roles.scale("worker", 3)
    assert [(d.role, d.rank) for d in back] == [("worker", 2)]
    assert roles.failed("worker", 2, old.incarnation, "SIGTERM") == ([], [])


def test_scaling_keeps_ranks_stable_and_refuses_counts_outside_the_role() -> None:
    roles = ps_job("2:4")
    decisions, _ = roles.start()
    started(roles, decisions)
    up, events = roles.scale("worker", 4)
    assert [(d.role, d.rank) for d in up] == [("worker", 2), ("worker", 3)]
    assert events[0].message == "role worker: 2 -> 4 process(es)"
    down, _ = roles.scale("worker", 2)
    assert [(d.rank) for d in down] == [3, 2]
    with pytest.raises(ConfigError, match=r"role worker can run 2\.\.4 processes \(its count is 2:4\), not 5"):
        roles.scale("worker", 5)
    with pytest.raises(ConfigError, match="no role 'learner' in this job"):
        roles.scale("learner", 1)


def test_the_ps_are_stopped_once_every_other_role_has_finished() -> None:
    roles = ps_job("2")
    decisions, _ = roles.start()
    started(roles, decisions)
    working = [d for d in decisions if d.role != "ps"]
    for decision in working[:-1]:
        assert roles.finished(decision.role, decision.rank, decision.incarnation)[0] == []
    stops, _ = roles.finished(working[-1].role, working[-1].rank, working[-1].incarnation)
    assert [(d.role, d.rank) for d in stops] == [("ps", 0), ("ps", 1)] and roles.done()
    assert roles.addresses()["ps"] == ["h:0", "h:1"]


def test_roles_named_twice_are_refused() -> None:
    with pytest.raises(ConfigError, match="roles named twice"):
        Roles([RoleSpec("worker"), RoleSpec("worker")], 1)


def test_a_preempted_group_member_is_told_and_the_rest_form_their_group_again_smaller_then_grow_back() -> None:
    roles = Roles([RoleSpec("learner", count=parse_count("1:3"), group=True)], 2)
    started(roles, roles.start()[0])
    roles.scale("learner", 3)
    assert sorted(roles.roles["learner"].members) == [0, 1, 2]
    assert roles.preempt("learner", "a job of higher priority asks") != ([], [])
    decisions, events = roles.preempt("learner", "a job of higher priority asks for 1 CPU(s)")
    stop, again = decisions
    assert isinstance(stop, Stop) and (stop.rank, stop.notice) == (1, True), "the highest rank left, told first"
    assert isinstance(again, RestartRole) and "forms again with 1 process(es)" in again.reason
    assert events[0].kind == "role_preempted"
    assert roles.preempt("learner", "more") == ([], []), "never below its MIN"
    assert roles.roles["learner"].preempted == 2 and roles.roles["learner"].grow_to == 3
    grown, _ = roles.grow_back("learner")
    assert any(isinstance(d, RestartRole) for d in grown) and roles.roles["learner"].target == 2
