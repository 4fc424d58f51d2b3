"""convoy.control.training.rules: NaN, divergence after an injected learning rate, plateau, throughput, memory,
duplicates, once-per-condition, reset_after, validation, bounded memory."""

from __future__ import annotations

import math
import random

import pytest

from convoy.control.training.rules import MAX_POINTS, RULES, ConfigVersion, Point, Proposal, RuleConfig, Rules
from convoy.errors import ConfigError

RANKS = range(4)
V1 = ConfigVersion(1, 0, {"lr": 0.01, "batch_size": 32})
MIB = 1024 * 1024


def curve(step: int, rank: int, seed: int = 0, noise: float = 0.02) -> float:
    """A decaying loss with per-rank noise: what a healthy run reports."""
    jitter = random.Random(seed * 1_000_003 + step * 31 + rank).uniform(-noise, noise)
    return 10.0 / math.sqrt(1.0 + step / 10.0) * (1.0 + jitter)


def step_points(step: int, loss: float | None = None, **fields: float) -> list[Point]:
    """One step's points from every rank (the loss from ``curve`` unless given)."""
    return [Point(rank, step, float(step), curve(step, rank) if loss is None else loss, **fields) for rank in RANKS]


def feed(rules: Rules, steps: range, versions: list[ConfigVersion], **kwargs: object) -> list[Proposal]:
    found = []
    for step in steps:
        found += rules.observe(step_points(step), versions, **kwargs)
    return found


def test_nan_is_proposed_on_the_first_bad_point_with_lr_times_a_tenth() -> None:
    rules = Rules(RuleConfig())
    assert feed(rules, range(3), [V1]) == []
    found = rules.observe([Point(2, 3, 3.0, loss=float("nan"))], [V1], checkpoint_steps=[0, 2, 3])
    assert [p.rule for p in found] == ["nan"]
    assert found[0].step == 3 and found[0].onset == 3 and found[0].ranks == (2,)
    assert found[0].values == {"lr": pytest.approx(0.001)} and found[0].rollback_to == 2
    assert "nan" in found[0].evidence and "step 3" in found[0].evidence and not found[0].auto


def test_nan_right_after_a_config_change_reverts_it() -> None:
    rules = Rules(RuleConfig(auto_apply=frozenset({"nan"})))
    versions = [V1, ConfigVersion(2, 5, {"lr": 5.0, "batch_size": 32})]
    feed(rules, range(5), versions)
    found = rules.observe([Point(0, 5, 5.0, loss=1.0, grad_norm=math.inf)], versions, [0, 4, 5])
    assert found[0].values == {"lr": 0.01} and found[0].rollback_to == 4 and found[0].auto
    assert "version 2" in found[0].evidence and "grad_norm inf" in found[0].evidence


def test_an_injected_100x_lr_is_caught_within_5_steps_and_reverted() -> None:
    rules = Rules(RuleConfig())
    versions = [V1]
    found = feed(rules, range(50), versions, checkpoint_steps=[0, 25, 45])
    assert found == []
    versions = [V1, ConfigVersion(2, 50, {"lr": 1.0, "batch_size": 32})]
    caught = []
    for step in range(50, 60):
        blown = [Point(p.rank, p.step, p.time, p.loss * 2.0 ** (step - 50)) for p in step_points(step)]
        caught += rules.observe(blown, versions, checkpoint_steps=[0, 25, 45, 50])
        if caught:
            break
    assert [p.rule for p in caught] == ["divergence"]
    proposal = caught[0]
    assert proposal.step <= 54 and proposal.onset is not None and proposal.onset <= proposal.step
    assert proposal.values == {"lr": 0.01} and proposal.rollback_to == 45
    assert proposal.key() == f"divergence:{proposal.onset}" and "ranks 0-3" in proposal.evidence
    assert "running minimum" in proposal.evidence and "version 2" in proposal.evidence


def test_divergence_without_a_config_change_suggests_a_smaller_lr() -> None:
    rules = Rules(RuleConfig(divergence_steps=3))
    feed(rules, range(30), [V1])
    found = []
    for step in range(30, 33):
        found += rules.observe(step_points(step, loss=50.0), [V1], [10, 20])
    assert len(found) == 1 and found[0].step == 32 and found[0].onset == 30
    assert found[0].values == {"lr": pytest.approx(0.001)} and found[0].rollback_to == 20


