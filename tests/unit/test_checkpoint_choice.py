"""Which in-memory snapshot step the job resumes after, from what each rank holds (pure)."""

from __future__ import annotations

from convoy.runtime.peers import StepChoice, choose_step

ALONE = [(0,), (1,)]
TOGETHER = [(0, 1)]


def test_newest_step_every_rank_holds_whole_wins_without_peers() -> None:
    assert choose_step([{4, 5}, {4, 5}], [{4, 5}, {4, 5}], ALONE, None) == StepChoice(5)
    assert choose_step([{4, 5}, {3, 4}], [{4, 5}, {3, 4, 5}], ALONE, None) == StepChoice(4)


def test_with_peers_a_step_one_peer_holds_whole_is_covered() -> None:
    assert choose_step([{5, 6}, {5}], [{5, 6}, {5, 6}], TOGETHER, None) == StepChoice(6)
    assert choose_step([{5, 6}, set()], [{5, 6}, set()], TOGETHER, None) == StepChoice(6)  # a node that joined


def test_a_replica_killed_while_its_last_snapshot_landed_takes_that_step_from_a_peer() -> None:
    """Rank 1 died in step 12 with step 11 still landing (partial): rank 0 holds 11 whole, so the job
    resumes at 12 with rank 0's model and rank 1's own data position, not apart from step 10."""
    assert choose_step([{11, 12}, {10}], [{11, 12}, {10, 11}], TOGETHER, None) == StepChoice(11)


def test_ranks_sharing_no_step_resume_after_the_newest_any_rank_holds() -> None:
    """A node out of the job for a while holds only old steps: the job goes on from the newest."""
    assert choose_step([{138, 139}, {3, 4}], [{138, 139}, {3, 4}], ALONE, None) == StepChoice(139, apart=True)
    assert choose_step([{139}, set()], [{139}, set()], ALONE, None) == StepChoice(139, apart=True)


def test_a_persistent_checkpoint_as_new_wins_over_ranks_apart() -> None:
    assert choose_step([{138, 139}, {3, 4}], [{138, 139}, {3, 4}], ALONE, 139) is None
    assert choose_step([{138, 139}, {3, 4}], [{138, 139}, {3, 4}], ALONE, 200) is None


def test_a_rank_holding_no_snapshot_takes_the_persistent_checkpoint_where_there_is_one() -> None:
    """E.g. its node's /dev/shm is full: a fresh start would lose that rank's own progress."""
    assert choose_step([{139}, set()], [{139}, set()], ALONE, 99) is None


def test_nothing_held_is_nothing_to_resume() -> None:
    assert choose_step([set(), set()], [set(), set()], ALONE, None) is None
    assert choose_step([set(), set()], [set(), set()], TOGETHER, None) is None
