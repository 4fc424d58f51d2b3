"""The prompts' queue (pure): each prompt is leased to one rollout process at a time, with a deadline; a rollout that
dies, or stops answering past its deadline, has its prompts put back at the queue's head for the next rollout to
take. A result for a prompt whose lease has ended (its rollout was presumed dead, then came back) is refused and
counted: each prompt's group is stored once.

A rollout is named ``role:rank:incarnation`` (its process), so a replacement of the same rank is another holder.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from convoy.errors import ConfigError


@dataclass
class Lease:
    holder: str
    until: float


@dataclass
class PromptQueue:
    """Prompt ids waiting (``waiting``) and leased (``leased``); ``lease_s``: how long a rollout may hold a prompt
    before it is presumed stopped and the prompt goes back."""

    lease_s: float
    waiting: deque[int] = field(default_factory=deque)
    leased: dict[int, Lease] = field(default_factory=dict)
    done: int = 0
    requeued: int = 0
    """Prompts put back because their rollout died or its lease ran out."""
    late: int = 0
    """Results refused: their lease had ended (the prompt went to another rollout)."""

    def __post_init__(self) -> None:
        if self.lease_s <= 0:
            raise ConfigError(f"a prompt's lease must be > 0 s, got {self.lease_s}")

    def add(self, prompt_ids: list[int]) -> None:
        self.waiting.extend(prompt_ids)

    def lease(self, holder: str, count: int, now: float) -> list[int]:
        """Up to ``count`` prompts for ``holder`` until ``now + lease_s`` (expired leases go back first)."""
        self.expire(now)
        taken = []
        while self.waiting and len(taken) < count:
            prompt = self.waiting.popleft()
            self.leased[prompt] = Lease(holder, now + self.lease_s)
            taken.append(prompt)
        return taken

    def renew(self, holder: str, now: float) -> int:
        """``holder`` is alive and working: its leases run from ``now``. Returns how many it holds."""
        held = 0
        for lease in self.leased.values():
            if lease.holder == holder:
                lease.until = now + self.lease_s
                held += 1
        return held

    def finish(self, holder: str, prompt: int) -> bool:
        """``holder`` made ``prompt``'s group: True if its lease was current (store the group), False if the prompt
        went to another rollout meanwhile (refused, counted)."""
        lease = self.leased.get(prompt)
        if lease is None or lease.holder != holder:
            self.late += 1
            return False
        del self.leased[prompt]
        self.done += 1
        return True

    def release(self, holder: str) -> list[int]:
        """``holder`` died or was replaced: its prompts back at the head of the queue, in order."""
        back = sorted(prompt for prompt, lease in self.leased.items() if lease.holder == holder)
        for prompt in back:
            del self.leased[prompt]
        self.waiting.extendleft(reversed(back))
        self.requeued += len(back)
        return back

    def expire(self, now: float) -> list[str]:
        """Release the prompts of every holder whose lease ran out; the holders presumed stopped."""
        stopped = sorted({lease.holder for lease in self.leased.values() if lease.until <= now})
        for holder in stopped:
            self.release(holder)
        return stopped
