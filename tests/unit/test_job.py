"""The job state machine: failures, restarts, success, timeouts. Pure calls with explicit times."""

from __future__ import annotations

from job_states import failure, join_all, kinds, make_job

from convoy.control.job import FAILED, MAX_PORT_RETRIES, RUNNING, SUCCEEDED


def test_first_round_closes_with_one_console_event() -> None:
    job = make_job()
    events = join_all(job, now=0.0)
    assert kinds(events) == ["node_joined", "node_joined", "round_closed"]
    closed = events[-1]
    assert closed.console and closed.round_id == 1
    assert closed.message == "round 1: 2 nodes, world size 4 [node0=10.0.0.1x2, node1=10.0.0.2x2]"
    assert job.tick(1.0) == [], "a closed round is announced once"


def test_worker_failure_restarts_the_job_in_a_new_round() -> None:
    job = make_job(max_restarts=3)
    join_all(job, now=0.0)
    events = job.worker_exited(failure("n1", 1, rank=3, local_rank=1, exitcode=7), now=5.0)
    assert kinds(events) == ["worker_failed", "restart"]
    assert events[0].message == "rank 3 (node 1, local rank 1) exited with code 7 in round 1"
    assert events[0].console and events[0].node_id == "n1"
    assert events[1].message == "restart 1/3: opening round 2" and events[1].console
    assert job.status == RUNNING and job.restart_count == 1
    assert job.round_id == 2 and job.membership is None, "every node must join the new round"
    events = join_all(job, now=6.0)
    assert kinds(events)[-1] == "round_closed" and events[-1].round_id == 2
    assert job.membership is not None and job.membership.round_id == 2


def test_a_signal_death_is_described_by_the_signal_name() -> None:
    job = make_job()
    join_all(job, now=0.0)
    events = job.worker_exited(failure("n0", 1, rank=1, local_rank=1, exitcode=None, signal="SIGKILL"), now=1.0)
    assert events[0].message == "rank 1 (node 0, local rank 1) was killed by SIGKILL in round 1"


def test_reports_from_an_old_round_are_ignored() -> None:
    job = make_job(max_restarts=3)
    join_all(job, now=0.0)
    job.worker_exited(failure("n1", 1, rank=2), now=1.0)
    # the other node's workers died of the same fault a moment later, in the old round
    events = job.worker_exited(failure("n0", 1, rank=0), now=1.1)
    assert kinds(events) == ["stale_report"]
    assert job.restart_count == 1 and job.round_id == 2
    join_all(job, now=2.0)
    assert kinds(job.worker_exited(failure("n0", 1, rank=0), now=3.0)) == ["stale_report"]
    assert job.restart_count == 1 and job.membership is not None, "the running round 2 is untouched"
    assert job.node_done("n0", 1) == [] and "n0" not in job.done_nodes


def test_restarts_exhausted_fails_naming_rank_exit_code_and_log_tail() -> None:
    job = make_job(max_restarts=1)
    join_all(job, now=0.0)
    job.worker_exited(failure("n1", 1, rank=2, exitcode=3), now=1.0)
    join_all(job, now=2.0)
    last = failure("n1", 2, rank=3, local_rank=1, exitcode=3, log_path="/runs/x/logs/round2/rank3.log",
                   log_tail=["epoch 1 done", "RuntimeError: disk full"])
    events = job.worker_exited(last, now=3.0)
    assert kinds(events) == ["worker_failed", "job_failed"]
    assert job.status == FAILED and job.restart_count == 1
    outcome = job.outcome
    assert outcome.startswith("job failed: rank 3 (node 1, local rank 1) exited with code 3")
    assert "no restarts left (1 of 1 used)" in outcome
    assert "last lines of /runs/x/logs/round2/rank3.log:" in outcome
    assert "    epoch 1 done\n    RuntimeError: disk full" in outcome
    assert events[-1].message == outcome and events[-1].console


def test_signal_death_with_no_restarts_left_names_the_signal() -> None:
    job = make_job(max_restarts=0)
    join_all(job, now=0.0)
    job.worker_exited(failure("n0", 1, rank=0, exitcode=None, signal="SIGSEGV"), now=1.0)
    assert job.status == FAILED
    assert "rank 0 (node 0, local rank 0) was killed by SIGSEGV" in job.outcome
    assert job.restart_count == 0


def test_a_worker_that_cannot_start_is_not_retried() -> None:
    job = make_job(max_restarts=5)
    join_all(job, now=0.0)
    events = job.worker_exited(failure("n0", 1, rank=1, local_rank=1, start_failed=True), now=1.0)
    assert kinds(events) == ["worker_failed", "job_failed"]
    assert job.status == FAILED and job.restart_count == 0
    assert "could not be started" in job.outcome and "not retried" in job.outcome


