"""The ``store`` role's service: the prompts' queue and the sample store behind one listener of the role services'
authenticated transport. A rollout leases prompts, renews its leases while it works, and puts one group per prompt
(its responses' tokens, their log-probs under the policy that made them, their rewards, and that policy's version);
a trainer takes groups under the staleness rule and publishes each new version (with its weights' digest).

Ops: ``lease`` {count, version}, ``renew``, ``put`` {prompt, version} + tensors, ``drop`` {prompt, why},
``take`` {count, current}, ``publish`` {version, digest} (the trainers only), ``stats``, ``shutdown``. A rollout that
stops renewing for ``lease_s`` has its prompts given to others; its late groups are refused and counted. A put whose
tensors do not make one group of ``group_size`` responses is refused whole, naming what is wrong. With ``per_step``,
the service issues new prompt numbers itself, only as many as keep the rollouts within k trainer steps of the
trainers, and leases a rollout only as many as it can make before its weights fall out of k (a group made by
version v for a later step than v + k would be dropped as stale: work thrown away); a prompt dropped (its reward
function raised) is done and counted, and one more is issued in its place.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from convoy.errors import ConfigError
from convoy.parallel.transport import Credentials, Identity, Limits, Listener, Message
from convoy.parallel.transport.handshake import Admit
from convoy.workloads.rlhf.prompts import PromptQueue
from convoy.workloads.rlhf.store import KEPT, SampleStore

TICK_S = 0.5
GROUP_TENSORS = ("tokens", "mask", "logprobs", "rewards")
"""A group: tokens and mask [responses, length] (prompt and response; mask 1 on response tokens), log-probs
[responses, length] (0 outside the response), rewards [responses]."""


def holder(caller: Identity | None, message: Message) -> str:
    if caller is not None:
        return f"{caller.role}:{caller.rank}:{caller.incarnation}"
    return str(message.meta.get("holder", ""))


class StoreService:
    def __init__(self, store: SampleStore, prompts: PromptQueue, group_size: int, host: str = "127.0.0.1",
                 port: int = 0, *, per_step: int = 0, credentials: Credentials | None = None,
                 admit: Admit | None = None, limits: Limits | None = None, say: Callable[[str], None] = print) -> None:
        if group_size < 2:
            raise ConfigError(f"a group needs >= 2 responses (GRPO compares them), got {group_size}")
        if per_step < 0:
            raise ConfigError(f"per_step must be >= 0 groups (0: prompts are added by the caller), got {per_step}")
        self.store, self.prompts, self.group_size, self.say = store, prompts, group_size, say
        self.per_step = per_step
        """Groups a trainer step takes: new prompts are issued on demand up to ``per_step * (published + 1 + k)``,
        so the rollouts run at most k steps ahead of the trainers (k = 0: one step's prompts per version)."""
        self.issued = 0
        self.heard: dict[str, float] = {}
        """When each rollout last called (its leases and renewals): one silent for ``lease_s`` is presumed stopped,
        whether or not it holds prompts."""
        self.silent: set[str] = set()
        self.dropped: dict[str, int] = {}
        """Prompts a rollout could make no group of, by why (a reward function that raised): done, not asked again."""
        self.lock = threading.Lock()
        self.digests: dict[int, str] = {}
        """Each published version's weights digest, as the trainer reported it."""
        self.weights: dict[str, str] = {}
        """Where the newest version is: trainer 0's board (its path and id) and its weight service's address."""
        self.refused_malformed = 0
        self.stopped = threading.Event()
        self.ops: dict[str, Callable[[Message, Identity | None], Message]] = {
            "lease": self._lease, "renew": self._renew, "put": self._put, "drop": self._drop, "take": self._take,
            "publish": self._publish, "weights": self._weights, "stats": self._stats, "shutdown": self._shutdown}
        self.listener = Listener(self.handle, host, port, replied=self._replied, credentials=credentials,
                                 admit=admit, limits=limits)
        self.address = self.listener.address
        self._ticker = threading.Thread(target=self._tick, name="store-ticker", daemon=True)
        self._ticker.start()

    def handle(self, message: Message, caller: Identity | None = None) -> Message:
        op = self.ops.get(message.op)
        if op is None:
            raise ConfigError(f"unknown store op {message.op!r}; one of {sorted(self.ops)}")
        return op(message, caller)

    def _lease(self, message: Message, caller: Identity | None) -> Message:
        """Prompts for a rollout whose weights are ``version`` (none while its version is too old to be trained on:
        it takes the newer weights first)."""
        count, version = int(message.meta.get("count", 1)), message.meta.get("version")
        if count < 1:
            raise ConfigError(f"lease at least one prompt, got {count}")
        with self.lock:
            self._heard(holder(caller, message))
            published = self.store.published
            if version is not None and int(version) < published - self.store.max_lag:
                return Message("leased", {"prompts": [], "published": published})
            if self.per_step:
                count = min(count, self._room(int(version))) if version is not None else count
                if count < 1:  # its group would be taken after its version fell out of k: newer weights first
                    return Message("leased", {"prompts": [], "published": published})
                allowed = self.per_step * (published + 1 + self.store.max_lag) + sum(self.dropped.values())
                fresh = max(0, min(count - len(self.prompts.waiting), allowed - self.issued))
                self.prompts.add(list(range(self.issued, self.issued + fresh)))
                self.issued += fresh
            taken = self.prompts.lease(holder(caller, message), count, time.monotonic())
            return Message("leased", {"prompts": taken, "published": published})

    def _room(self, version: int) -> int:
        """(With the lock held.) How many more groups a rollout holding ``version`` can make that a trainer will
        take while that version is within k. The trainers take ``per_step`` groups a version, oldest first, so a new
        group comes after the groups the current step took, those held and those in the making: it is taken at
        version ``published + (taken + held + leased) // per_step``, which must be <= ``version + k``. A rollout
        with the newest weights always has room while the current step lacks groups, so none waits on this for
        ever; with k = 0 it waits for the next version once the step has all its groups."""
        ahead = self.store.taken_now + self.store.fresh() + len(self.prompts.leased)
        return self.per_step * (version + self.store.max_lag + 1 - self.store.published) - ahead

    def _renew(self, message: Message, caller: Identity | None) -> Message:
        with self.lock:
            self._heard(holder(caller, message))
            held = self.prompts.renew(holder(caller, message), time.monotonic())
            return Message("renewed", {"held": held, "published": self.store.published})

    def _put(self, message: Message, caller: Identity | None) -> Message:
        prompt, version = int(message.meta["prompt"]), int(message.meta["version"])
        try:
            group = self._group_of(message.tensors)
        except ConfigError:
            with self.lock:
                self.refused_malformed += 1
            raise
        with self.lock:
            if not self.prompts.finish(holder(caller, message), prompt):
                return Message("refused", {"why": f"prompt {prompt} is no longer leased to this rollout: it went to "
                                                  "another (this one was presumed stopped)"})
            outcome = self.store.put(version, {"prompt": prompt, **group}, holder(caller, message))
            if outcome != KEPT:
                self.prompts.add([prompt])  # its group is not kept: the prompt is asked again
            return Message("put", {"outcome": outcome, "published": self.store.published})

    def _drop(self, message: Message, caller: Identity | None) -> Message:
        prompt, why = int(message.meta["prompt"]), str(message.meta.get("why", ""))[:200] or "no reason given"
        with self.lock:
            if not self.prompts.finish(holder(caller, message), prompt):
                return Message("refused", {"why": f"prompt {prompt} is no longer leased to this rollout"})
            self.dropped[why] = self.dropped.get(why, 0) + 1
            return Message("dropped", {"published": self.store.published})

    def _group_of(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        missing = sorted(set(GROUP_TENSORS) - set(tensors))
        if missing:
            raise ConfigError(f"a group needs the tensors {list(GROUP_TENSORS)}; missing {missing}")
        tokens, mask, logprobs, rewards = (tensors[name] for name in GROUP_TENSORS)
        if tokens.dim() != 2 or tokens.shape[0] != self.group_size or mask.shape != tokens.shape \
                or logprobs.shape != tokens.shape or rewards.shape != (self.group_size,):
            raise ConfigError(f"a group is {self.group_size} responses: tokens, mask and logprobs [responses, length], "
                              f"rewards [responses]; got {list(tokens.shape)}, {list(mask.shape)}, "
                              f"{list(logprobs.shape)}, {list(rewards.shape)}")
        if not bool(torch.isfinite(rewards).all()) or not bool(torch.isfinite(logprobs).all()):
            raise ConfigError("a group's rewards and log-probs must be finite")
        return {name: tensors[name] for name in GROUP_TENSORS}

    def _take(self, message: Message, caller: Identity | None) -> Message:
        count, current = int(message.meta.get("count", 1)), int(message.meta["current"])
        with self.lock:
            groups = self.store.take(count, current)
        if not groups:
            return Message("empty", {"published": self.store.published})
        length = max(int(g.payload["tokens"].shape[1]) for g in groups)
        batch = {name: torch.cat([_padded(g.payload[name], length) for g in groups]) for name in GROUP_TENSORS[:3]}
        batch["rewards"] = torch.cat([g.payload["rewards"] for g in groups])
        batch["versions"] = torch.tensor([g.version for g in groups], dtype=torch.int64)
        return Message("taken", {"groups": len(groups), "prompts": [g.payload["prompt"] for g in groups]}, batch)

    def _publish(self, message: Message, caller: Identity | None) -> Message:
        if caller is not None and caller.role != "trainer":
            raise ConfigError(f"{caller.describe()} may not publish versions: only the trainers train the weights")
        version = int(message.meta["version"])
        with self.lock:
            self.store.publish(version)
            self.digests[version] = str(message.meta.get("digest", ""))
            where = {key: str(message.meta[key]) for key in ("board", "board_id", "weights_at") if key in message.meta}
            if where:
                self.weights = where
        return Message("published", {"version": version})

    def _weights(self, message: Message, caller: Identity | None) -> Message:
        with self.lock:
            return Message("weights", {**self.weights, "version": self.store.published})

    def stats(self) -> dict[str, Any]:
        with self.lock:
            queue = self.prompts
            return {**self.store.stats(), "prompts_waiting": len(queue.waiting), "prompts_leased": len(queue.leased),
                    "prompts_done": queue.done, "prompts_requeued": queue.requeued, "late_groups": queue.late,
                    "refused_malformed": self.refused_malformed, "dropped_prompts": dict(self.dropped),
                    "issued": self.issued, "digests": {str(v): d for v, d in sorted(self.digests.items())}}

    def _stats(self, message: Message, caller: Identity | None) -> Message:
        return Message("stats", self.stats())

    def _shutdown(self, message: Message, caller: Identity | None) -> Message:
        return Message("bye", {})

    def _replied(self, reply: Message) -> None:
        if reply.op == "bye":
            self.stopped.set()

    def _heard(self, name: str) -> None:
        """(With the lock held.)"""
        self.heard[name] = time.monotonic()
        if name in self.silent:
            self.silent.discard(name)
            self.say(f"store: {name} answers again; the groups it makes for prompts that went to others are refused")

    def _tick(self) -> None:
        while not self.stopped.wait(TICK_S):
            now = time.monotonic()
            with self.lock:
                quiet = {name for name, at in self.heard.items() if now - at > self.prompts.lease_s}
                expiring = {lease.holder for lease in self.prompts.leased.values() if lease.until <= now}
                stopped = sorted((quiet | expiring) - self.silent)
                self.silent.update(stopped)
                given = {name: len(self.prompts.release(name)) for name in stopped}
                self.prompts.expire(now)  # a lease that ran out of a holder said stopped before
            for name in stopped:
                self.say(f"store: {name} renewed no lease for {self.prompts.lease_s:g} s: presumed stopped, its "
                         f"{given[name]} prompt(s) go to the other rollouts")

    def close(self) -> None:
        self.stopped.set()
        self.listener.close()


def _padded(tensor: torch.Tensor, length: int) -> torch.Tensor:
    return torch.nn.functional.pad(tensor, (0, length - int(tensor.shape[1])))