def test_a_noisy_decreasing_loss_raises_nothing() -> None:
    rules = Rules(RuleConfig())
    found = []
    for step in range(600):
        points = [Point(rank, step, float(step), curve(step, rank, seed=7, noise=0.1),
                        step_time_s=0.2 * random.Random(step * 8 + rank).uniform(0.8, 1.2),
                        memory_bytes=(900 + random.Random(step * 9 + rank).randint(-20, 20)) * MIB)
                  for rank in RANKS]
        found += rules.observe(points, [V1])
    assert found == []


def test_plateau_fires_on_a_flat_curve_with_half_the_lr_and_not_on_a_decreasing_one() -> None:
    config = RuleConfig(plateau_steps=50)
    flat, falling = Rules(config), Rules(config)
    proposals = []
    for step in range(120):
        proposals += flat.observe(step_points(step, loss=2.0 + 0.001 * (step % 3)), [V1])
    assert [p.rule for p in proposals] == ["plateau"]
    assert proposals[0].step == 50 and proposals[0].values == {"lr": 0.005} and proposals[0].rollback_to is None
    assert feed(falling, range(120), [V1]) == []


def test_throughput_fires_when_one_rank_step_time_doubles() -> None:
    rules = Rules(RuleConfig(window=10, warmup_steps=5))
    found = []
    for step in range(80):
        points = [Point(rank, step, float(step), curve(step, rank),
                        step_time_s=0.4 if rank == 2 and step >= 50 else 0.2) for rank in RANKS]
        found += rules.observe(points, [V1])
    assert [p.rule for p in found] == ["throughput"] and found[0].ranks == (2,)
    assert found[0].step <= 60 and found[0].values == {} and found[0].rollback_to is None
    assert found[0].evidence.startswith("rank 2: median step time 0.3 s over steps 45-54 is 1.5x its baseline 0.2 s")


def test_a_new_config_version_takes_a_new_throughput_baseline() -> None:
    rules = Rules(RuleConfig(window=10, warmup_steps=5))
    slower = ConfigVersion(2, 40, {"lr": 0.01, "batch_size": 64})
    found = []
    for step in range(100):
        versions = [V1, slower] if step >= 40 else [V1]
        found += rules.observe(step_points(step, step_time_s=0.4 if step >= 40 else 0.2), versions)
    assert found == [], "a bigger batch's longer step is the new baseline, not a regression"


def test_memory_growth_fires_with_the_rank_and_sizes() -> None:
    rules = Rules(RuleConfig(window=10, memory_growth=0.2))
    found = []
    for step in range(60):
        grown = 1000 + (max(0, step - 30) * 20)
        found += rules.observe([Point(rank, step, float(step), memory_bytes=(grown if rank == 1 else 1000) * MIB)
                                for rank in RANKS], [V1])
    assert [p.rule for p in found] == ["memory"] and found[0].ranks == (1,)
    assert found[0].step == 41 and "1,220 MiB" in found[0].evidence and "1,000 MiB" in found[0].evidence


def test_duplicates_of_a_seen_rank_and_step_are_ignored() -> None:
    rules = Rules(RuleConfig())
    feed(rules, range(20), [V1])
    assert rules.observe([Point(0, 5, 5.0, loss=float("nan"))], [V1]) == []
    assert rules.observe([Point(r, 19, 19.0, loss=1e9) for r in RANKS], [V1]) == []
    assert rules.kept_points(0) == 20


def test_points_without_the_fields_a_rule_needs_are_ignored_by_it() -> None:
    rules = Rules(RuleConfig(window=5, warmup_steps=0))
    assert feed(rules, range(40), []) == []
    bare = [Point(rank, step, float(step)) for step in range(40, 400) for rank in RANKS]
    assert rules.observe(bare, [V1]) == [], "no loss, step time or memory: no verdict, and no plateau"
    assert rules.observe([Point(0, 400, 400.0, step_time_s=9.0, memory_bytes=10**12)], [V1]) == []


