"""RoleMaster on a real Job (no processes) when things end that the roles did not end: a whole-job restart and a
scale down then up (every old incarnation reported once, the job still ends), a lost node and a dead fork server
(infrastructure faults: one event, no role restart spent), and placement by the resources roles declare."""

from __future__ import annotations

import itertools

import pytest
from test_role_master import deliver_all, exited, started

from convoy.control.job import FAILED, RUNNING, SUCCEEDED, Job
from convoy.control.protocol import messages as p
from convoy.control.rendezvous import Rendezvous
from convoy.control.roles.master import RoleMaster
from convoy.errors import ConfigError
from convoy.roles_config import RESTART_JOB, RoleSpec, parse_count

GIB = 1 << 30
CLOCK = itertools.count(10**6, 10**3)
"""Delivery times far apart: each deliver sends again what was not reported on."""


def job_of(nodes: dict[str, tuple[float, int]], max_regroups: int = 10, min_nodes: int = 0) -> Job:
    """A closed round of ``nodes`` (node -> (cpus, gpus)), as the master's join would leave it."""
    job = Job("j1", Rendezvous(min_nodes or len(nodes), len(nodes), 1.0, 0.0), max_restarts=3, join_timeout_s=60)
    job.max_regroups = max_regroups
    for index, node in enumerate(nodes):
        job.join(node, "127.0.0.1", 1, 1000 + index, 0.0)
    job.tick(2.0)
    assert job.membership is not None and len(job.membership.members) == len(nodes)
    return job


def master_of(specs: tuple[RoleSpec, ...], nodes: dict[str, tuple[float, int]] | None = None,
              memory: int = 0, max_regroups: int = 10, min_nodes: int = 0) -> RoleMaster:
    nodes = nodes or {"n0": (0, 0), "n1": (0, 0)}
    master = RoleMaster(job_of(nodes, max_regroups, min_nodes), specs, max_restarts=3)
    for node, (cpus, gpus) in nodes.items():
        master.node_room(node, memory, cpus, gpus)
    return master


def start_all(master: RoleMaster, port: int = 6000) -> dict[tuple[str, int], tuple[str, p.RoleAssignment]]:
    """Deliver and start whatever is assigned until nothing new comes; (role, rank) -> (node, assignment)."""
    placed: dict[tuple[str, int], tuple[str, p.RoleAssignment]] = {}
    master.advance(0.0)
    while True:
        fresh = [(node, a) for node, listed in deliver_all(master, next(CLOCK)).items() for a in listed]
        if not fresh:
            return placed
        for node, assignment in fresh:
            started(master, node, assignment, port_of(assignment, port))
            placed[(assignment.role, assignment.rank)] = (node, assignment)


def port_of(assignment: p.RoleAssignment, base: int = 6000) -> int:
    return base + 10 * assignment.rank + (assignment.role == "ps")


def ps_and_workers(workers: int = 2, policy: str = "") -> RoleMaster:
    return master_of((RoleSpec("ps"), RoleSpec("worker", count=parse_count(workers), failure_policy=policy)))


def test_a_whole_job_restart_ends_once_every_old_incarnation_is_reported() -> None:
    master = ps_and_workers(policy=RESTART_JOB)
    placed = start_all(master)
    node, worker0 = placed[("worker", 0)]
    exited(master, node, worker0, 1)
    told = {n: master.deliver(n, next(CLOCK)) for n in ("n0", "n1")}
    stops = [(n, s) for n, (_, listed) in told.items() for s in listed]
    assert {(s.role, s.rank) for _, s in stops} == {("ps", 0), ("worker", 1)}
    for n, stop in stops:  # the agent reports each old incarnation's exit, however it ended
        master.report(p.RoleReport(node_id=n, role=stop.role, rank=stop.rank, incarnation=stop.incarnation,
                                   state="exited", signal="SIGTERM"))
    assert not master.stopping and len(master.placed) == 1, "only the new PS is placed; the old ones are off the books"
    again = start_all(master, port=7000)
    assert {key: a.incarnation > placed[key][1].incarnation for key, (_, a) in again.items()} == {
        ("ps", 0): True, ("worker", 0): True, ("worker", 1): True}
    for rank in (0, 1):
        exited(master, *again[("worker", rank)], 0)
    ps_node, ps = again[("ps", 0)]
    assert [s.incarnation for s in master.deliver(ps_node, next(CLOCK))[1]] == [ps.incarnation]
    exited(master, ps_node, ps, -15)
    assert master.job.status == SUCCEEDED and master.job.restart_count == 1, "the one restart the policy spent"


