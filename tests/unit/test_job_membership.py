"""The job state machine when its nodes change: a lost node regroups without it and spends no restart, a new one
grows the job, a flapping node is excluded past its regroup budget, an infrastructure fault regroups the same
nodes, and a failure that reads as a lost peer waits for news of a lost node. Pure calls with explicit times."""

from __future__ import annotations

from job_states import NODES, failure, join_all, kinds, make_job

from convoy.control.job import FAILED, PEER_LOSS_WAIT_S, RUNNING, Event, Job


def test_losing_a_member_node_regroups_without_it_and_spends_no_restart() -> None:
    job = make_job(min_nodes=1, max_nodes=2, wait_s=100.0)
    join_all(job, now=0.0)
    assert job.membership is not None and job.membership.world_size == 4
    events = job.node_lost("n1", "sent no heartbeat for 30 s", now=40.0)
    assert kinds(events) == ["regroup"] and job.round_id == 2 and job.membership is None
    assert events[0].message == "node n1 sent no heartbeat for 30 s: going on with 1 nodes (round 2)"
    assert events[0].console, "the console says why the job regrouped"
    assert (job.restart_count, job.regroup_count) == (0, 1)
    events = join_all(job, now=41.0, nodes=("n0",))
    assert kinds(events) == ["node_joined", "round_closed"], "the survivor is back: no need to wait out the window"
    assert job.membership is not None and job.membership.node_ids() == {"n0"} and job.membership.world_size == 2


def test_node_loss_does_not_spend_the_restart_budget() -> None:
    job = make_job(max_restarts=0, min_nodes=1, max_nodes=2, wait_s=100.0)
    join_all(job, now=0.0)
    job.node_lost("n1", "left (agent killed by SIGKILL)", now=1.0)
    assert job.status == RUNNING
    join_all(job, now=2.0, nodes=("n0",))
    job.worker_exited(failure("n0", 2, rank=0), now=3.0)
    assert job.status == FAILED and "no restarts left (0 of 0 used)" in job.outcome


def test_losing_a_node_below_min_waits_for_a_replacement_then_times_out() -> None:
    job = make_job(min_nodes=2, max_nodes=2, join_timeout_s=10.0)
    join_all(job, now=0.0)
    job.node_lost("n1", "left (agent killed by SIGKILL)", now=1.0)
    join_all(job, now=2.0, nodes=("n0",))
    assert job.membership is None, "one node is below MIN 2: the round stays open"
    assert job.tick(10.5) == []
    assert kinds(job.tick(11.5)) == ["job_failed"] and "with 1 of at least 2 nodes" in job.outcome


def test_a_replacement_node_joins_the_regroup_round() -> None:
    job = make_job(min_nodes=2, max_nodes=2)
    join_all(job, now=0.0)
    job.node_lost("n1", "left (agent killed by SIGKILL)", now=1.0)
    job.join("n0", "10.0.0.1", 2, 29500, now=2.0)
    _, events = job.join("n9", "10.0.0.9", 2, 29500, now=3.0)
    assert kinds(events) == ["node_joined", "round_closed"]
    assert job.membership is not None and [m.node_id for m in job.membership.members] == ["n0", "n9"]


def test_a_new_node_grows_a_running_job() -> None:
    job = make_job(min_nodes=1, max_nodes=2, wait_s=5.0)
    join_all(job, now=0.0, nodes=("n0",))
    job.tick(5.0)
    assert job.membership is not None and job.membership.node_ids() == {"n0"}
    round_id, events = job.join("n1", "10.0.0.2", 2, 29500, now=10.0)
    assert kinds(events) == ["node_joined", "regroup"] and round_id == 2
    assert events[1].message == "node n1 joins: growing to 2 nodes (round 2)"
    assert job.membership is None and (job.restart_count, job.regroup_count) == (0, 1)
    _, events = job.join("n0", "10.0.0.1", 2, 29500, now=11.0)
    assert kinds(events) == ["node_joined", "round_closed"], "closes once the old member is back too"
    assert job.membership is not None
    assert [m.node_id for m in job.membership.members] == ["n0", "n1"], "n0 keeps node rank 0"


