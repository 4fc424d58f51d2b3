"""The training master as the job's membership changes (pure): a rank that left is forgotten, so the ranks that
run decide when a version is applied and trusted; a rank restarted as a new incarnation counts where it resumes;
each role's switch step is planned from its own ranks; in a job of roles a restart version restarts the roles
that declared the config, and a rollback is refused."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from convoy.control.protocol import training as tp
from convoy.control.training.versions import ConfigHistory
from convoy.control.training.master import TRUST_STEPS, TrainMaster
from convoy.control.training.proposals import Kept
from convoy.errors import ConflictError
from convoy.worker.live_config import LiveConfig, declared_fields, hot, restart


@dataclass
class Config:
    lr: float = hot(0.1)
    batch_size: int = restart(32)


KINDS = {decl.name: decl.kind for decl in declared_fields(Config)}


def declared(*roles: str) -> TrainMaster:
    master = TrainMaster(ConfigHistory())
    for role in roles or ("default",):
        master.declare(tp.ConfigDeclare(role=role, rank=0, incarnation=1, fields=declared_fields(Config)))
    return master


def report(master: TrainMaster, task: str, step: int, now: float, expected: int, incarnation: int = 1,
           step_time: float = 0.05, **extra: object) -> list:
    """``task`` (``role:rank``) finished ``step``, sent at ``now`` (the master's clock, as the worker's + 1000)."""
    role, _, rank = task.partition(":")
    point = tp.StatusPoint(step=step, time=1000.0 + now, loss=1.0, step_time_s=step_time)
    request = tp.StatusReport(role=role, rank=int(rank), incarnation=incarnation, sent_at=1000.0 + now,
                              points=[point], **extra)
    return master.report(request, now, expected)[1]


def shrunk_to_two(master: TrainMaster) -> None:
    """A node of two ranks is lost: round 2 runs ranks 0 and 1 only."""
    master.round_started(2)
    master.retain({"default:0": 2, "default:1": 2})


def test_a_version_the_ranks_that_run_ran_long_enough_is_trusted_after_a_shrink() -> None:
    master = declared()
    for rank in range(4):
        report(master, f"default:{rank}", 100, now=10.0, expected=4)
    shrunk_to_two(master)
    assert sorted(master.tasks) == ["default:0", "default:1"], "ranks 2 and 3 left with their node"
    for rank in (0, 1):
        report(master, f"default:{rank}", 101, now=12.0, expected=2, incarnation=2)
    version, _ = master.set(tp.ConfigSet(values={"lr": 0.05}), now=12.0)
    events = []
    for rank in (0, 1):
        events += report(master, f"default:{rank}", version.at_step + TRUST_STEPS, now=14.0, expected=2,
                         incarnation=2, switched={"2": version.at_step})
    assert [e.kind for e in events] == ["config_applied"] and "all 2 ranks" in events[0].message
    assert master.worker_failed(now=14.1) == [], "a version both ranks ran for TRUST_STEPS steps is not reverted"
    assert version.trusted and master.history.current is version


def test_a_switch_of_a_rank_that_left_does_not_count() -> None:
    master = declared()
    for rank in range(4):
        report(master, f"default:{rank}", 10, now=1.0, expected=4)
    version, _ = master.set(tp.ConfigSet(values={"lr": 0.05}), now=1.0)
    at = {"2": version.at_step}
    events = report(master, "default:2", version.at_step, now=2.0, expected=4, switched=at)
    events += report(master, "default:3", version.at_step, now=2.0, expected=4, switched=at)
    shrunk_to_two(master)
    events += report(master, "default:0", version.at_step, now=3.0, expected=2, incarnation=2, switched=at)
    assert events == [], "of the two ranks that run, only rank 0 switched"
    events = report(master, "default:1", version.at_step, now=3.0, expected=2, incarnation=2, switched=at)
    assert [e.kind for e in events] == ["config_applied"] and "all 2 ranks" in events[0].message


def test_a_restarted_process_counts_where_it_resumes_and_a_scaled_away_one_is_forgotten() -> None:
    master = declared("worker")
    for task in ("worker:0", "worker:1"):
        report(master, task, 50, now=1.0, expected=2, step_time=0.1)
    master.retain({"worker:0": 5})  # worker 1 scaled away; worker 0 failed and runs as incarnation 5
    assert list(master.tasks) == ["worker:0"] and master.configured_ranks() == 1
    version, _ = master.set(tp.ConfigSet(values={"lr": 0.05}), now=31.0)
    assert 50 + 3 < version.at_step <= 50 + 3 + 2, "30 s later worker 0 resumes near step 50, not 300 steps on"


def test_each_role_switches_at_a_step_planned_from_its_own_ranks() -> None:
    master = declared("actor", "learner")
    report(master, "actor:0", 1000, now=5.0, expected=3, step_time=0.01)
    report(master, "actor:1", 990, now=5.0, expected=3, step_time=0.01)
    report(master, "learner:0", 10, now=5.0, expected=3, step_time=0.5)
    version, events = master.set(tp.ConfigSet(values={"lr": 0.05}), now=5.0)
    # the push's 0.3 s is 30 actor steps and 1 learner step; the learner does not wait for step 1031
    assert (version.step_for("actor"), version.step_for("learner")) == (1031, 12)
    assert "applied in place from step 1031 of actor, 12 of learner" in events[0].message
    events = []
    for task, step in (("actor:0", 1031), ("actor:1", 1031), ("learner:0", 12)):
        events += report(master, task, step, now=6.0, expected=3, switched={"2": step})
    assert [e.kind for e in events] == ["config_applied"], "every rank switched at its role's step"

    cfg = Config()
    learner = LiveConfig(cfg, master.config_state(), None, None, KINDS, role="learner")
    learner.seek(0)
    assert learner.boundary(10) is None and cfg.lr == 0.1
    assert learner.boundary(11) is None and cfg.lr == 0.05, "the learner's step 12 runs with version 2"
    with pytest.raises(ConflictError, match="the earliest step every rank of role actor can still switch at is"):
        master.set(tp.ConfigSet(values={"lr": 0.06}), now=6.0, at_step=500)


def test_a_restart_field_in_a_job_of_roles_restarts_the_roles_that_declared_the_config() -> None:
    master = declared("actor", "learner")
    master.job_of_roles = True
    report(master, "actor:0", 100, now=1.0, expected=3, step_time=0.01)
    report(master, "learner:0", 10, now=1.0, expected=3, step_time=0.5)
    report(master, "evaluator:0", 3, now=1.0, expected=3)  # reports its status, declares no config
    assert master.configured_ranks() == 2
    version, events = master.set(tp.ConfigSet(values={"batch_size": 64}), now=1.0)
    assert "applied by a restart of its roles" in events[0].message
    for task in ("actor:0", "learner:0"):
        step = version.step_for(task.partition(":")[0]) - 1
        report(master, task, step, now=2.0, expected=2, parked=step)
    master.tick(2.0, master.configured_ranks())
    assert master.restart_due and "every rank finished the step before it" in master.restart_due
    assert master.restart_roles() == ["actor", "learner"]
    master.roles_restarted(["actor", "learner"])
    assert master.restart_due is None and version.status == "active"
    assert [t.stale for t in master.tasks.values()] == [True, True, False]
    assert TrainMaster.from_state(master.state_json(), {}).restart_roles() == ["actor", "learner"]

    master.proposals.kept.append(Kept(1, "divergence", 40, 35, "loss 5x its minimum", {"lr": 0.1}, 29, False))
    with pytest.raises(ConflictError, match="a job of roles cannot roll back"):
        master.apply_proposal(1, "ann", now=3.0)
