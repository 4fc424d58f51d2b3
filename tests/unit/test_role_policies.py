"""The roles runtime's semantics as pure state: services and ``after``, the ``restart-role`` and ``replace``
policies, role groups (a round per re-forming; rank 0's address before the others start), and every bad
declaration refused with what to do."""

from __future__ import annotations

import pytest

from convoy.control.job import FAILED, SUCCEEDED, Job
from convoy.control.protocol import messages as p
from convoy.control.rendezvous import Rendezvous
from convoy.control.roles.master import RoleMaster
from convoy.control.roles.members import FailJob, RestartRole, Roles, Start, Stop
from convoy.control.roles.views import format_roles, role_views
from convoy.errors import ConfigError
from convoy.roles_config import (REPLACE, RESTART_JOB, RESTART_ONE, RESTART_ROLE, RoleSpec, check_roles, parse_count,
                                 role_from_table, start_order, waits_for)


def role(name: str, count: str = "1", **fields: object) -> RoleSpec:
    return RoleSpec(name, count=parse_count(count), **fields)  # type: ignore[arg-type]


def test_a_service_is_a_declared_role_and_ps_stays_one_by_default() -> None:
    assert role("ps").service and not role("worker").service
    assert role("replay", service=True).service and not role("ps", service=False).service
    specs = (role("replay", service=True), role("actor", "2"), role("learner", after=()))
    assert waits_for(specs) == {"replay": (), "actor": ("replay",), "learner": ()}


def test_after_names_roles_there_are_in_no_cycle() -> None:
    assert start_order((role("learner", after=("replay",)), role("replay", service=True))) == ["replay", "learner"]
    with pytest.raises(ConfigError, match=r"role 'actor': after = \['replai'\] names 'replai', which is not a role of "
                                          r"this job \(did you mean 'replay'\?\); its roles: replay, actor"):
        check_roles((role("replay", service=True), role("actor", after=("replai",))), True)
    with pytest.raises(ConfigError, match="roles wait for each other in a cycle: a -> b -> c -> a"):
        start_order((role("a", after=("b",)), role("b", after=("c",)), role("c", after=("a",))))
    with pytest.raises(ConfigError, match="in a cycle: a -> a"):
        start_order((role("a", after=("a",)),))


def test_a_group_needs_a_count_and_a_policy_that_restarts_it_whole() -> None:
    assert role("trainer", "2", group=True).failure_policy == RESTART_ROLE, "a group restarts as a group by default"
    with pytest.raises(ConfigError, match="role 'trainer': group = true needs a count .* not auto"):
        role("trainer", "auto", group=True).validate()
    with pytest.raises(ConfigError, match="failure_policy 'restart-one' restarts one process .* use 'restart-role'"):
        role("trainer", "2", group=True, failure_policy=RESTART_ONE).validate()
    role("trainer", "2", group=True, failure_policy=RESTART_JOB).validate()
    with pytest.raises(ConfigError, match="ps role serves over its own sockets and forms no group"):
        role("ps", group=True).validate()


def test_the_job_file_takes_the_new_keys_and_names_a_bad_one() -> None:
    spec = role_from_table("actor", {"count": "1:8", "failure_policy": "replace", "max_replacements": 3,
                                     "replacement_window_s": 30, "after": ["replay"]}, lambda key: "")
    assert (spec.failure_policy, spec.max_replacements, spec.replacement_window_s, spec.after) == \
        (REPLACE, 3, 30.0, ("replay",))
    with pytest.raises(ConfigError, match=r"roles.actor.after: 'replay' is not a list of strings"):
        role_from_table("actor", {"after": "replay"}, lambda key: "")
    with pytest.raises(ConfigError, match=r"roles.actor.max_replacements: -1: need a whole number"):
        role_from_table("actor", {"max_replacements": -1}, lambda key: "")
    with pytest.raises(ConfigError, match=r"roles.replay.service: 'yes' is not true or false"):
        role_from_table("replay", {"service": "yes"}, lambda key: "")


def test_replace_spends_no_restart_until_the_window_holds_too_many() -> None:
    roles = Roles((role("actor", "3", failure_policy=REPLACE, max_replacements=2, replacement_window_s=10),),
                  max_restarts=0)
    roles.start()
    decisions, events = roles.failed("actor", 1, 1, "exit code 1", now=100.0)
    assert decisions == [Start("actor", 1, False, decisions[0].reason, 3, anywhere=True)]  # type: ignore[union-attr]
    assert "no restart spent (1 of 2 within 10 s)" in events[0].message and roles.restarts_spent() == 0
    roles.failed("actor", 1, 3, "exit code 1", now=105.0)
    decisions, events = roles.failed("actor", 0, 0, "exit code 1", now=109.0)
    assert isinstance(decisions[0], FailJob)
    assert "role actor has replaced 2 process(es) within 10 s (its max_replacements): a failure loop" in \
        decisions[0].reason


def test_replacements_older_than_the_window_no_longer_count() -> None:
    roles = Roles((role("actor", "2", failure_policy=REPLACE, max_replacements=1, replacement_window_s=10),),
                  max_restarts=0)
    roles.start()
    roles.failed("actor", 0, 0, "exit code 1", now=0.0)
    decisions, _ = roles.failed("actor", 0, 2, "exit code 1", now=10.5)
    assert isinstance(decisions[0], Start) and roles.roles["actor"].replacements == 2