def test_a_condition_is_proposed_once_while_it_holds_and_again_after_it_cleared() -> None:
    rules = Rules(RuleConfig())
    feed(rules, range(20), [V1])
    first = rules.observe(step_points(20, loss=math.nan), [V1])
    assert len(first) == 1 and first[0].key() == "nan:20"
    assert rules.observe(step_points(21, loss=math.nan), [V1]) == []
    assert rules.observe(step_points(22), [V1]) == [], "finite again: cleared"
    again = rules.observe(step_points(23, loss=math.inf), [V1])
    assert [p.key() for p in again] == ["nan:23"]


def test_divergence_once_while_it_holds_and_again_after_it_cleared() -> None:
    rules = Rules(RuleConfig())
    feed(rules, range(30), [V1])
    found = feed_losses(rules, range(30, 40), 100.0)
    assert [p.key() for p in found] == ["divergence:30"]
    assert feed(rules, range(40, 45), [V1]) == []
    assert [p.key() for p in feed_losses(rules, range(45, 48), 100.0)] == ["divergence:45"]


def feed_losses(rules: Rules, steps: range, loss: float) -> list[Proposal]:
    found = []
    for step in steps:
        found += rules.observe(step_points(step, loss=loss), [V1])
    return found


def test_reset_after_forgets_the_points_and_the_condition() -> None:
    rules = Rules(RuleConfig())
    feed(rules, range(30), [V1])
    assert [p.rule for p in feed_losses(rules, range(30, 33), 100.0)] == ["divergence"]
    rules.reset_after(25)
    assert rules.kept_points(0) == 26 and rules.kept_loss_steps() == 26
    assert feed(rules, range(26, 60), [V1]) == [], "the rerun's healthy points replace the bad ones"
    assert [p.key() for p in feed_losses(rules, range(60, 62), 100.0)] == ["divergence:60"]


def test_reset_after_unwinds_folded_loss_steps() -> None:
    kept, rolled = Rules(RuleConfig(plateau_steps=10_000)), Rules(RuleConfig(plateau_steps=10_000))
    feed(kept, range(700), [V1])
    feed(rolled, range(700), [V1])
    assert [p.rule for p in feed_losses(kept, range(700, 702), 8.0)] == ["divergence"], "8.0 is 6.7x the minimum 1.2"
    rolled.reset_after(100)
    assert rolled.kept_points(3) == 101 and rolled.kept_loss_steps() <= 101
    assert feed_losses(rolled, range(101, 103), 8.0) == [], "the minimum is that of steps 0-100 again (3.0)"


@pytest.mark.parametrize("field, value", [("divergence_factor", 0.5), ("divergence_steps", 0), ("window", 0),
                                          ("plateau_rel", 1.5), ("throughput_drop", -0.1), ("warmup_steps", -1),
                                          ("memory_growth", math.nan), ("plateau_steps", 2.5)])
def test_validate_names_the_field_and_value(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=field) as caught:
        RuleConfig(**{field: value}).validate()
    assert str(value) in str(caught.value)
    with pytest.raises(ConfigError, match=field):
        Rules(RuleConfig(**{field: value}))


def test_validate_refuses_an_unknown_auto_apply_rule() -> None:
    with pytest.raises(ConfigError, match="auto_apply.*lr_finder"):
        RuleConfig(auto_apply=frozenset({"nan", "lr_finder"})).validate()
    RuleConfig(auto_apply=frozenset(RULES)).validate()


def test_storage_stays_bounded_over_100k_points() -> None:
    rules = Rules(RuleConfig(plateau_steps=100_000))
    for start in range(0, 25_000, 500):
        batch = [Point(rank, step, float(step), 1.0 + 0.1 * math.sin(step), step_time_s=0.2, memory_bytes=MIB)
                 for step in range(start, start + 500) for rank in RANKS]
        assert rules.observe(batch, [V1]) == []
    for rank in RANKS:
        assert rules.kept_points(rank) <= MAX_POINTS + MAX_POINTS // 8
    assert rules.kept_loss_steps() <= 300
    assert rules.observe([Point(0, 10, 10.0, loss=math.nan)], [V1]) == [], "older than the kept points: ignored"