def test_job_succeeds_when_every_member_node_is_done() -> None:
    job = make_job()
    join_all(job, now=0.0)
    assert job.node_done("n0", 1) == []
    assert job.status == RUNNING
    events = job.node_done("n1", 1)
    assert kinds(events) == ["job_succeeded"]
    assert job.status == SUCCEEDED and job.outcome == "job succeeded: all 4 workers finished"


def test_done_nodes_are_forgotten_when_the_job_restarts() -> None:
    job = make_job()
    join_all(job, now=0.0)
    job.node_done("n0", 1)
    job.worker_exited(failure("n1", 1, rank=2), now=1.0)
    join_all(job, now=2.0)
    assert job.node_done("n1", 2) == [] and job.status == RUNNING, "n0's round-1 success does not count"
    assert kinds(job.node_done("n0", 2)) == ["job_succeeded"]


def test_node_done_for_a_round_that_is_not_closed_is_ignored() -> None:
    job = make_job()
    join_all(job, now=0.0, nodes=("n0",))
    assert job.node_done("n0", 1) == [] and job.done_nodes == set()


def test_join_timeout_fails_the_job() -> None:
    job = make_job(min_nodes=2, max_nodes=2, join_timeout_s=10.0)
    join_all(job, now=0.0, nodes=("n0",))
    assert job.tick(9.0) == [] and job.status == RUNNING
    events = job.tick(10.5)
    assert kinds(events) == ["job_failed"]
    assert job.status == FAILED
    assert "round 1 waited 10 s with 1 of at least 2 nodes" in job.outcome
    assert job.tick(20.0) == [], "an ended job does not fail twice"


def test_join_timeout_counts_from_when_the_new_round_opened() -> None:
    job = make_job(join_timeout_s=10.0)
    join_all(job, now=0.0)
    job.worker_exited(failure("n0", 1, rank=0), now=100.0)
    assert job.tick(109.0) == []
    assert kinds(job.tick(110.5)) == ["job_failed"]
    assert "round 2 waited" in job.outcome


def test_tick_closes_a_round_whose_window_passed() -> None:
    job = make_job(min_nodes=1, max_nodes=2, wait_s=3.0)
    join_all(job, now=0.0, nodes=("n0",))
    assert job.tick(2.0) == []
    events = job.tick(3.0)
    assert kinds(events) == ["round_closed"] and job.membership is not None


def test_abort_fails_a_running_job_once() -> None:
    job = make_job()
    join_all(job, now=0.0)
    events = job.abort("interrupted by SIGINT")
    assert kinds(events) == ["job_failed"] and job.outcome == "job failed: interrupted by SIGINT"
    assert job.abort("again") == []
    assert job.outcome == "job failed: interrupted by SIGINT"


def test_an_ended_job_ignores_further_input() -> None:
    job = make_job()
    join_all(job, now=0.0)
    job.node_done("n0", 1)
    job.node_done("n1", 1)
    assert job.status == SUCCEEDED
    assert kinds(job.worker_exited(failure("n0", 1, rank=0), now=2.0)) == ["stale_report"]
    assert job.join("n0", "10.0.0.1", 2, 29500, now=3.0)[1] == []
    assert job.node_lost("n1", "gone", now=4.0) == []
    assert job.status == SUCCEEDED and job.restart_count == 0


def test_rank_0_finding_its_port_taken_opens_a_new_round_without_a_restart() -> None:
    job = make_job(max_restarts=0)
    join_all(job, now=0.0)
    events = job.worker_exited(failure("n0", 1, rank=0, port_in_use=True), now=1.0)
    assert kinds(events) == ["worker_failed", "port_retry"] and job.status == RUNNING
    assert "MASTER_PORT 29500 was taken" in events[1].message and "not a restart" in events[1].message
    assert events[1].console and job.round_id == 2 and job.membership is None
    assert (job.restart_count, job.port_retries) == (0, 1)
    join_all(job, now=2.0)
    assert job.membership is not None and job.membership.round_id == 2


def test_port_retries_are_bounded_then_count_as_failures() -> None:
    job = make_job(max_restarts=1)
    join_all(job, now=0.0)
    for round_id in range(1, MAX_PORT_RETRIES + 1):
        assert "port_retry" in kinds(job.worker_exited(failure("n0", round_id, rank=0, port_in_use=True), now=1.0))
        join_all(job, now=2.0)
    events = job.worker_exited(failure("n0", job.round_id, rank=0, port_in_use=True), now=3.0)
    assert kinds(events) == ["worker_failed", "restart"] and job.restart_count == 1