def test_a_node_joining_a_full_job_waits_without_disturbing_it() -> None:
    job = make_job(min_nodes=2, max_nodes=2)
    join_all(job, now=0.0)
    round_id, events = job.join("n9", "10.0.0.9", 2, 29500, now=5.0)
    assert kinds(events) == ["node_joined"] and round_id == 2
    assert job.round_id == 1 and job.membership is not None and job.regroup_count == 0


def test_growing_the_job_settles_on_both_nodes_even_with_a_zero_wait_window() -> None:
    job = make_job(min_nodes=1, max_nodes=2, wait_s=0.0)
    job.join("n0", "10.0.0.1", 2, 29500, now=0.0)
    job.join("n1", "10.0.0.2", 2, 29500, now=1.0)
    now = 2.0
    for _ in range(5):  # agents do what they do: a node outside the running round joins again
        membership = job.membership
        if membership is not None and len(membership.members) == 2:
            break
        for node_id in ("n0", "n1"):
            if (membership is None or node_id not in membership.node_ids()) and not job.rendezvous.is_waiting(node_id):
                job.join(node_id, "10.0.0.1", 2, 29500, now=now)
                now += 0.1
    assert job.membership is not None and job.membership.node_ids() == {"n0", "n1"}, f"round {job.round_id}"


def test_losing_a_node_that_is_not_a_member_only_forgets_it() -> None:
    job = make_job(min_nodes=2, max_nodes=2)
    join_all(job, now=0.0, nodes=("n0",))
    events = job.node_lost("n0", "left (interrupted by SIGINT)", now=1.0)
    assert kinds(events) == ["node_left"]
    assert events[0].message == "node n0 left (interrupted by SIGINT)"
    assert job.rendezvous.joined == [] and job.restart_count == 0 and job.round_id == 1


def test_a_member_rejoining_while_its_round_runs_means_its_agent_restarted() -> None:
    job = make_job()
    join_all(job, now=0.0)
    round_id, events = job.join("n1", "10.0.0.2", 2, 29500, now=5.0)
    assert kinds(events)[:3] == ["agent_restarted", "restart", "node_joined"]
    assert round_id == 2 and job.restart_count == 1


def test_a_member_whose_same_agent_repeats_its_join_keeps_its_place() -> None:
    job = make_job()
    join_all(job, now=0.0)
    round_id, events = job.join("n1", "10.0.0.2", 2, 29500, now=5.0, same_agent=True)
    assert kinds(events) == ["join_repeated"]
    assert round_id == 1 and job.restart_count == 0 and job.membership is not None


def flap(job: Job, node_id: str, now: float) -> list[Event]:
    """The node's agent dies (its node is lost), comes back and joins the running job again."""
    host, nproc = NODES[node_id]
    events = job.node_lost(node_id, "left (agent killed by SIGKILL)", now)
    events += job.join("n0", "10.0.0.1", 2, 29500, now + 0.1)[1]
    events += job.join(node_id, host, nproc, 29500, now + 0.2)[1]
    events += job.join("n0", "10.0.0.1", 2, 29500, now + 0.3)[1]
    return events


