"""Long polls parked without a thread (``long_polls.py``): handed back when ready, when due, or at the stop; the
epoch keeps a sweep from reading every parked poll when nothing they wait on moved; the poll the master asks for
grows with the number of nodes (``polls.poll_for``)."""

from __future__ import annotations

import functools
import gc
import threading
import time
import weakref

from helpers import wait_for

from convoy.control.long_polls import URGENT, LongPoll, LongPolls
from convoy.control.polls import BEATS_PER_S, poll_for


class Board:
    """The master's state as far as the polls see it: a round number behind the master's condition."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.round = 1
        self.reads = 0

    def epoch(self) -> object:
        return self.round

    def news_since(self, seen: int) -> bool:
        self.reads += 1
        return self.round != seen

    def move(self) -> None:
        with self.changed:
            self.round += 1
            self.changed.notify_all()


def _poll(board: Board, resumed: list[str], name: str, deadline_s: float = 30.0) -> tuple[LongPoll, object]:
    seen = board.round
    poll = LongPoll(lambda: board.news_since(seen), time.monotonic() + deadline_s, lambda: name)
    return poll, lambda: resumed.append(name)


def test_parked_polls_go_back_when_the_state_they_wait_on_moves_and_not_before() -> None:
    board, resumed = Board(), []
    polls = LongPolls(board.changed, board.epoch)
    polls.start()
    for index in range(200):
        polls.park(*_poll(board, resumed, f"node{index}"))
    assert polls.parked == 200 and resumed == []
    reads = board.reads
    with board.changed:
        board.changed.notify_all()  # a change that moves nothing they wait on (a join): no poll is read
    time.sleep(0.2)
    assert board.reads == reads and resumed == []
    board.move()
    wait_for(lambda: len(resumed) == 200, 5, "every parked poll to go back")
    assert polls.parked == 0 and sorted(resumed) == sorted(f"node{index}" for index in range(200))
    polls.stop()


def test_a_ready_poll_that_says_it_is_urgent_goes_back_before_the_others() -> None:
    """A heartbeat carrying orders (a lost node's process to start) is answered ahead of those carrying only the new
    round: the handler pool takes it by the priority it has when handed back."""
    board, handed = Board(), []
    polls = LongPolls(board.changed, board.epoch)
    polls.start()
    for index in range(6):
        poll, _ = _poll(board, [], f"node{index}")
        poll.priority, poll.urgent = 0, (lambda index=index: index in (2, 5))
        polls.park(poll, lambda poll=poll: handed.append((poll.answer(), poll.priority)))
    board.move()
    wait_for(lambda: len(handed) == 6, 5, "every parked poll to go back")
    assert sorted(handed) == [("node0", 0), ("node1", 0), ("node2", URGENT), ("node3", 0), ("node4", 0),
                              ("node5", URGENT)]
    polls.stop()


def test_a_poll_goes_back_at_its_deadline_and_one_ready_when_parked_goes_back_at_once() -> None:
    board, resumed = Board(), []
    polls = LongPolls(board.changed, board.epoch)
    polls.start()
    began = time.monotonic()
    polls.park(LongPoll(lambda: False, began + 0.3, lambda: "due"), lambda: resumed.append("due"))
    poll, resume = _poll(board, resumed, "late")
    board.move()  # the state moved between the call and its parking
    polls.park(poll, resume)
    assert resumed == ["late"]
    wait_for(lambda: "due" in resumed, 3, "the poll to go back at its deadline")
    assert 0.25 <= time.monotonic() - began < 2.0
    assert resumed == ["late", "due"]
    polls.stop()


def test_the_stop_hands_back_every_parked_poll_and_a_poll_parked_after_it_goes_back_at_once() -> None:
    board, resumed = Board(), []
    polls = LongPolls(board.changed, board.epoch)
    polls.start()
    for index in range(5):
        polls.park(*_poll(board, resumed, f"node{index}"))
    polls.stop()
    assert len(resumed) == 5 and polls.parked == 0
    polls.park(*_poll(board, resumed, "after"))
    assert resumed[-1] == "after"


def test_a_poll_is_handed_back_once_even_when_ready_and_due_together() -> None:
    board, resumed = Board(), []
    polls = LongPolls(board.changed, board.epoch)
    polls.start()
    polls.park(*_poll(board, resumed, "once", deadline_s=0.05))
    time.sleep(0.05)
    board.move()
    wait_for(lambda: resumed, 3, "the poll to go back")
    time.sleep(0.2)
    assert resumed == ["once"]
    polls.stop()


def test_the_poll_asked_of_each_node_grows_with_the_job_and_stays_within_the_lease() -> None:
    assert poll_for(8, 1.0, 30.0) == 1.0  # a small job: the node's own poll
    assert poll_for(int(4 * BEATS_PER_S), 1.0, 60.0) == 4.0  # N / BEATS_PER_S beats a second
    assert poll_for(100_000, 1.0, 30.0) == 10.0  # a third of the heartbeat time-out at most
    assert poll_for(100_000, 1.0, 600.0) == 60.0  # and the protocol's bound


def test_a_poll_handed_back_lets_go_of_its_handler_without_the_garbage_collector() -> None:
    """The handler holds its poll and the poll's ``resume`` the handler: once handed back, the poll drops ``resume``,
    so an answered handler is freed when its last reference goes, not at the master's rare full collection."""
    class Handler:
        poll: LongPoll | None = None

    board = Board()
    polls = LongPolls(board.changed, board.epoch)
    handler, pool = Handler(), []  # the pool: what serves the handler once its poll goes back
    handler.poll = _poll(board, [], "node0")[0]
    polls.park(handler.poll, functools.partial(pool.append, handler))
    gone = weakref.ref(handler)
    gc.disable()
    try:
        polls.start()
        board.move()
        wait_for(lambda: pool, 5, "the poll to go back")
        assert handler.poll.resume is None
        del handler
        pool.clear()  # served, and let go
        assert gone() is None, "a cycle still holds the answered handler"
    finally:
        gc.enable()
        polls.stop()