def test_restart_role_restarts_the_role_alone_spending_one_restart_and_a_group_counts_its_rounds() -> None:
    roles = Roles((role("trainer", "2", group=True), role("rollout", "2")), max_restarts=1)
    roles.start()
    assert roles.group_round("trainer") == 1 and roles.group_round("rollout") == 0
    decisions, _ = roles.failed("trainer", 1, 1, "killed by SIGKILL")
    assert decisions == [RestartRole("trainer", decisions[0].reason)]  # type: ignore[union-attr]
    starts = roles.restart(["trainer"], "re-form")
    assert [(s.role, s.rank) for s in starts] == [("trainer", 0), ("trainer", 1)]
    assert roles.group_round("trainer") == 2 and roles.restarts_spent() == 1
    assert roles.failed("trainer", 1, 1, "late report of the old member") == ([], []), "old incarnations are ignored"
    decisions, _ = roles.failed("trainer", 0, starts[0].incarnation, "exit code 1")
    assert isinstance(decisions[0], FailJob), "the role's restarts are spent"


def test_scaling_a_group_forms_it_again_at_its_new_size() -> None:
    roles = Roles((role("trainer", "1:4", group=True),), max_restarts=3)
    roles.start()
    decisions, events = roles.scale("trainer", 3, "asked by controller 0: rates")
    assert decisions == [RestartRole("trainer", "role trainer scaled to 3: its group forms again")]
    assert events[0].message == "role trainer: 1 -> 3 process(es) (asked by controller 0: rates)"
    decisions, _ = roles.scale("trainer", 2)
    assert decisions[0] == Stop("trainer", 2, "role trainer scaled to 2") and isinstance(decisions[1], RestartRole)
    assert roles.scale("trainer", 2)[0] == [], "the same count changes nothing"
    with pytest.raises(ConfigError, match=r"role trainer can run 1..4 processes \(its count is 1:4\), not 5"):
        roles.scale("trainer", 5)


def two_node_job() -> Job:
    job = Job("j1", Rendezvous(2, 2, 0.0, 0.0), max_restarts=3, join_timeout_s=60)
    job.join("n0", "127.0.0.1", 1, 1000, 0.0)
    job.join("n1", "127.0.0.1", 1, 1001, 0.0)
    return job


def deliver(master: RoleMaster) -> list[tuple[str, p.RoleAssignment]]:
    return [(node, assignment) for node in ("n0", "n1") for assignment in master.deliver(node, 0.0)[0]]


def report(master: RoleMaster, node: str, a: p.RoleAssignment, state: str, port: int = 0, code: int = 0) -> list:
    return master.report(p.RoleReport(node_id=node, role=a.role, rank=a.rank, incarnation=a.incarnation, state=state,
                                      address=f"127.0.0.1:{port}" if port else "", exitcode=code if state == "exited"
                                      else None))


def test_a_group_starts_rank_0_first_then_the_others_with_its_address_and_a_role_after_waits() -> None:
    specs = (role("trainer", "2", group=True), role("rollout", "1", after=("trainer",)))
    master = RoleMaster(two_node_job(), specs, max_restarts=2)
    master.advance()
    first = deliver(master)
    assert [(a.role, a.rank, a.group_round, a.group_address) for _, a in first] == [("trainer", 0, 1, "")]
    report(master, *first[0], "started", 7000)
    second = deliver(master)
    assert [(a.role, a.rank, a.group_round, a.group_address) for _, a in second] == \
        [("trainer", 1, 1, "127.0.0.1:7000")], "rollout waits for every trainer's address"
    report(master, *second[0], "started", 7001)
    third = deliver(master)
    assert [(a.role, a.group_round) for _, a in third] == [("rollout", 0)]
    report(master, *third[0], "started", 7100)
    events = report(master, *second[0], "exited", code=1)
    assert any("every process of role trainer starts again together" in e.message for e in events)
    again = sorted(deliver(master), key=lambda pair: pair[1].rank)
    assert [(a.role, a.rank, a.group_round) for _, a in again] == [("trainer", 0, 2)], "rank 0 of round 2 first"
    stops = {node: master.deliver(node, 10.0)[1] for node in ("n0", "n1")}
    assert sorted((s.role, s.rank) for listed in stops.values() for s in listed) == [("trainer", 0)], \
        "the old rank 0 is stopped; the rollout runs on (the failed rank 1 is gone already)"
    rows = {row["name"]: row for row in role_views(specs, master.roles.state())}
    assert rows["trainer"]["group_round"] == 2 and rows["trainer"]["restarts"] == 1
    assert rows["rollout"]["running"] == 1 and rows["rollout"]["restarts"] == 0
    line = "  trainer (group round 2): 0 running, 2 pending of 2 wanted (count 2); on failure restart-role; restarts 1"
    assert line in format_roles(list(rows.values()))


def test_a_declared_service_is_stopped_once_the_other_roles_finish_and_the_job_succeeds() -> None:
    job = two_node_job()
    master = RoleMaster(job, (role("replay", service=True), role("learner", "1")), max_restarts=0)
    master.advance()
    (node, replay), = deliver(master)
    report(master, node, replay, "started", 7000)
    (node2, learner), = deliver(master)
    report(master, node2, learner, "started", 7001)
    report(master, node2, learner, "exited", code=0)
    stops = master.deliver(node, 0.0)[1]
    assert [(s.role, s.reason) for s in stops] == [("replay", "every other role has finished")]
    assert job.status != SUCCEEDED, "not before the service has stopped"
    report(master, node, replay, "exited", code=-15)
    assert job.status == SUCCEEDED


def test_a_failed_replace_loop_fails_the_job_naming_it() -> None:
    job = two_node_job()
    master = RoleMaster(job, (role("actor", "1", failure_policy=REPLACE, max_replacements=0),), max_restarts=5)
    master.advance()
    (node, actor), = deliver(master)
    report(master, node, actor, "started", 7000)
    report(master, node, actor, "exited", code=1)
    assert job.status == FAILED and "its max_replacements" in job.outcome
