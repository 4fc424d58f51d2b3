"""RoleMaster on a real Job and Rendezvous (no processes): placement, the wait for the PS addresses, delivery
and redelivery, stale reports, the failure policies carried out, the job's end, and the roles file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from convoy.control.job import FAILED, RUNNING, SUCCEEDED, Job
from convoy.control.protocol import messages as p
from convoy.control.rendezvous import Rendezvous
from convoy.control.roles.master import RoleMaster
from convoy.control.roles.roles_file import load_roles, save_roles
from convoy.control.roles.orders import REDELIVER_S
from convoy.errors import ConfigError
from convoy.roles_config import RESTART_JOB, RoleSpec, parse_count


def two_node_job() -> Job:
    job = Job("j1", Rendezvous(2, 2, 0.0, 0.0), max_restarts=3, join_timeout_s=60)
    job.join("n0", "127.0.0.1", 1, 1000, 0.0)
    job.join("n1", "127.0.0.1", 1, 1001, 0.0)
    assert job.membership is not None
    return job


def ps_job(workers: str = "2", **worker: object) -> RoleMaster:
    specs = (RoleSpec("ps"), RoleSpec("worker", count=parse_count(workers), **worker))
    return RoleMaster(two_node_job(), specs, max_restarts=2)


def deliver_all(master: RoleMaster, now: float = 0.0) -> dict[str, list[p.RoleAssignment]]:
    return {node: master.deliver(node, now)[0] for node in ("n0", "n1")}


def started(master: RoleMaster, node: str, assignment: p.RoleAssignment, port: int) -> None:
    master.report(p.RoleReport(node_id=node, role=assignment.role, rank=assignment.rank,
                               incarnation=assignment.incarnation, state="started", address=f"127.0.0.1:{port}"))


def exited(master: RoleMaster, node: str, assignment: p.RoleAssignment, code: int, tail: tuple = ()) -> list:
    return master.report(p.RoleReport(node_id=node, role=assignment.role, rank=assignment.rank,
                                      incarnation=assignment.incarnation, state="exited", exitcode=code,
                                      log_tail=list(tail), log_path="logs/roles/x.log"))


def running_job(master: RoleMaster) -> dict[tuple[str, int], tuple[str, p.RoleAssignment]]:
    """Start the PS, then the workers; return (role, rank) -> (node, assignment)."""
    master.advance()
    placed = {}
    for node, assignments in deliver_all(master).items():
        for assignment in assignments:
            started(master, node, assignment, 5000 + assignment.rank)
            placed[(assignment.role, assignment.rank)] = (node, assignment)
    for node, assignments in deliver_all(master).items():
        for assignment in assignments:
            started(master, node, assignment, 6000 + assignment.rank)
            placed[(assignment.role, assignment.rank)] = (node, assignment)
    return placed


def test_workers_wait_for_the_ps_address_then_spread_over_the_least_loaded_nodes() -> None:
    master = ps_job("3")
    master.advance()
    first = deliver_all(master)
    assert [(a.role, a.rank) for node in ("n0", "n1") for a in first[node]] == [("ps", 0)], "the PS first, alone"
    ps_node = next(node for node, listed in first.items() if listed)
    assert master.has_news("n0") is False and master.has_news("n1") is False
    started(master, ps_node, first[ps_node][0], 5000)
    workers = deliver_all(master)
    counts = {node: len(listed) for node, listed in workers.items()}
    assert counts[ps_node] == 1 and sum(counts.values()) == 3, "the node without the PS takes two workers"
    assert all(a.addresses == {"ps": ["127.0.0.1:5000"]} and a.world_size == 3 for a in sum(workers.values(), []))


def test_a_process_gets_its_roles_whole_cpus_as_threads_and_none_declared_leaves_it_to_the_agent() -> None:
    master = ps_job("2", cpus=2.5)
    placed = running_job(master)
    assert placed[("ps", 0)][1].threads == 0, "no cpus declared: the agent gives it one thread"
    assert {placed[("worker", rank)][1].threads for rank in (0, 1)} == {2}


def test_an_unanswered_assignment_is_sent_again_and_a_started_one_is_not() -> None:
    master = ps_job()
    master.advance()
    node, listed = next((n, a) for n, a in deliver_all(master, now=10.0).items() if a)
    assert master.deliver(node, 10.0 + REDELIVER_S / 2) == ([], [])
    again, _ = master.deliver(node, 10.0 + REDELIVER_S)
    assert again == listed, "no report came: the same assignment (same incarnation) again"
    started(master, node, listed[0], 5000)
    assert [a.role for a in master.deliver(node, 100.0)[0]] in ([], ["worker"], ["worker", "worker"]), \
        "the PS's assignment is not sent again once it started"


def test_an_order_not_reported_on_comes_due_again_and_wakes_its_nodes_parked_heartbeat() -> None:
    """A lost reply that carried an assignment: REDELIVER_S later the order counts as unsent again (``has_news``,
    ``news`` grows: the node's parked heartbeat answers with it), not at the node's next poll (16 s at 4096 nodes)."""
    master = ps_job()
    master.advance()
    node, listed = next((n, a) for n, a in deliver_all(master, now=10.0).items() if a)
    news = master.orders.news
    assert not master.orders.come_due(10.0 + REDELIVER_S / 2) and not master.has_news(node)
    assert master.orders.come_due(10.0 + REDELIVER_S) and master.has_news(node) and master.orders.news > news
    assert master.deliver(node, 10.0 + REDELIVER_S)[0] == listed, "sent again, whole"
    for assignment in listed:
        started(master, node, assignment, 5000 + assignment.rank)
    master.orders.come_due(100.0)
    keys = {(a.role, a.rank, a.incarnation) for a in listed}
    assert not keys & {(a.role, a.rank, a.incarnation) for a in master.deliver(node, 100.0)[0]}, \
        "reported on: done with (the workers placed since may go out)"


def test_a_failed_worker_is_placed_back_on_its_node_and_port_alone() -> None:
    master = ps_job()
    placed = running_job(master)
    node, worker1 = placed[("worker", 1)]
    events = exited(master, node, worker1, 1, ("Traceback", "RuntimeError: boom"))
    assert any(e.kind == "role_exited" and "RuntimeError: boom" in e.message for e in events)
    again = deliver_all(master)
    assert [(a.role, a.rank, a.port) for a in again[node]] == [("worker", 1, 6001)]
    assert again[node][0].incarnation > worker1.incarnation
    assert not any(again[other] for other in ("n0", "n1") if other != node), "nothing else restarts"
    late = exited(master, node, worker1, 1)
    assert [e.kind for e in late] == ["role_exited"], "a late report of the old process changes nothing"
    assert deliver_all(master, 1e9)[node] == again[node], "only the one restart, sent again"


def test_the_job_succeeds_once_the_workers_finished_and_the_ps_was_stopped() -> None:
    master = ps_job()
    placed = running_job(master)
    for rank in (0, 1):
        exited(master, *placed[("worker", rank)], 0)
    ps_node, ps = placed[("ps", 0)]
    stops = master.deliver(ps_node, 0.0)[1]
    assert [(s.role, s.rank, s.incarnation) for s in stops] == [("ps", 0, ps.incarnation)]
    assert master.job.status == RUNNING, "not before the PS has exited"
    events = exited(master, ps_node, ps, -15)
    assert master.job.status == SUCCEEDED and any(e.kind == "job_succeeded" for e in events)


def test_a_restart_job_policy_stops_every_process_and_starts_new_incarnations() -> None:
    master = ps_job(failure_policy=RESTART_JOB)
    placed = running_job(master)
    node, worker0 = placed[("worker", 0)]
    events = exited(master, node, worker0, 1)
    assert any(e.kind == "roles_restarted" for e in events)
    told = {n: master.deliver(n, 0.0) for n in ("n0", "n1")}
    stopped = {(s.role, s.rank) for _, stops in told.values() for s in stops}
    assert stopped == {("ps", 0), ("worker", 1)}, "every other process is stopped"
    fresh = [a for assignments, _ in told.values() for a in assignments]
    assert [(a.role, a.rank) for a in fresh] == [("ps", 0)], "the PS first again, the workers wait for it"
    assert fresh[0].incarnation > placed[("ps", 0)][1].incarnation


def test_a_role_out_of_restarts_fails_the_job_with_its_last_lines() -> None:
    master = ps_job()
    placed = running_job(master)
    node, worker = placed[("worker", 0)]
    for _ in range(3):
        exited(master, node, worker, 1, ("RuntimeError: boom",))
        worker = master.deliver(node, 1e9)[0][0] if master.job.status == RUNNING else worker
        if master.job.status == RUNNING:
            started(master, node, worker, 6000)
    assert master.job.status == FAILED
    assert "role worker has used its 2 restart(s)" in master.job.outcome and "RuntimeError: boom" in master.job.outcome


def test_scale_starts_the_lowest_free_rank_and_refuses_a_count_the_role_cannot_take() -> None:
    master = ps_job("1:3")
    running_job(master)
    master.scale("worker", 2)
    added = [a for listed in deliver_all(master).values() for a in listed]
    assert [(a.role, a.rank, a.world_size) for a in added] == [("worker", 1, 2)]
    with pytest.raises(ConfigError, match=r"role worker can run 1\.\.3 processes"):
        master.scale("worker", 4)


def test_the_roles_file_round_trips(tmp_path: Path) -> None:
    roles = (RoleSpec("ps", count=parse_count(2)),
             RoleSpec("worker", entrypoint="w.py", args=("--lr", "1"), count=parse_count("1:4"), memory_bytes=1 << 30))
    save_roles(tmp_path, roles)
    assert load_roles(tmp_path) == roles
    assert load_roles(tmp_path / "nothing") == ()
    (tmp_path / "roles.json").write_text("[{\"name\": 1}]")
    with pytest.raises(ConfigError, match="does not hold the job's roles"):
        load_roles(tmp_path)


def test_the_processes_of_a_lost_node_go_to_the_others_once_the_regroup_closes() -> None:
    master = ps_job()
    placed = running_job(master)
    lost_node = placed[("worker", 0)][0] if placed[("worker", 0)][0] != placed[("ps", 0)][0] else \
        placed[("worker", 1)][0]
    survivor = "n1" if lost_node == "n0" else "n0"
    master.node_lost(lost_node)
    assert master.deliver(lost_node, 0.0) == ([], []), "nothing is placed on the lost node"
    master.job.node_lost(lost_node, "left", 1.0)
    assert master.job.membership is None and master.advance() == [], "the restart waits for the regroup"
    master.job.join(survivor, "127.0.0.1", 1, 1002, 2.0)
    master.advance()
    moved = master.deliver(survivor, 0.0)[0]
    assert [a.role for a in moved] == ["worker"] and moved[0].port == 0, "a fresh port on the surviving node"


def test_a_restarted_master_takes_the_roles_back_from_the_saved_state() -> None:
    master = ps_job()
    master.advance()
    ps_node, ps_assignments = next((node, found) for node, found in deliver_all(master).items() if found)
    started(master, ps_node, ps_assignments[0], 5000)
    workers = deliver_all(master)  # the workers are assigned; one reports, the other's report is lost
    node, (first, *_) = next((node, found) for node, found in workers.items() if found)
    started(master, node, first, 6000)
    saved = json.loads(json.dumps(master.state()))  # through JSON, as the store keeps it

    again = RoleMaster(master.job, tuple(master.specs.values()), max_restarts=2)
    events = again.load_state(saved)
    assert "takes back 3 role process(es)" in events[0].message
    assert again.roles.addresses() == master.roles.addresses()
    assert any(again.has_news(n) for n in ("n0", "n1")), "what was not reported on goes out at once"
    resent = deliver_all(again, now=0.0)
    unreported = [a for found in resent.values() for a in found]
    assert [(a.role, a.rank) for a in unreported] == [("worker", 1 - first.rank)], "only the unreported is resent"
    other_node = next(n for n, found in resent.items() if found)
    assert again.report(p.RoleReport(node_id=other_node, role="worker", rank=1 - first.rank,
                                     incarnation=unreported[0].incarnation, state="started",
                                     address="127.0.0.1:6001"))
    assert deliver_all(again, now=10.0) == {"n0": [], "n1": []}, "reported now: not sent again"
    for worker_node, found in workers.items():
        for assignment in found:
            exited(again, worker_node, assignment, 0)
    assert again.job.status == RUNNING, "the PS still runs until it is stopped"
    stops = {n: again.deliver(n, 20.0)[1] for n in ("n0", "n1")}
    assert [(s.role, s.rank) for found in stops.values() for s in found] == [("ps", 0)]


def test_a_restarted_master_publishes_above_the_version_its_nodes_hold() -> None:
    """The state was saved at version v; the old master then published v + 1 (a process started) and the nodes
    hold it. The new master restores v: told that a node holds v + 1, its next version is v + 2, every address."""
    master = ps_job()
    master.advance()
    ps_node, ps_assignments = next((node, found) for node, found in deliver_all(master).items() if found)
    saved_version = master.published()[0]
    saved = json.loads(json.dumps(master.state()))
    started(master, ps_node, ps_assignments[0], 5000)
    held, addresses, _ = master.published()
    assert held == saved_version + 1 and addresses["ps"] == ["127.0.0.1:5000"]

    again = RoleMaster(master.job, tuple(master.specs.values()), max_restarts=2)
    again.load_state(saved)
    assert again.published()[0] == saved_version, "what was saved"
    assert not again.orders.outrank(saved_version - 1), "a node behind is brought up by the next version as it is"
    assert again.orders.outrank(held)
    version, addresses, _ = again.published()
    assert version == held + 1 and addresses == again.roles.addresses()
    assert not again.orders.outrank(held), "once above, a node holding the older version is simply behind"


def test_a_repeated_started_report_records_nothing_new() -> None:
    master = ps_job()
    master.advance()
    node, (ps,) = next((node, found) for node, found in deliver_all(master).items() if found)
    started(master, node, ps, 5000)
    assert master.report(p.RoleReport(node_id=node, role="ps", rank=0, incarnation=ps.incarnation, state="started",
                                      address="127.0.0.1:5000")) == []


def test_a_started_process_is_named_with_its_node_and_pid() -> None:
    master = ps_job()
    master.advance()
    node, (ps,) = next((node, found) for node, found in deliver_all(master).items() if found)
    events = master.report(p.RoleReport(node_id=node, role="ps", rank=0, incarnation=ps.incarnation, state="started",
                                        address="127.0.0.1:5000", pid=4242))
    assert [e.message for e in events if e.kind == "role_started"] == [f"ps 0 is running at 127.0.0.1:5000 ({node}, "
                                                                       "pid 4242)"]
