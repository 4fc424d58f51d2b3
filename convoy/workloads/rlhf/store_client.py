"""A role process's link to the ``store`` role's service: one authenticated connection of the role transport,
found at the store's published address and found again when it breaks (a store that restarted or moved). One per
thread: a rollout's lease renewals go on a connection of their own, beside its puts."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from convoy.errors import ConfigError
from convoy.parallel.transport import Connection, ConnectionLost, Credentials, Message

FIND_S = 60.0
"""How long a call looks for the store (restarting, or not yet published) before it gives up."""
REQUEST_S = 30.0
"""How long one request may take (a take of many groups is tens of MB) before the connection is given up."""


class StoreClient:
    def __init__(self, find: Callable[[], str], credentials: Credentials | None = None, find_s: float = FIND_S,
                 request_s: float = REQUEST_S, stopping: Callable[[], bool] = lambda: False,
                 service: str = "sample store") -> None:
        """``stopping``: this process is ending (the job stops its services together): a lost store is not looked
        for again. ``service``: what the lines call it (the same link serves trainer 0's weights)."""
        self.find, self.credentials, self.find_s, self.request_s = find, credentials, find_s, request_s
        self.service = service
        self.stopping = stopping
        self.conn: Connection | None = None

    def call(self, op: str, meta: dict[str, Any] | None = None, tensors: dict[str, torch.Tensor] | None = None,
             into: dict[str, torch.Tensor] | None = None) -> Message:
        """One request, reconnecting (to the address ``find`` gives now) until ``find_s`` has passed; the reply's
        tensors received into ``into``'s where they fit."""
        deadline = time.monotonic() + self.find_s
        while True:
            try:
                if self.conn is None:
                    address = self.find()
                    if not address:
                        raise ConnectionLost(f"the {self.service} has published no address yet")
                    self.conn = Connection(address, self.request_s, credentials=self.credentials,
                                           service=self.service)
                return self.conn.request(Message(op, meta or {}, tensors or {}), into)
            except (ConnectionLost, OSError) as exc:
                self.close()
                if self.stopping():
                    raise ConnectionLost(f"the {self.service} went away as this process stops: {exc}") from exc
                if time.monotonic() > deadline:
                    raise ConfigError(f"the {self.service} could not be reached for {self.find_s:.0f} s: {exc}") \
                        from exc
                time.sleep(0.2)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None