def test_restart_roles_restarts_only_those_roles_and_spends_no_restart() -> None:
    master = ps_and_workers()
    placed = start_all(master)
    events = master.restart_roles(["worker"], "steps changed")
    assert [e.message for e in events if e.kind == "roles_restarted"] == [
        "every process of role(s) worker starts again: steps changed"]
    told = {n: master.deliver(n, next(CLOCK)) for n in ("n0", "n1")}
    assert sorted((s.role, s.rank) for _, stops in told.values() for s in stops) == [("worker", 0), ("worker", 1)]
    fresh = sorted((a.role, a.rank, a.port) for assignments, _ in told.values() for a in assignments)
    assert fresh == [("worker", 0, 6000), ("worker", 1, 6010)], "back on their nodes and ports; the PS runs on"
    assert master.roles.restarts_spent() == 0 and master.job.restart_count == 0
    with pytest.raises(ConfigError, match="no role 'learner' in this job"):
        master.restart_roles(["worker", "learner"], "x")
    assert all(a.incarnation == placed[("ps", 0)][1].incarnation for n, a in [placed[("ps", 0)]])


def test_a_role_scaled_down_then_up_at_once_starts_a_new_incarnation_beside_the_reported_old_one() -> None:
    master = master_of((RoleSpec("worker", count=parse_count("1:3")),))
    placed = start_all(master)
    master.scale("worker", 3)
    placed.update(start_all(master))
    third = placed[("worker", 2)]
    master.scale("worker", 2)
    master.scale("worker", 3)
    node = third[0]
    assignments, stops = master.deliver(node, next(CLOCK))
    assert [(s.rank, s.incarnation) for s in stops] == [(2, third[1].incarnation)]
    assert [(a.rank, a.port) for a in assignments] == [(2, 6020)], "the same rank, node and port, a new incarnation"
    new = assignments[0]
    events = master.report(p.RoleReport(node_id=node, role="worker", rank=2, incarnation=third[1].incarnation,
                                        state="exited", signal="SIGKILL"))  # stopped by its agent to make room
    assert [e.kind for e in events] == ["role_exited"] and not master.stopping
    started(master, node, new, 6020)
    for rank, (n, a) in {**placed, ("worker", 2): (node, new)}.items():
        exited(master, n, a, 0)
    assert master.job.status == SUCCEEDED and master.roles.restarts_spent() == 0


def test_a_lost_node_moves_its_processes_to_the_other_spending_no_restart() -> None:
    master = master_of((RoleSpec("worker", count=parse_count(8)),))
    placed = start_all(master)
    on_n1 = sorted(rank for (_, rank), (node, _) in placed.items() if node == "n1")
    assert len(on_n1) == 4
    events = master.node_lost("n1") + master.job.node_lost("n1", "sent no heartbeat for 30 s", 10.0)
    console = [e.message for e in events if e.console]
    assert console[0] == (f"node n1 was lost: its role processes ({', '.join(f'worker {r}' for r in on_n1)}) start "
                          "again on the other nodes (no role restart is spent)")
    assert console[1].startswith("node n1 sent no heartbeat for 30 s: going on with 1 nodes")
    assert not [e for e in events if e.kind in ("role_failed", "job_failed")]
    master.job.join("n0", "127.0.0.1", 1, 1002, 11.0)  # the survivor joins the regroup
    moved = start_all(master, port=7000)
    assert sorted(rank for (_, rank) in moved) == on_n1 and {node for node, _ in moved.values()} == {"n0"}
    assert master.roles.restarts_spent() == 0 and master.job.restart_count == 0 and master.job.regroup_count == 1
    for key, (node, assignment) in {**placed, **moved}.items():
        if node == "n0":
            exited(master, node, assignment, 0)
    assert master.job.status == SUCCEEDED


