"""A learner's next batch, asked for while it trains on this one: one sample request is always in flight, on a
connection of its own (a thread of its own), so that the round trip to the replay service overlaps the learner's
step instead of adding to it. The new priorities of a batch ride on the request made once the learner has them: the
batch after next is drawn with them (one batch later than without the prefetch, as in Ape-X's asynchronous
priority updates)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import torch

from convoy.parallel.transport import Message
from convoy.workloads.rl.replay_client import ReplayClient

WAIT_S = 0.05
"""How long to wait before asking again while the buffer is empty or the throttle holds the learners back."""
Updated = dict[str, torch.Tensor] | None


class Prefetcher:
    def __init__(self, replay: ReplayClient, ask: Callable[[], tuple[int, float | None]]) -> None:
        """``replay``: the learner's client (its address and credentials; this one connects on its own); ``ask``:
        the batch and the paced target of each request, read when it is made (hot config changes land)."""
        self.client = ReplayClient(replay.find, replay.credentials, replay.find_s, replay.request_s, replay.lane_bytes,
                                   replay.direct)
        self.ask = ask
        self._requests: queue.Queue[tuple[Updated]] = queue.Queue()
        self._replies: queue.Queue[Message | BaseException] = queue.Queue()
        self._asked = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="replay-prefetch", daemon=True)
        self._thread.start()

    def next(self, updated: Updated) -> Message:
        """The batch asked for last time (asking now if nothing was), and the next one asked for with ``updated``
        (new priorities); an error of the request (the buffer's fence refusing an ended incarnation, a service
        gone for good) is raised here."""
        if not self._asked:
            self._requests.put((None,))
        answer = self._replies.get()
        if isinstance(answer, BaseException):
            self._asked = False
            raise answer
        self._requests.put((updated,))
        self._asked = True
        return answer

    def _run(self) -> None:
        while True:
            (updated,) = self._requests.get()
            if self._closed:
                return
            try:
                self._replies.put(self._fetch(updated))
            except BaseException as exc:  # noqa: BLE001 (handed to the learner's thread, raised there)
                self._replies.put(exc)

    def _fetch(self, updated: Updated) -> Message:
        while True:
            count, target = self.ask()
            reply = self.client.sample(count, target, updated)
            updated = None  # applied with the first call, whatever its answer
            if reply is not None:
                return reply
            time.sleep(WAIT_S)

    def close(self) -> None:
        """No more requests; the one in flight is let go (its thread is a daemon: it does not hold the exit)."""
        self._closed = True
        self._requests.put((None,))
        self._thread.join(timeout=0.5)
        if not self._thread.is_alive():
            self.client.close()
