"""State-space slices: a declared cut must tile the seeds (or the box of initial states), actors start their episodes
in the slices they own, and every deal to a changing set of actors owns each
slice exactly once, moving as few slices as it can."""

from __future__ import annotations

import math
import random

import pytest

from convoy.errors import ConfigError
from convoy.workloads.rl.envs import SlicedEnv
from convoy.workloads.rl.slices import (Slice, SliceBook, StartBox, box_slices, check_boxes, check_cover, check_dealt,
                                        deal, seed_slices)


def test_seed_slices_tile_the_seeds_evenly() -> None:
    slices = seed_slices(10, 4)
    assert [(s.start, s.stop) for s in slices] == [(0, 2), (2, 5), (5, 7), (7, 10)]
    check_cover(slices, 10)
    assert [slices[1].seed(e) for e in range(4)] == [2, 3, 4, 2]
    with pytest.raises(ConfigError, match="cannot cut 3 seeds into 4 slices"):
        seed_slices(3, 4)


@pytest.mark.parametrize(("slices", "error"), [
    ([], "declared no slices"),
    ([Slice(0, 0, 5), Slice(1, 4, 10)], r"slice 1 \[4, 10\) overlaps the seeds before 5"),
    ([Slice(0, 0, 5), Slice(1, 6, 10)], r"seeds \[5, 6\) are in no slice"),
    ([Slice(0, 0, 5), Slice(1, 5, 8)], r"seeds \[8, 10\) are in no slice"),
    ([Slice(0, 0, 5), Slice(1, 5, 12)], "reach seed 12, past the space's 10"),
    ([Slice(0, 0, 5), Slice(2, 5, 10)], "numbered 0..1"),
    ([Slice(0, 0, 0), Slice(1, 0, 10)], r"slice 0 \[0, 0\) is empty"),
])
def test_a_cut_that_does_not_tile_the_space_is_named(slices: list[Slice], error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        check_cover(slices, 10)


def test_a_deal_is_even_and_keeps_what_each_actor_had() -> None:
    first = deal(range(8), ["a", "b"], {})
    check_dealt(first, range(8))
    assert sorted(len(v) for v in first.values()) == [4, 4]
    grown = deal(range(8), ["a", "b", "c"], first)
    check_dealt(grown, range(8))
    assert sorted(len(v) for v in grown.values()) == [2, 3, 3]
    assert set(grown["a"]) <= set(first["a"]) and set(grown["b"]) <= set(first["b"])  # only c's share moved
    shrunk = deal(range(8), ["b", "c"], grown)
    check_dealt(shrunk, range(8))
    assert set(grown["b"]) <= set(shrunk["b"]) and set(grown["c"]) <= set(shrunk["c"])


def test_every_deal_over_random_comings_and_goings_owns_each_slice_once() -> None:
    rng = random.Random(7)
    book = SliceBook(seed_slices(100, 13))
    actors: list[str] = []
    next_id = 0
    for _ in range(500):
        if actors and (len(actors) > 12 or rng.random() < 0.4):
            actors.remove(rng.choice(actors))
        else:
            actors.append(f"actor{next_id}")
            next_id += 1
        dealt = book.redeal(actors)  # checks the invariant itself
        assert set(dealt) == set(actors)
        if actors:
            sizes = [len(v) for v in dealt.values()]
            assert max(sizes) - min(sizes) <= 1
    assert book.deals == 500 and book.moved > 0


def test_a_broken_deal_is_named() -> None:
    with pytest.raises(AssertionError, match=r"unowned \[2\], owned twice \{1: \['a', 'b'\]\}"):
        check_dealt({"a": (0, 1), "b": (1,)}, range(3))


def test_visits_are_counted_per_slice() -> None:
    book = SliceBook(seed_slices(10, 2))
    book.visited({0: 3, 1: 1})
    book.visited({0: 2, 5: 9})
    assert book.visits == {0: 5, 1: 1}


def test_start_boxes_tile_the_box_of_initial_states_and_bad_declarations_are_named() -> None:
    boxes = box_slices((-0.05,) * 4, (0.05,) * 4, 2, 5)
    check_boxes(boxes, (-0.05,) * 4, (0.05,) * 4)
    assert [b.index for b in boxes] == [0, 1, 2, 3, 4]
    assert boxes[0].low[2] == -0.05 and boxes[-1].high[2] == 0.05 and boxes[1].low[2] == boxes[0].high[2]
    assert all(b.low[0] == -0.05 and b.high[0] == 0.05 for b in boxes), "the other axes span the whole box"
    low, high = (0.0, 0.0), (1.0, 1.0)
    with pytest.raises(ConfigError, match=r"start box 1 overlaps the box before it on axis 0"):
        check_boxes([StartBox(0, (0.0, 0.0), (0.6, 1.0)), StartBox(1, (0.5, 0.0), (1.0, 1.0))], low, high)
    with pytest.raises(ConfigError, match=r"start box 1 leaves \[0.4, 0.5\) uncovered on axis 0"):
        check_boxes([StartBox(0, (0.0, 0.0), (0.4, 1.0)), StartBox(1, (0.5, 0.0), (1.0, 1.0))], low, high)
    with pytest.raises(ConfigError, match=r"they differ on axes \[0, 1\]"):
        check_boxes([StartBox(0, (0.0, 0.0), (0.5, 0.5)), StartBox(1, (0.5, 0.5), (1.0, 1.0))], low, high)
    with pytest.raises(ConfigError, match=r"end at 0.9 on axis 0"):
        check_boxes([StartBox(0, (0.0, 0.0), (0.9, 1.0))], low, high)
    with pytest.raises(ConfigError, match="numbered 0..1"):
        check_boxes([StartBox(0, (0.0, 0.0), (0.5, 1.0)), StartBox(2, (0.5, 0.0), (1.0, 1.0))], low, high)
    with pytest.raises(ConfigError, match="into 0 boxes"):
        box_slices(low, high, 0, 0)


def test_an_actor_starts_each_episode_in_its_own_start_boxes_and_counts_visits() -> None:
    pytest.importorskip("gymnasium")
    env = SlicedEnv("CartPole-v1", slicing="start-boxes", count=4)
    env.own([1, 3])
    seen = []
    for _ in range(6):
        obs, index = env.reset()
        box = env.slices[index]
        assert all(lo <= x <= hi for x, lo, hi in zip(obs, box.low, box.high, strict=True)), (obs, box)
        seen.append(index)
        env.step(0)
    assert seen == [1, 3, 1, 3, 1, 3] and env.take_visits() == {1: 3, 3: 3}
    acrobot = SlicedEnv("Acrobot-v1", slicing="start-boxes", count=2)
    obs, index = acrobot.reset()
    state = acrobot.env.unwrapped.state
    assert len(obs) == 6 and abs(obs[0] - math.cos(state[0])) < 1e-6, "Acrobot observes cos/sin of its state"
    assert acrobot.slices[index].low[0] <= state[0] <= acrobot.slices[index].high[0]
    with pytest.raises(ConfigError, match=r"Pendulum-v1 declares no box of initial states .*use slicing = \"seeds\""):
        SlicedEnv("Pendulum-v1", slicing="start-boxes", count=2)


def test_an_environment_declares_its_own_start_box() -> None:
    gymnasium = pytest.importorskip("gymnasium")
    from gymnasium.envs.classic_control.cartpole import CartPoleEnv

    class NarrowCartPole(CartPoleEnv):
        def convoy_start_box(self) -> tuple[list[float], list[float], int]:
            return [-0.01] * 4, [0.01] * 4, 0

    if "NarrowCartPole-v0" not in gymnasium.registry:
        gymnasium.register("NarrowCartPole-v0", entry_point=NarrowCartPole, max_episode_steps=50)
    env = SlicedEnv("NarrowCartPole-v0", slicing="start-boxes", count=2)
    obs, index = env.reset()
    assert index == 0 and -0.01 <= obs[0] <= 0.0 and all(abs(x) <= 0.01 for x in obs)