def test_a_flapping_node_is_excluded_once_over_its_regroup_budget() -> None:
    job = make_job(min_nodes=1, max_nodes=2)
    job.max_regroups, job.regroup_window_s = 4, 60.0
    join_all(job, now=0.0)
    assert "node_excluded" not in kinds(flap(job, "n1", 1.0) + flap(job, "n1", 2.0)), "4 regroups: within budget"
    assert job.membership is not None and job.membership.node_ids() == {"n0", "n1"}
    events = job.node_lost("n1", "left (agent killed by SIGKILL)", 3.0)
    assert kinds(events) == ["regroup", "node_excluded"]
    excluded = events[1]
    assert excluded.console and excluded.node_id == "n1"
    assert "node n1 caused 5 regroups in 60 s (at most 4 allowed)" in excluded.message
    assert job.refusal("n1") is not None and "--max-regroups" in job.refusal("n1")  # type: ignore[operator]
    round_id, events = job.join("n1", "10.0.0.2", 2, 29500, 3.5)
    assert kinds(events) == ["join_refused"] and not job.rendezvous.is_waiting("n1")
    job.join("n0", "10.0.0.1", 2, 29500, 4.0)
    assert job.status == RUNNING and job.membership is not None and job.membership.node_ids() == {"n0"}
    assert job.restart_count == 0 and job.refusal("n0") is None, "the job goes on with the others"


def test_regroups_older_than_the_window_are_forgiven() -> None:
    job = make_job(min_nodes=1, max_nodes=2)
    job.max_regroups, job.regroup_window_s = 2, 10.0
    join_all(job, now=0.0)
    for start in (1.0, 20.0, 40.0, 60.0):
        assert "node_excluded" not in kinds(flap(job, "n1", start)), f"flap at {start}: 2 regroups per 10 s"
    assert job.membership is not None and job.membership.node_ids() == {"n0", "n1"}


def test_a_node_that_grows_the_job_too_often_is_refused_before_it_disturbs_it() -> None:
    job = make_job(min_nodes=1, max_nodes=2)
    job.max_regroups, job.regroup_window_s = 3, 60.0
    join_all(job, now=0.0)
    flap(job, "n1", 1.0)
    job.node_lost("n1", "left (agent killed by SIGKILL)", 2.0)
    job.join("n0", "10.0.0.1", 2, 29500, 2.1)
    round_before = job.round_id
    _, events = job.join("n1", "10.0.0.2", 2, 29500, 2.2)
    assert kinds(events) == ["node_excluded"] and job.round_id == round_before, "no third regroup"
    assert job.refusal("n1") is not None and job.membership is not None and job.membership.node_ids() == {"n0"}


def test_excluding_a_node_below_min_fails_the_job_with_that_reason() -> None:
    job = make_job(min_nodes=2, max_nodes=2)
    job.max_regroups, job.regroup_window_s = 1, 60.0
    join_all(job, now=0.0)
    job.node_lost("n1", "left (agent killed by SIGKILL)", 1.0)
    job.join("n1", "10.0.0.2", 2, 29500, 1.1)
    job.join("n0", "10.0.0.1", 2, 29500, 1.2)
    events = job.node_lost("n1", "left (agent killed by SIGKILL)", 2.0)
    assert kinds(events)[-2:] == ["node_excluded", "job_failed"]
    assert job.status == FAILED and "node n1 caused 2 regroups" in job.outcome and "MIN 2" in job.outcome


def test_a_worker_ended_by_an_infrastructure_fault_regroups_the_same_nodes_spending_no_restart() -> None:
    job = make_job(max_restarts=0)
    job.max_regroups = 2
    join_all(job, now=0.0)
    cause = "the fork server of node n1 died (SIGKILL)"
    events = job.worker_exited(failure("n1", 1, rank=3, local_rank=1, exitcode=None, signal="SIGKILL",
                                       infrastructure=cause), now=5.0)
    assert kinds(events) == ["worker_failed", "regroup"]
    assert [e.console for e in events] == [False, True], "one line names the fault"
    assert events[0].message == ("rank 3 (node 1, local rank 1) was killed by SIGKILL in an infrastructure fault "
                                 f"({cause}) in round 1")
    assert events[1].message == f"infrastructure fault: {cause}; the same 2 node(s) regroup, no restart spent (round 2)"
    assert job.status == RUNNING and job.restart_count == 0 and job.regroup_count == 1
    assert kinds(job.worker_exited(failure("n1", 1, rank=2, infrastructure=cause), now=5.1)) == ["stale_report"], \
        "the same fault's other workers belong to the ended round"
    join_all(job, now=6.0)
    job.worker_exited(failure("n1", 2, rank=3, infrastructure=cause), now=7.0)
    join_all(job, now=8.0)
    events = job.worker_exited(failure("n1", 3, rank=3, infrastructure=cause), now=9.0)
    assert "node_excluded" in kinds(events), "a third fault in the window is over the node's budget of 2"
    assert job.refusal("n1") is not None and job.restart_count == 0


