"""The pure side of the collectives: topologies, who sends what across groups, the cost model."""

from __future__ import annotations

import json

import pytest

from convoy.errors import ConfigError
from convoy.parallel.allreduce.autotune import TRIAL_BUDGET_S, TRIAL_MAX_ROUNDS, TRIAL_ROUNDS, Trial, trial_rounds
from convoy.parallel.topology import (CostModel, Link, Topology, cross_bytes, min_cross_bytes, simplest_within,
                                      size_class)

MB = 1 << 20


@pytest.mark.parametrize("groups, words", [
    ([], "no groups"),
    ([[0, 1], []], "group 1 has no ranks"),
    ([[0, 1], [1, 2]], "rank 1 is in topology groups 0 and 1"),
    ([[0, 1], [3]], "not [2]"),
    ([[0, -1]], "whole numbers >= 0"),
    ([[0, "1"]], "whole numbers >= 0"),
])
def test_a_topology_must_cover_every_rank_once(groups: list[list[int]], words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        Topology.from_groups(groups)


def test_topology_from_the_agents_environment_and_from_torchrun() -> None:
    convoy_env = {"CONVOY_TOPOLOGY": json.dumps([[1, "hostB", 3], [0, "hostA", 2]])}
    assert Topology.from_env(convoy_env).groups == ((0, 1), (2, 3, 4))  # node rank order, as ranks are given
    assert Topology.from_env({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}).groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    with pytest.raises(ConfigError, match="no topology in the environment"):
        Topology.from_env({})
    with pytest.raises(ConfigError, match="CONVOY_TOPOLOGY"):
        Topology.from_env({"CONVOY_TOPOLOGY": "[[0, 1]]"})
    with pytest.raises(ConfigError, match="cannot split 6 ranks into groups of 4"):
        Topology.uniform(6, 4)


def test_shard_groups_pair_equal_local_indices_and_need_equal_groups() -> None:
    topology = Topology.from_groups([[0, 1, 2], [3, 4, 5]])
    assert topology.shard_groups() == ((0, 3), (1, 4), (2, 5))
    assert topology.leaders == (0, 3) and topology.local_index(4) == 1 and topology.group_of(5) == 1
    with pytest.raises(ConfigError, match="groups of equal size"):
        Topology.from_groups([[0], [1, 2]]).shard_groups()


def test_partners_across_two_groups() -> None:
    topology = Topology.from_groups([[0, 1, 2], [3, 4, 5]])
    assert [topology.partner(rank, "reduce_scatter") for rank in range(6)] == [3, 4, 5, 0, 1, 2]
    assert topology.partner(0, "leader") == 3 and topology.partner(3, "leader") == 0
    assert Topology.from_groups([[0], [1, 2]]).partner(1, "leader") == 0
    with pytest.raises(ValueError, match="rank 2 does not cross"):
        Topology.from_groups([[0], [1, 2]]).partner(2, "leader")
    with pytest.raises(ConfigError, match="only with two groups"):
        Topology.from_groups([[0], [1], [2]]).partner(0, "leader")


def test_bytes_across_groups_against_the_minimum() -> None:
    two_by_two = Topology.uniform(4, 2)
    # flat ring 0-1-2-3-0 crosses twice; each crossing carries 2 (4-1)/4 S
    assert cross_bytes(two_by_two, "flat", MB) == 2 * 1.5 * MB
    assert cross_bytes(two_by_two, "leader", MB) == 2 * MB == min_cross_bytes(two_by_two, MB)
    assert cross_bytes(two_by_two, "reduce_scatter", MB) == 2 * MB
    two_by_four = Topology.uniform(8, 4)
    assert cross_bytes(two_by_four, "flat", MB) == 2 * 1.75 * MB
    assert cross_bytes(two_by_four, "reduce_scatter", MB) == min_cross_bytes(two_by_four, MB)
    interleaved = Topology.from_groups([[0, 2], [1, 3]])  # every ring edge crosses
    assert cross_bytes(interleaved, "flat", MB) == 4 * 1.5 * MB


def test_cost_model_prefers_flat_on_even_links_and_hierarchy_on_a_slow_uplink() -> None:
    topology = Topology.uniform(8, 4)
    even = CostModel(Link(50e-6, 1 / 2e9), Link(50e-6, 1 / 2e9))
    assert even.choose(topology, 16 * MB) == "flat"
    slow = CostModel(Link(50e-6, 1 / 2e9), Link(500e-6, 1 / 125e6))  # 1 Gbit/s, 0.5 ms across
    assert slow.choose(topology, 16 * MB) == "reduce_scatter"
    assert slow.predict(topology, "flat", 16 * MB) > 1.5 * slow.predict(topology, "reduce_scatter", 16 * MB)
    assert slow.choose(topology, 256) in ("flat", "leader")  # tiny messages: latency, not bandwidth
    assert slow.choose(Topology.from_groups([[0], [1, 2, 3]]), 16 * MB) == "leader"  # uneven: no reduce_scatter
    assert slow.choose(Topology.uniform(4, 4), 16 * MB) == "flat"
    # measured end to end, an algorithm's line wins over the link model (here: in-group phases are slow)
    measured = CostModel(slow.intra, slow.inter, (("flat", Link(1e-3, 1 / 0.5e9)), ("leader", Link(2e-3, 1 / 0.4e9))))
    assert measured.predict(topology, "flat", 16 * MB) == pytest.approx(1e-3 + 16 * MB / 0.5e9)
    assert [measured.choose(topology, size * MB) for size in (1, 4, 16, 64)] == ["flat"] * 4
    # within the margin the flat ring stays: probes on a busy machine are noisy
    close = CostModel(slow.intra, slow.inter, (("flat", Link(1e-3, 1 / 1.0e9)), ("leader", Link(1e-3, 1 / 1.1e9))))
    assert close.choose(Topology.uniform(4, 2), 64 * MB, margin=0.15) == "flat"
    assert close.choose(Topology.uniform(4, 2), 64 * MB, margin=0.0) == "leader"
    # and between the hierarchical two, leader unless reduce_scatter wins by the margin
    pair = CostModel(slow.intra, slow.inter, (("flat", Link(4e-3, 1 / 1.0e9)), ("leader", Link(1e-3, 1 / 1.0e9)),
                                              ("reduce_scatter", Link(0.9e-3, 1 / 1.0e9))))
    assert pair.choose(Topology.uniform(4, 2), MB) == "leader"
    assert pair.choose(Topology.uniform(4, 2), MB, margin=0.0) == "reduce_scatter"
    with pytest.raises(ConfigError, match="unknown allreduce algorithm 'tree'"):
        slow.predict(topology, "tree", MB)


def test_auto_trials_only_the_algorithms_predicted_close_to_the_fastest() -> None:
    lines = (("flat", Link(5e-3, 1 / 1.0e9)), ("leader", Link(1e-3, 1 / 0.9e9)),
             ("reduce_scatter", Link(1e-3, 1 / 0.5e9)))
    model = CostModel(Link(0.0, 1e-9), Link(0.0, 1e-9), lines)
    two_by_two = Topology.uniform(4, 2)
    assert model.candidates(two_by_two, 1024) == ["leader", "reduce_scatter"]  # flat's fixed 5 ms is out
    assert model.candidates(two_by_two, 64 * MB) == ["flat", "leader"]  # reduce_scatter's bandwidth is out
    assert model.candidates(Topology.from_groups([[0], [1, 2, 3]]), 1024) == ["leader"]  # uneven: nothing to try
    assert model.candidates(Topology.uniform(4, 4), 64 * MB) == ["flat"]
    assert simplest_within({"flat": 10.0, "leader": 9.6, "reduce_scatter": 9.0}) == "reduce_scatter"
    assert simplest_within({"flat": 10.0, "leader": 9.6, "reduce_scatter": 9.3}) == "leader"  # 9.6 within 5% of 9.3
    assert simplest_within({"flat": 9.7, "leader": 9.6}) == "flat"
    assert [size_class(n) for n in (0, 1, MB - 1, MB, 2 * MB - 1, 2 * MB)] == [1, 1, 20, 21, 21, 22]


def test_coded_algorithms_are_weighed_only_where_measured_and_only_between_two_groups() -> None:
    """The model has no term for the coding's CPU time: an unmeasured coded variant is never a candidate; a
    measured one is, between two groups only, and listed after the plain ones (it must win by the margin)."""
    plain = (("flat", Link(1e-3, 3 / 0.12e9)), ("leader", Link(1e-3, 2 / 0.12e9)),
             ("reduce_scatter", Link(1e-3, 2 / 0.12e9)))
    coded = (("leader_coded", Link(2e-3, 1.8 / 0.12e9)), ("reduce_scatter_coded", Link(2e-3, 1.9 / 0.12e9)))
    two_by_two, four_by_one = Topology.uniform(4, 2), Topology.uniform(4, 1)
    unmeasured = CostModel(Link(0.0, 1e-9), Link(0.0, 1e-9), plain)
    assert unmeasured.candidates(two_by_two, 64 * MB) == ["leader", "reduce_scatter"]
    assert unmeasured.predict(two_by_two, "leader_coded", 64 * MB) == unmeasured.predict(two_by_two, "leader", 64 * MB)
    model = CostModel(Link(0.0, 1e-9), Link(0.0, 1e-9), plain + coded)
    assert model.candidates(two_by_two, 64 * MB) == ["leader", "reduce_scatter", "leader_coded",
                                                     "reduce_scatter_coded"]
    assert model.choose(two_by_two, 64 * MB) == "leader_coded"  # 10% fewer seconds a byte: past the 5% margin
    assert model.choose(two_by_two, 1024) == "flat"  # the coded ones' larger fixed cost: not at 1 KB
    assert "leader_coded" not in model.candidates(Topology.from_groups([[0, 1], [2, 3], [4, 5]]), 64 * MB)
    assert model.candidates(four_by_one, 64 * MB) == ["flat"]
    assert model.plain_only().candidates(two_by_two, 64 * MB) == ["leader", "reduce_scatter"]  # compress=False's


def test_a_trial_of_quick_calls_gets_more_rounds_within_its_budget() -> None:
    assert trial_rounds(1.0) == TRIAL_ROUNDS  # 64 MB over a slow link: the minimum
    assert trial_rounds(0.1) == int(TRIAL_BUDGET_S / 0.1)  # 3 candidates of 33 ms
    assert trial_rounds(1e-4) == trial_rounds(0.0) == TRIAL_MAX_ROUNDS


def test_a_trial_runs_every_candidate_once_a_round_in_orders_that_vary() -> None:
    candidates = ["flat", "leader", "reduce_scatter"]
    trial, ran = Trial(candidates, rounds=9), []
    while not trial.complete:
        ran.append(trial.next())
        trial.record(ran[-1], 1.0)
    rounds = [tuple(ran[i:i + 3]) for i in range(0, len(ran), 3)]
    assert len(rounds) == 9 and all(sorted(r) == candidates for r in rounds)
    assert len(set(rounds)) > 2, rounds


def test_fitting_a_link_recovers_its_latency_and_bandwidth() -> None:
    truth = Link(100e-6, 1 / 1e9)
    ranks = 4
    times = [(size, 2 * (ranks - 1) * (truth.latency_s + size / ranks * truth.s_per_byte)) for size in (64e3, 4e6)]
    fitted = Link.fit_ring(ranks, times[0], times[1])
    assert fitted.latency_s == pytest.approx(truth.latency_s) and fitted.s_per_byte == pytest.approx(truth.s_per_byte)
