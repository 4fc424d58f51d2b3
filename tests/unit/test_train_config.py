"""The training config's schema, values and versions (pure), and the master's side of it: the step a change
takes effect at, restart versions, reverts, and refusals that change nothing."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from convoy.control.protocol import training as tp
from convoy.control.training.versions import ConfigHistory, FieldSpec, Schema, parse_assignments
from convoy.control.training.master import TrainMaster
from convoy.errors import ConfigError, ConflictError
from convoy.worker.live_config import (LiveConfig, config_file, declared_fields, effective, generation_file, hot,
                                       restart, write_config)


@dataclass
class Config:
    lr: float = hot(0.1, min=0.0, max=10.0)
    clip: float = hot(0.0)
    mode: str = hot("adam", choices=("adam", "sgd"))
    batch_size: int = restart(32, min=1)
    shuffle: bool = True


def schema() -> Schema:
    return Schema(tuple(FieldSpec(d.name, d.type, d.kind, d.default, d.minimum, d.maximum, tuple(d.choices), d.doc)
                        for d in declared_fields(Config)))


def declared(overrides: dict[str, str] | None = None) -> TrainMaster:
    master = TrainMaster(ConfigHistory(overrides))
    fields = declared_fields(Config)
    master.declare(tp.ConfigDeclare(role="default", rank=0, incarnation=1, fields=fields))
    return master


def report(master: TrainMaster, rank: int, step: int, now: float, expected: int = 2, incarnation: int = 1,
           **extra: object) -> list:
    point = tp.StatusPoint(step=step, time=1000.0 + step * 0.05, loss=1.0, step_time_s=0.05)
    request = tp.StatusReport(role="default", rank=rank, incarnation=incarnation, sent_at=1000.0 + step * 0.05,
                              points=[point], **extra)
    return master.report(request, now, expected)[1]


def test_the_schema_comes_from_the_dataclass_and_unmarked_fields_are_restart_fields() -> None:
    kinds = {spec.name: (spec.type, spec.kind) for spec in schema().fields}
    assert kinds == {"lr": ("float", "hot"), "clip": ("float", "hot"), "mode": ("str", "hot"),
                     "batch_size": ("int", "restart"), "shuffle": ("bool", "restart")}


@pytest.mark.parametrize(("values", "named"), [
    ({"lr": "abc"}, "'lr' is float"), ({"lr": "11"}, "above its maximum 10"), ({"lr": "-1"}, "below its minimum"),
    ({"batch_size": "1.5"}, "'batch_size' is int"), ({"mode": "adagrad"}, "not one of ['adam', 'sgd']"),
    ({"lr": "nan"}, "not a finite number"), ({"shuffle": "maybe"}, "'shuffle' is bool"),
    ({"learning_rate": "0.1"}, "no field 'learning_rate' (its fields: batch_size, clip, lr, mode, shuffle)"),
    ({"lr": True}, "'lr' is float"),
])
def test_bad_values_name_the_field(values: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=".*") as refused:
        schema().parse(values)
    assert named in str(refused.value)


def test_values_are_typed_from_text_and_json() -> None:
    assert schema().parse({"lr": "0.5", "batch_size": "64", "shuffle": "off", "clip": 1}) == \
        {"lr": 0.5, "batch_size": 64, "shuffle": False, "clip": 1.0}
    assert parse_assignments(["lr=0.5", " clip = 1 "]) == {"lr": "0.5", "clip": "1"}
    with pytest.raises(ConfigError, match="'lr' is not KEY=VALUE"):
        parse_assignments(["lr"])


def test_the_job_overrides_make_version_one_and_a_bad_override_is_named() -> None:
    master = declared({"lr": "0.2"})
    assert master.history.current.values["lr"] == 0.2 and master.history.current.number == 1
    with pytest.raises(ConfigError, match="--set value"):
        declared({"lr": "x"})
    other = tp.ConfigDeclare(role="default", rank=1, incarnation=1, fields=declared_fields(Config)[:2])
    with pytest.raises(ConflictError, match="other than the one default:0 declared"):
        master.declare(other)


def test_a_hot_change_is_planned_past_every_ranks_reach() -> None:
    master = declared()
    report(master, 0, 100, now=50.0)
    report(master, 1, 98, now=50.0)
    version, _ = master.set(tp.ConfigSet(values={"lr": 0.05}), now=50.5)
    # rank 0 was at step 100 0.5 s ago at 0.05 s a step: it is at about 110; the push takes up to 0.3 s = 6 steps
    assert version.apply == "hot" and 110 + 6 < version.at_step <= 110 + 6 + 2
    assert master.history.effective(version.at_step - 1).number == 1
    assert master.history.effective(version.at_step).number == 2
    events = report(master, 0, version.at_step, now=51.0, switched={"2": version.at_step})
    events += report(master, 1, version.at_step, now=51.0, switched={"2": version.at_step})
    assert [e.kind for e in events] == ["config_applied"]
    with pytest.raises(ConflictError, match="too soon"):
        master.set(tp.ConfigSet(values={"lr": 0.01}), now=51.0, at_step=5)


def test_a_new_rounds_gap_is_not_counted_as_steps() -> None:
    master = declared()
    report(master, 0, 100, now=50.0)
    master.round_started(2)  # a restart that takes 10 s: at 0.05 s a step that would be 200 steps
    version, _ = master.set(tp.ConfigSet(values={"lr": 0.05}), now=60.0)
    assert 100 + 6 < version.at_step <= 100 + 6 + 2, "where the rank resumes, plus the push's reach"
    report(master, 0, 101, now=61.0, incarnation=2)  # its successor's first point
    version, _ = master.set(tp.ConfigSet(values={"lr": 0.06}), now=62.0)
    assert 121 + 6 < version.at_step <= 121 + 6 + 2, "from the new round's report on, its pace counts again"


def test_ranks_that_switch_at_different_steps_are_reported() -> None:
    master = declared()
    report(master, 0, 10, now=1.0)
    version, _ = master.set(tp.ConfigSet(values={"clip": 1.0}), now=1.0)
    events = report(master, 0, 30, now=2.0, switched={"2": version.at_step})
    events += report(master, 1, 30, now=2.0, switched={"2": version.at_step + 1})
    assert [e.kind for e in events] == ["config_split"]


def test_a_restart_field_waits_for_every_rank_to_park_then_restarts_once() -> None:
    master = declared()
    report(master, 0, 10, now=1.0)
    report(master, 1, 10, now=1.0)
    version, _ = master.set(tp.ConfigSet(values={"batch_size": 64}), now=1.0)
    assert version.apply == "restart"
    with pytest.raises(ConflictError, match="being applied by a restart"):
        master.set(tp.ConfigSet(values={"lr": 0.2}), now=1.1)
    report(master, 0, version.at_step - 1, now=1.5, parked=version.at_step - 1)
    assert master.restart_due is None
    report(master, 1, version.at_step - 1, now=1.5, parked=version.at_step - 1)
    assert master.restart_due is not None and "every rank finished the step before it" in master.restart_due


def test_nothing_changes_for_a_refused_set() -> None:
    master = declared()
    for values, error in (({"lr": 0.1}, ConflictError), ({"nope": 1}, ConfigError), ({"lr": 99.0}, ConfigError)):
        with pytest.raises(error):
            master.set(tp.ConfigSet(values=values), now=1.0)
    assert len(master.history.versions) == 1
    unrestartable = TrainMaster()
    unrestartable.declare(tp.ConfigDeclare(role="default", rank=0, incarnation=1, fields=declared_fields(Config),
                                           restartable=False))
    with pytest.raises(ConflictError, match="cannot restart"):
        unrestartable.set(tp.ConfigSet(values={"batch_size": 8}), now=1.0)


def test_a_failure_soon_after_a_change_reverts_it_and_a_trusted_one_is_kept() -> None:
    master = declared()
    report(master, 0, 10, now=1.0, expected=1)
    version, _ = master.set(tp.ConfigSet(values={"lr": 5.0}), now=1.0)
    report(master, 0, version.at_step, now=2.0, expected=1, switched={"2": version.at_step})
    events = master.worker_failed(now=2.1)
    assert [e.kind for e in events] == ["config_reverted"]
    assert master.history.current.kind == "revert" and master.history.current.values["lr"] == 0.1
    assert master.history.effective(version.at_step + 1).values["lr"] == 0.1
    assert [v.number for v in master.config_state().versions] == [1, 3], "a reverted version is not pushed"

    master.set(tp.ConfigSet(values={"clip": 2.0}), now=3.0)
    trusted = master.history.current
    report(master, 0, trusted.at_step + 20, now=5.0, expected=1)
    assert master.worker_failed(now=5.1) == [] and master.history.current is trusted


def test_a_rank_applies_a_hot_version_at_its_step_and_parks_for_a_restart_one() -> None:
    master = declared()
    cfg = Config()
    kinds = {d.name: d.kind for d in declared_fields(Config)}
    changes = []
    live = LiveConfig(cfg, master.config_state(), None, lambda c, changed: changes.append(changed), kinds)
    live.seek(0)
    report(master, 0, 10, now=1.0)
    hot_version, _ = master.set(tp.ConfigSet(values={"lr": 0.5}), now=1.0)
    live.versions = master.config_state().versions
    for step in range(hot_version.at_step - 1):
        assert live.boundary(step) is None and cfg.lr == 0.1
    assert live.boundary(hot_version.at_step - 1) is None and cfg.lr == 0.5 and changes == [{"lr": 0.5}]
    assert live.take_switched() == {"1": 0, "2": hot_version.at_step}
    master.history.current.status = "active"
    restart_version, _ = master.set(tp.ConfigSet(values={"batch_size": 8}), now=1.0, at_step=hot_version.at_step + 50)
    live.versions = master.config_state().versions
    assert live.boundary(restart_version.at_step - 2) is None
    assert live.boundary(restart_version.at_step - 1).number == restart_version.number and cfg.batch_size == 32
    assert effective(live.versions, 0).number == 1


def test_a_rank_reads_the_config_file_only_when_the_agent_bumped_its_counter(tmp_path: Path) -> None:
    master = declared()
    path = config_file(tmp_path / "run", "host-0")
    cfg = Config()
    live = LiveConfig(cfg, master.config_state(), path, None, {d.name: d.kind for d in declared_fields(Config)})
    assert generation_file(path).stat().st_size == 8, "the rank made the counter before the agent's first write"
    live.seek(0)
    assert live.boundary(0) is None  # no file yet, as of count 0
    report(master, 0, 10, now=1.0)
    master.set(tp.ConfigSet(values={"lr": 0.5}), now=1.0, at_step=20)
    state = master.config_state()
    unannounced = path.with_name("unannounced.json")
    unannounced.write_text(state.model_dump_json())
    os.replace(unannounced, path)  # the new file without the counter's bump: the rank does not look
    assert live.boundary(19) is None and cfg.lr == 0.1
    write_config(path, state)
    assert int.from_bytes(generation_file(path).read_bytes(), "little") == 1
    assert live.boundary(19) is None and cfg.lr == 0.5, "the bumped counter made the rank read the file"
    write_config(path, state)
    assert int.from_bytes(generation_file(path).read_bytes(), "little") == 2


def test_the_history_survives_its_state() -> None:
    master = declared({"clip": "1"})
    master.set(tp.ConfigSet(values={"lr": 0.3}, author="ann", reason="slower"), now=1.0)
    again = TrainMaster.from_state(master.state_json(), {})
    assert [v.public() for v in again.history.versions] == [v.public() for v in master.history.versions]
    assert again.history.schema == master.history.schema and again.history.overrides == {"clip": "1"}


def diverging(master: TrainMaster, first: int, last: int, bad_from: int) -> list:
    events = []
    for step in range(first, last):
        for rank in (0, 1):
            point = tp.StatusPoint(step=step, time=1000.0 + step, loss=1.0 / (1 + step) if step < bad_from else 50.0,
                                   step_time_s=0.05)
            request = tp.StatusReport(role="default", rank=rank, incarnation=1, sent_at=1000.0 + step, points=[point])
            events += master.report(request, float(step), 2)[1]
    return events


def test_a_divergence_is_proposed_and_its_rollback_restarts_from_a_checkpoint_before_the_change() -> None:
    master = TrainMaster(ConfigHistory(), checkpoints=lambda: [9, 19, 29, 39])
    master.declare(tp.ConfigDeclare(role="default", rank=0, incarnation=1, fields=declared_fields(Config)))
    diverging(master, 0, 30, bad_from=10**9)
    version, _ = master.set(tp.ConfigSet(values={"lr": 9.0}), now=29.0, at_step=40)
    events = diverging(master, 30, 50, bad_from=41)
    proposals = [e.message for e in events if e.kind == "proposal"]
    assert len(proposals) == 1 and "revert to version 1" in proposals[0] and "roll back to step 39" in proposals[0]
    kept = master.proposals.kept[0]
    assert kept.values == {"lr": 0.1} and kept.rollback_to == 39 and kept.step - version.at_step <= 5
    rolled, events = master.apply_proposal(kept.id, "ann", now=50.0)
    assert rolled.apply == "restart" and rolled.at_step == 40 and master.restart_due
    assert master.history.number(version.number).status == "reverted"
    assert master.history.effective(45).values["lr"] == 0.1
    master.round_started(7)
    assert master.restore_at_most(7) == 39 and master.restore_at_most(8) is None
    with pytest.raises(ConflictError, match="already applied"):
        master.apply_proposal(kept.id, "ann", now=42.0)


def test_an_opted_in_rule_applies_itself_and_evidence_alone_is_not_applied() -> None:
    master = TrainMaster.from_state(None, {}, auto_apply=("divergence",), checkpoints=lambda: [9])
    master.declare(tp.ConfigDeclare(role="default", rank=0, incarnation=1, fields=declared_fields(Config)))
    diverging(master, 0, 20, bad_from=10**9)
    master.set(tp.ConfigSet(values={"lr": 5.0}), now=19.0, at_step=30)
    events = diverging(master, 20, 34, bad_from=31)  # the restart would end the bad steps here
    assert [e.kind for e in events if e.kind in ("proposal", "config_rollback")][:2] == ["proposal", "config_rollback"]
    assert master.proposals.kept[0].status == "applied" and master.proposals.kept[0].decided_by.startswith("convoy")
    master.proposals.kept.append(type(master.proposals.kept[0])(99, "throughput", 40, 30, "slower", {}, None, False))
    with pytest.raises(ConflictError, match="evidence only"):
        master.apply_proposal(99, "ann", now=50.0)
    assert [e.kind for e in master.proposals.dismiss(99, "ann")] == ["proposal_dismissed"]