def test_an_infrastructure_fault_of_a_job_of_roles_counts_in_the_nodes_regroup_budget() -> None:
    job = make_job()
    job.max_regroups = 1
    join_all(job, now=0.0)
    assert job.infrastructure_fault("n0", "the fork server of node n0 died", 1.0) == []
    assert job.round_id == 1 and job.regroup_count == 0, "no round: the roles' processes start again in this one"
    events = job.infrastructure_fault("n0", "the fork server of node n0 died", 2.0)
    assert "node_excluded" in kinds(events) and job.refusal("n0") is not None


def test_a_failure_that_reads_as_a_lost_peer_waits_for_news_of_a_lost_node_before_it_costs_a_restart() -> None:
    """A node's agent killed with its workers: its peers on the other node fail for want of them a moment before
    its launcher (or its silence) says the node is gone. The loss then regroups, spending no restart."""
    job = make_job(max_restarts=3, min_nodes=1, wait_s=1.0)
    join_all(job, now=0.0)
    assert job.round_id == 1 and job.membership is not None and len(job.membership.members) == 2
    events = job.worker_exited(failure("n0", 1, rank=0, peer_lost=True), now=5.0)
    assert kinds(events) == ["worker_failed"] and events[0].console, "the failure is named at once"
    assert job.tick(5.0 + PEER_LOSS_WAIT_S / 2) == [] and job.round_id == 1, "held for news of a lost node"
    events = job.node_lost("n1", "left (agent killed by SIGKILL)", 5.5)
    assert "regroup" in kinds(events) and job.restart_count == 0
    assert job.tick(5.0 + 2 * PEER_LOSS_WAIT_S) == [], "the held failure belonged to the regroup: no restart"
    assert job.restart_count == 0 and job.held_failure is None


def test_a_held_lost_peer_failure_restarts_the_job_when_no_node_was_lost() -> None:
    job = make_job(max_restarts=3)
    join_all(job, now=0.0)
    job.worker_exited(failure("n0", 1, rank=0, peer_lost=True), now=5.0)
    assert job.tick(5.0 + PEER_LOSS_WAIT_S - 0.01) == []
    events = job.tick(5.0 + PEER_LOSS_WAIT_S)
    assert "restart" in kinds(events) and job.restart_count == 1 and job.round_id == 2
    join_all(job, now=8.0)
    job.worker_exited(failure("n1", 2, rank=3, peer_lost=True), now=9.0)
    events = job.worker_exited(failure("n0", 2, rank=0, exitcode=7), now=9.1)
    assert "restart" in kinds(events) and job.restart_count == 2, "a failure of the workers' own does not wait"
    assert job.held_failure is None


def test_a_job_whose_lost_nodes_are_heard_of_later_holds_a_lost_peer_failure_longer() -> None:
    """On Ray a lost node is news when Ray reports its agent's actor dead: the master waits longer for it."""
    job = make_job(max_restarts=3)
    job.peer_loss_wait_s = 6.0
    join_all(job, now=0.0)
    job.worker_exited(failure("n0", 1, rank=0, peer_lost=True), now=5.0)
    assert job.tick(5.0 + PEER_LOSS_WAIT_S + 1.0) == [] and job.restart_count == 0
    assert "regroup" in kinds(job.node_lost("n1", "agent lost with its Ray node", 9.0)) and job.restart_count == 0
    assert job.tick(20.0) == [] and job.restart_count == 0
