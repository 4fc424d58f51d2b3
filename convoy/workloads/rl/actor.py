"""An actor process: runs the newest policy it has on its slices of the environment and inserts n-step
transitions into the replay buffer, fetching newer weights by version every ``weights_every_s``.

It is elastic: the controller adds and removes actors, a killed one is replaced (``replace`` policy), and one
asked to give its CPU back (``convoy.role().preempted``, looked at every ``insert_batch`` steps) cuts its episode
there as a time limit would (its n-step transitions bootstrap from the last observation), flushes them, and exits 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from convoy.worker.report import report
from convoy.workloads.rl.config import RLConfig
from convoy.workloads.rl.dqn import epsilon_at, greedy_or_random, q_network
from convoy.workloads.rl.envs import SlicedEnv
from convoy.workloads.rl.nstep import NStep, Transition
from convoy.workloads.rl.replay_client import ReplayClient

REPORT_EVERY = 100
"""Environment steps per ``convoy.report`` (where a hot change of the config lands, e.g. ``step_cost``)."""


def to_batch(transitions: list[Transition]) -> dict[str, torch.Tensor]:
    return {"obs": torch.tensor([t.obs for t in transitions], dtype=torch.float32),
            "action": torch.tensor([t.action for t in transitions], dtype=torch.int64),
            "reward": torch.tensor([t.reward for t in transitions], dtype=torch.float32),
            "next_obs": torch.tensor([t.next_obs for t in transitions], dtype=torch.float32),
            "discount": torch.tensor([t.discount for t in transitions], dtype=torch.float32)}


class Actor:
    def __init__(self, cfg: RLConfig, replay: ReplayClient, rank: int, say: Callable[[str], None] = print,
                 incarnation: int = 0, preempted: Callable[[], bool] = lambda: False) -> None:
        self.cfg, self.replay, self.rank, self.say = cfg, replay, rank, say
        self.preempted = preempted
        self.env = SlicedEnv(cfg.env, None, cfg.step_cost, cfg.slicing, cfg.slices, cfg.seeds)
        self.net = q_network(self.env.spec.obs_size, self.env.spec.actions, cfg.hidden)
        self.version = 0
        self.deal_version = -1
        # its own stream: a replacement (a new incarnation of the rank) does not replay its predecessor's episodes
        self.rng = torch.Generator().manual_seed(cfg.seed * 1_000_003 + rank * 7919 + incarnation * 104_729)
        self.pending: list[Transition] = []
        self.returns: list[float] = []
        """Returns of the episodes finished since the last insert (sent with it)."""
        self.last_return: float | None = None
        self.steps_unsent = 0
        self.episodes = 0
        self.sent = 0
        """Transitions this process inserted (the buffer's count of its source, once it acknowledged them all)."""
        self.steps = 0
        """This actor's environment steps."""
        self.job_steps = 0
        """The whole job's environment steps as the buffer last said (drives the exploration's decay)."""
        self._fetched_at = 0.0

    def refresh(self, force: bool = False) -> None:
        """Newer weights and this actor's slices, at most every ``weights_every_s``."""
        now = time.monotonic()
        if not force and now - self._fetched_at < self.cfg.weights_every_s:
            return
        self._fetched_at = now
        newer = self.replay.get_weights(self.version)
        if newer is not None:
            self.version, tensors = newer
            self.net.load_state_dict(tensors)
        version, slices = self.replay.get_slices()
        if version != self.deal_version:
            self.deal_version = version
            self.env.own(slices)

    def episode(self) -> bool:
        """Play one episode, inserting as transitions complete; whether it was cut short by a preemption."""
        self.refresh(force=self.episodes == 0)
        self.env.step_cost = self.cfg.step_cost
        nstep = NStep(self.cfg.n_step, self.cfg.gamma)
        obs, _ = self.env.reset()
        total, done, cut = 0.0, False, False
        while not done:
            epsilon = epsilon_at(self.job_steps, self.cfg.epsilon_start, self.cfg.epsilon_end, self.cfg.epsilon_steps)
            with torch.no_grad():
                q = self.net(torch.as_tensor(obs, dtype=torch.float32))
            action = greedy_or_random(q, epsilon, self.rng)
            next_obs, reward, terminated, truncated = self.env.step(action)
            total += reward
            self.steps_unsent += 1
            self.steps += 1
            if self.steps % REPORT_EVERY == 0:  # a unit of steady size: the rules compare step times
                returned = {"episode_return": self.last_return} if self.last_return is not None else {}
                report(self.steps // REPORT_EVERY - 1, **returned)
            cut = not (terminated or truncated) and self.steps % self.cfg.insert_batch == 0 and self.preempted()
            self.pending += nstep.step(obs.tolist(), action, reward, next_obs.tolist(), terminated, truncated or cut)
            obs, done = next_obs, terminated or truncated or cut
            if done and not cut:  # a cut episode did not finish: its return is no episode's
                self.returns.append(total)
                self.last_return = total
            if len(self.pending) >= self.cfg.insert_batch or done:
                self.flush()
            self.refresh()
        self.episodes += 1
        return cut

    def flush(self) -> None:
        if not self.pending:
            return
        answer = self.replay.insert(to_batch(self.pending), self.returns, self.steps_unsent, self.env.take_visits())
        self.sent += len(self.pending)
        self.job_steps = int(answer.get("env_steps", self.job_steps + self.steps_unsent))
        self.pending, self.returns, self.steps_unsent = [], [], 0

    def run(self) -> str:
        """Episodes until the job stops this process or asks for its CPU back; why it stopped."""
        while not self.episode():
            if self.preempted():
                break
        self.flush()
        unkept = self.replay.settle()
        return f"preempted: episode cut at step {self.steps}; {self.sent} transitions inserted, {unkept} not yet " \
               "in the buffer's snapshot"