def test_a_dead_fork_server_is_one_event_and_its_processes_start_again_where_they_were() -> None:
    master = ps_and_workers(workers=4)
    placed = start_all(master)
    cause = "the fork server of node n0 died (SIGKILL)"
    on_n0 = [(key, a) for key, (node, a) in placed.items() if node == "n0"]
    events = []
    for (role, rank), assignment in on_n0:
        events += master.report(p.RoleReport(node_id="n0", role=role, rank=rank, incarnation=assignment.incarnation,
                                             state="exited", signal="SIGKILL", infrastructure=cause))
    console = [e.message for e in events if e.console]
    assert console == [f"infrastructure fault: {cause}; the role processes it ended start again (no role restart is "
                       "spent)"]
    assert master.roles.restarts_spent() == 0 and master.job.status == RUNNING
    again = start_all(master, port=7000)
    assert sorted(again) == sorted(key for key, _ in on_n0) and {n for n, _ in again.values()} == {"n0"}
    assert all(a.port == port_of(placed[key][1]) for key, (_, a) in again.items()), "on the ports they served"


def test_a_node_whose_fork_server_keeps_dying_is_excluded_and_its_processes_move() -> None:
    master = master_of((RoleSpec("worker", count=parse_count(2)),), max_regroups=1, min_nodes=1)
    placed = start_all(master)
    node, worker = next((n, a) for n, a in placed.values())
    for round_ in range(2):
        cause = f"the fork server of node {node} died (SIGKILL, {round_})"
        events = master.report(p.RoleReport(node_id=node, role="worker", rank=worker.rank,
                                            incarnation=worker.incarnation, state="exited", infrastructure=cause))
        if round_ == 0:
            worker = start_all(master, port=7000)[("worker", worker.rank)][1]
    assert any(e.kind == "node_excluded" for e in events) and master.job.refusal(node) is not None
    assert master.roles.restarts_spent() == 0 and master.job.status == RUNNING
    other = "n1" if node == "n0" else "n0"
    master.job.join(other, "127.0.0.1", 1, 1005, 20.0)  # the other node joins the regroup without it
    assert [(a.rank, n) for n, a in start_all(master, port=8000).values()] == [(worker.rank, other)]


def test_processes_are_placed_by_the_cpus_and_gpus_their_role_declares() -> None:
    master = master_of((RoleSpec("trainer", count=parse_count("2:3"), cpus=2.0, gpus=1),),
                       nodes={"n0": (2.0, 2), "n1": (4.0, 1)})
    placed = start_all(master)
    where = sorted((a.rank, node, tuple(a.gpus), a.cpus) for node, a in placed.values())
    assert where == [(0, "n0", (0,), 2.0), (1, "n1", (0,), 2.0)], "one per node: n0 has 2 CPUs, n1 one GPU"
    waits = [e for e in master.advance(1.0) if e.kind == "role_waits"]
    assert waits == [] and master.pending == [], "the role's MIN is placed; its count is 2 until scaled"
    events = master.scale("trainer", 3)
    [waiting] = [e.message for e in events if e.kind == "role_waits"]
    assert waiting.startswith("trainer 2 waits for room: it needs 2 CPU(s) and 1 GPU(s), and the nodes have n0 0 "
                              "CPU(s), 1 GPU(s); n1 2 CPU(s), 0 GPU(s); role trainer runs 2 of its 3 process(es)")
    assert master.advance(1e6) == [] and master.job.status == RUNNING, "said once; above its MIN it waits on"
    exited(master, *placed[("trainer", 1)], 0)
    assert [(a.rank, tuple(a.gpus)) for a in master.deliver("n1", next(CLOCK))[0]] == [(2, (0,))], \
        "the finished process's GPU goes to the waiting one"


def test_a_role_below_its_min_for_want_of_room_fails_the_job_after_the_join_timeout() -> None:
    master = master_of((RoleSpec("trainer", count=parse_count(3), memory_bytes=8 * GIB),), memory=10 * GIB)
    start_all(master)
    assert master.job.status == RUNNING
    assert master.advance(30.0) == [] and master.job.status == RUNNING
    events = master.advance(61.0)
    assert master.job.status == FAILED
    assert "role trainer has had 2 of its MIN 3 process(es) placed for 61 s: no node has room for one more (each " \
           "needs 8.00 GiB); add a node, or lower the role's count or resources" in events[-1].message


def test_the_ps_cannot_be_scaled() -> None:
    master = ps_and_workers()
    start_all(master)
    with pytest.raises(ConfigError, match=r"role ps cannot change its count \(1\): the parameter servers' layout"):
        master.scale("ps", 2)
    assert master.scale("ps", 1) is not None, "asking for the count it has is no change"
