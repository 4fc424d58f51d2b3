"""A rollout's lease renewals (``rollout.LeaseKeeper``): when the store refuses the process (a replaced incarnation,
as in a job's teardown) or is gone, the thread ends quietly and leaves it to the main loop, with no traceback."""

from __future__ import annotations

import threading

import pytest

from convoy.parallel.transport import ConnectionLost
from convoy.parallel.transport.errors import StaleIncarnation
from convoy.workloads.rlhf.rollout import LeaseKeeper


class Store:
    def __init__(self, fault: Exception) -> None:
        self.fault, self.calls = fault, 0

    def call(self, op: str) -> None:
        assert op == "renew"
        self.calls += 1
        if self.calls == 2:
            raise self.fault


@pytest.mark.parametrize("fault", [StaleIncarnation("rollout 0 (incarnation 2) has ended"), ConnectionLost("gone")])
def test_a_refused_or_lost_renewal_ends_the_thread_without_a_traceback(fault: Exception,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    raised: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_value))
    store = Store(fault)
    keeper = LeaseKeeper(store, 0.01)  # type: ignore[arg-type]
    keeper.start()
    keeper.join(5)
    assert not keeper.is_alive() and store.calls == 2 and raised == []
