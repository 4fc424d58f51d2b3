"""The API's answers by idempotency key: a repeat gets the first answer, even while it is being made."""

from __future__ import annotations

import threading
import time

from convoy.control.replies import ReplyCache


def test_a_repeat_while_the_first_call_runs_waits_for_its_answer() -> None:
    cache = ReplyCache()
    assert cache.begin("k") is None, "the first call of a key runs"
    answers: list[object] = []
    repeat = threading.Thread(target=lambda: answers.append(cache.begin("k")))
    repeat.start()
    time.sleep(0.2)
    assert not answers, "the repeat waits while the first call is in flight"
    cache.finish("k", 200, b'{"ok": true}')
    repeat.join(5.0)
    assert answers == [(200, b'{"ok": true}', True)]


def test_a_fault_is_not_kept_and_an_unwritten_answer_can_be_marked_written() -> None:
    cache = ReplyCache()
    cache.begin("fault")
    cache.finish("fault", 500, None)
    assert cache.begin("fault") is None, "after a fault the retry runs the call again"
    cache.begin("late")
    cache.finish("late", 200, b"{}", written=False)
    assert cache.begin("late") == (200, b"{}", False)
    cache.mark_written("late")
    assert cache.begin("late") == (200, b"{}", True)


def test_the_cache_is_bounded_by_count_and_bytes_oldest_first() -> None:
    cache = ReplyCache(max_replies=3, max_bytes=10)
    for index in range(4):
        cache.begin(f"k{index}")
        cache.finish(f"k{index}", 200, b"xx")
    assert cache.begin("k0") is None, "the oldest answer was forgotten"
    cache.finish("k0", 200, b"x" * 9)
    assert cache.begin("k3") is None and cache.begin("k0") == (200, b"x" * 9, True)
