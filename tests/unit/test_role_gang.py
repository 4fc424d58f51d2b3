"""A role group starts whole (``convoy/control/roles/gang.py``), on RoleMaster and a real Job (no processes): a group
grows only when all its new members have room, and a round whose members cannot all be placed waits whole instead
of starting its rank 0 alone (which would wait in its rendezvous for the others, holding its CPUs)."""

from __future__ import annotations

import pytest
from test_role_faults import CLOCK, master_of, start_all
from test_role_master import deliver_all, exited

from convoy.control.job import RUNNING
from convoy.errors import ConfigError
from convoy.roles_config import RoleSpec, parse_count


def actors_and_learners(actors: str, learners: str, node_cpus: float):
    specs = (RoleSpec("actor", count=parse_count(actors), cpus=0.5),
             RoleSpec("learner", count=parse_count(learners), cpus=0.5, group=True))
    return master_of(specs, {"n0": (node_cpus, 0)})


def test_a_group_without_room_for_its_new_members_is_not_grown_and_runs_on() -> None:
    master = actors_and_learners("1:2", "1:2", 1.0)
    placed = start_all(master)
    assert sorted(placed) == [("actor", 0), ("learner", 0)]
    with pytest.raises(ConfigError) as refused:
        master.scale("learner", 2, "asked by controller 0")
    assert str(refused.value) == (
        "role learner is a group whose members start together: 1 more process(es) of 0.5 CPU(s) each have no room "
        "now (the nodes have n0 0 CPU(s), 0 GPU(s)); it runs on with 1")
    assert master.roles.roles["learner"].target == 1
    assert deliver_all(master, next(CLOCK)) == {"n0": [], "n1": []}, "nothing is stopped or started"
    assert master.deliver("n0", next(CLOCK))[1] == [], "the running learner is not stopped"


def test_a_group_with_room_grows_and_forms_again_whole() -> None:
    master = actors_and_learners("1:2", "1:2", 2.0)
    start_all(master)
    master.scale("learner", 2)
    stops = master.deliver("n0", next(CLOCK))[1]
    assert [(stop.role, stop.rank) for stop in stops] == [("learner", 0)], "the group of 1 stops to form again"
    assert master.roles.roles["learner"].target == 2


def test_a_group_round_without_room_for_all_its_members_waits_whole_until_there_is() -> None:
    master = actors_and_learners("1", "2", 1.0)
    events = master.advance(0.0)
    assigned = deliver_all(master, next(CLOCK))["n0"]
    assert [(a.role, a.rank) for a in assigned] == [("actor", 0)], "the learners' rank 0 is not started alone"
    said = [event.message for event in events if event.kind == "role_waits"]
    assert said == ["role learner's group of 2 waits for room for all its members at once (0.5 CPU(s) each); the "
                    "nodes have n0 0.5 CPU(s), 0 GPU(s)"]
    assert [e for e in master.advance(1.0) if e.kind == "role_waits"] == [], "said once"
    exited(master, "n0", assigned[0], 0)  # the actor finishes: its CPU is free
    placed = start_all(master)
    assert sorted(placed) == [("learner", 0), ("learner", 1)]
    assert master.job.status == RUNNING
