"""The RL job's controller, a small role of its own: every second it reads the buffer's rates and the roles'
counts, asks ``RateController`` (pure) what to change and carries it out with ``convoy.scale`` (the master records
each change as an event naming the rates that caused it), and deals the slices to the actor ranks the job now
wants, checking after every deal that each slice is owned exactly once."""

from __future__ import annotations

import time
from collections.abc import Callable

from convoy.errors import ConfigError
from convoy.worker.scaling import RoleCounts
from convoy.worker.scaling import roles as role_counts
from convoy.worker.scaling import scale
from convoy.workloads.rl.config import RLConfig
from convoy.workloads.rl.envs import declare_slices, make
from convoy.workloads.rl.replay_client import ReplayClient
from convoy.workloads.rl.scaling import Bounds, RateController, Rates, ScalingPolicy
from convoy.workloads.rl.slices import SliceBook

TICK_S = 1.0
REFUSED_S = 10.0
"""How long a role whose growth the master refused (no room for a group's new members) is not grown again."""


class Controller:
    def __init__(self, cfg: RLConfig, replay: ReplayClient, say: Callable[[str], None] = print) -> None:
        self.cfg, self.replay, self.say = cfg, replay, say
        env = make(cfg.env)
        self.book = SliceBook(declare_slices(env, cfg.slicing, cfg.slices, cfg.seeds))
        env.close()
        self.rates: RateController | None = None
        self.decisions = 0
        self._dealt_for: tuple[int, ...] | None = None
        self.refused: dict[str, float] = {}
        """Role -> when the master last refused to grow it."""

    def _policy(self, roles: dict[str, RoleCounts]) -> ScalingPolicy:
        actor, learner = roles["actor"], roles["learner"]
        return ScalingPolicy(self.cfg.target_ratio, Bounds(actor.minimum, actor.maximum or actor.wanted),
                             Bounds(learner.minimum, learner.maximum or learner.wanted), self.cfg.tolerance)

    def tick(self) -> None:
        roles = role_counts()
        if "actor" not in roles or "learner" not in roles:
            raise ConfigError("an RL job needs the roles actor and learner (examples/rl_dqn.toml)")
        self._deal(roles["actor"].wanted)
        if self.cfg.mode != "scale":
            return
        policy = self._policy(roles)
        if self.rates is None or self.rates.policy.target != policy.target:
            self.rates = RateController(policy)  # a hot change of the target starts afresh
        stats = self.replay.stats()
        # the learners' demand (their nominal batches): what they sample is paced to the target already
        rates = Rates(float(stats["inserts_per_s"]), float(stats["demanded_per_s"]),  # type: ignore[arg-type]
                      roles["actor"].running, roles["learner"].running)
        now = time.monotonic()
        pending = frozenset(name for name in ("actor", "learner")
                            if roles[name].pending or now - self.refused.get(name, -REFUSED_S) < REFUSED_S)
        decision = self.rates.decide(rates, pending)
        if decision is None:
            return
        try:
            scale(decision.role, decision.count, decision.reason)
        except ConfigError as exc:  # the master refused (a group's new members have no room): it is not grown for now
            self.refused[decision.role] = now
            self.say(f"controller: {decision.role} stays at {roles[decision.role].wanted}: {exc}")
            return
        self.decisions += 1
        self.say(f"controller: {decision.role} -> {decision.count}: {decision.reason}")

    def _deal(self, actors: int) -> None:
        """Deal again when the actors' count changed; put the deal to the buffer every tick (a restarted buffer
        has it back within a second)."""
        ranks = tuple(range(actors))
        if ranks == self._dealt_for:
            self.replay.put_deal({int(rank): owned for rank, owned in self.book.dealt.items()})
            return
        dealt = self.book.redeal([str(rank) for rank in ranks])
        self.replay.put_deal({int(rank): owned for rank, owned in dealt.items()})
        self._dealt_for = ranks
        self.say(f"controller: {len(self.book.slices)} slices dealt to {actors} actor(s), each owned once "
                 f"(deal {self.book.deals}, {self.book.moved} moved in all)")

    def run(self) -> None:
        while True:
            started = time.monotonic()
            self.tick()
            time.sleep(max(0.0, TICK_S - (time.monotonic() - started)))
