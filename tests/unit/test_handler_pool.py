"""The master's handler pool when every thread is busy: what comes waits (heartbeats first), and the master is woken
so that the long polls it holds answer at once and give their threads to the waiting requests (with 1024 agents a
round's waits otherwise sat behind 256 held polls: 374 of 1024 nodes held the round after 24 s, all of them with
the wake-up; ``benchmarks/results/scale.txt``)."""

from __future__ import annotations

import threading

from convoy.control.limits import HandlerPool


def test_a_request_that_must_wait_wakes_the_long_polls_held_and_is_served_when_one_lets_go() -> None:
    wake = threading.Condition()
    held, served, order = threading.Event(), threading.Event(), []
    woken: list[bool] = []

    def serve(item: object) -> None:
        if item == "poll":
            with wake:  # a long poll: it holds its thread until woken (or its time is up)
                held.set()
                woken.append(wake.wait(timeout=10))
        order.append(item)
        if item == "wait":
            served.set()

    pool = HandlerPool(1, serve)
    pool.wake = wake
    pool.submit(0, "poll")
    assert held.wait(5)
    pool.submit(1, "wait")  # no thread free: it waits, and the held poll is woken
    assert served.wait(5), "the waiting request got the poll's thread"
    assert woken == [True] and order == ["poll", "wait"] and pool.waiting == 0


def test_without_a_crowd_nothing_is_woken() -> None:
    wake = threading.Condition()
    notified: list[bool] = []
    pool = HandlerPool(2, lambda item: None)
    pool.wake = wake
    def listen() -> None:
        with wake:
            notified.append(wake.wait(0.3))

    listener = threading.Thread(target=listen)
    listener.start()
    pool.submit(0, "heartbeat")
    listener.join()
    assert notified == [False]
