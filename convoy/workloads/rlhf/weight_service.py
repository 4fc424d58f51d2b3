"""The weights for rollouts that cannot map trainer 0's board (another host, or ``weights = "transport"``): trainer 0
serves its board's current version on the role transport (the job's secret, the node's own address), and such a
rollout pulls each newer version through it as the board's buckets, a few large tensors, never one message per
parameter.

The service sends views of the board's slot, so the trainer never waits and never copies; the writer comes round to
that slot two versions later, so once the reader holds every byte it asks whether the slot is still as it was when
the views were taken (``intact``: the slot's sequence number, one small round trip) and asks for the newest again
if not (a torn copy is never kept, and no bytes are hashed for it). ``RemoteBoard`` is the reading end with the
board's own reading calls (``read_into``, ``read_digest``, ``digest_of``): a rollout's weight thread takes either,
and checks each version's digest against the trainer's as it does for the board.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from convoy.errors import ConfigError
from convoy.parallel.transport import Credentials, Identity, Listener, Message
from convoy.parallel.transport.handshake import Admit
from convoy.workloads.rlhf.buckets import Manifest
from convoy.workloads.rlhf.store_client import StoreClient
from convoy.workloads.rlhf.weight_board import WeightBoard

PULL_TRIES = 5
"""Pulls in a row torn by the trainer writing the slot meanwhile before giving up."""
PULL_S = 120.0
"""How long one pull may take (540 MB over a slow link) before the connection is given up."""


class WeightService:
    """Trainer 0's board on the transport: ``manifest`` (the buckets' layout), ``newer`` (the current version's
    buckets, if newer than the caller's) and ``intact`` (whether a slot is as it was when it was sent)."""

    def __init__(self, board: WeightBoard, host: str = "127.0.0.1", port: int = 0, *,
                 credentials: Credentials | None = None, admit: Admit | None = None) -> None:
        self.board = board
        self.served = 0
        """Versions sent (a pull asked again after a torn read counts again)."""
        self.listener = Listener(self.handle, host, port, credentials=credentials, admit=admit)
        self.address = self.listener.address

    def handle(self, message: Message, caller: Identity | None = None) -> Message:
        if message.op == "manifest":
            return Message("manifest", {"manifest": self.board.manifest.describe()})
        if message.op == "intact":
            slot, seq = message.meta.get("slot"), message.meta.get("seq")
            if slot not in (0, 1) or not isinstance(seq, int):
                raise ConfigError(f"intact takes a slot (0 or 1) and its sequence number, got {slot!r} and {seq!r}")
            return Message("intact", {"intact": self.board.unchanged(slot, seq)})
        if message.op != "newer":
            raise ConfigError(f"unknown weights op {message.op!r}; the weight service answers manifest, newer and "
                              "intact")
        have = message.meta.get("have")
        if not isinstance(have, int):
            raise ConfigError(f"newer takes the version the caller holds as an integer, got {have!r}")
        view = self.board.current_view()
        if view is None or view.version <= have:
            return Message("none", {"current": -1 if view is None else view.version})
        self.served += 1
        return Message("weights", {"version": view.version, "digest": view.digest, "slot": view.slot,
                                   "seq": view.seq}, {f"bucket{index}": bucket for index, bucket in
                                                      enumerate(view.buckets)})

    def close(self) -> None:
        self.listener.close()


class RemoteBoard:
    """The reading end of a weight service at the address ``find`` gives (found again when the connection breaks:
    a trainer group that restarted serves at a new one)."""

    def __init__(self, find: Callable[[], str], credentials: Credentials | None = None,
                 stopping: Callable[[], bool] = lambda: False) -> None:
        self.link = StoreClient(find, credentials, request_s=PULL_S, stopping=stopping, service="weight service")
        self.manifest = Manifest.from_description(self.link.call("manifest").meta["manifest"])
        self.landing = {f"bucket{index}": bucket for index, bucket in enumerate(self.manifest.empty())}
        """Where each version's buckets are received: the same pages every version (fresh ones cost a fault each)."""
        self.read_digest = ""
        self.pulled_bytes = 0
        self.torn = 0
        """Pulls not kept: the trainer wrote their slot while they were sent."""

    def read_into(self, named: Mapping[str, torch.Tensor], have: int) -> int | None:
        """As ``WeightBoard.read_into``: a version newer than ``have`` copied into ``named`` and its number (its
        digest in ``read_digest``), None when the trainer has none newer."""
        self.manifest.check(named)
        for _ in range(PULL_TRIES):
            reply = self.link.call("newer", {"have": have}, into=self.landing)
            if reply.op == "none":
                return None
            buckets = [reply.tensors[f"bucket{index}"] for index in range(len(self.manifest.buckets))]
            got = [(bucket.dtype, bucket.numel()) for bucket in buckets]
            if got != list(self.manifest.buckets):
                raise ConfigError(f"the weight service sent buckets {got}; its manifest says {self.manifest.buckets}")
            self.pulled_bytes += sum(bucket.nbytes for bucket in buckets)
            asked = {"slot": reply.meta["slot"], "seq": reply.meta["seq"]}
            if not self.link.call("intact", asked).meta["intact"]:
                self.torn += 1
                continue  # the trainer came round to that slot while it was sent: ask for the newest again
            self.manifest.unpack(buckets, named)
            self.read_digest = str(reply.meta["digest"])
            return int(reply.meta["version"])
        raise ConfigError(f"{PULL_TRIES} pulls of the weights in a row were torn by the trainer writing the slot "
                          "meanwhile: it publishes faster than a version crosses the link")

    def digest_of(self, named: Mapping[str, torch.Tensor]) -> str:
        return self.manifest.digest_of(named)

    def close(self) -> None:
        self.link.close()
