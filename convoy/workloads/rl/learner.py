"""A learner process, one of a role group (``group = true``): the learners form their own torch.distributed world,
each samples its share of the batch from the replay buffer, and DDP averages their gradients (double DQN, a target
network copied every ``target_every`` steps). Rank 0 puts the newest weights to the buffer for the actors and
decides, for all, when the job has trained enough. A snapshot after every step (``convoy.Checkpointer``): a learner
that fails re-forms the group with the others from it, and no finished step is lost."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from convoy.parallel.transport.errors import StaleIncarnation
from convoy.runtime.checkpoint import Checkpointer
from convoy.runtime.init import init
from convoy.worker.report import report
from convoy.workloads.rl.config import RLConfig
from convoy.workloads.rl.dqn import double_dqn_loss, q_network
from convoy.workloads.rl.envs import EnvSpec
from convoy.workloads.rl.prefetch import Prefetcher
from convoy.workloads.rl.replay_client import ReplayClient

PUSH_EVERY_S = 0.25
"""How often rank 0 puts the newest weights to the buffer."""
WAIT_S = 0.05
NOTICE_WAIT_S = 2.0
"""How long a learner whose group broke waits for its notice before it takes the break for a failure."""


@dataclass
class Curve:
    """The learning curve rank 0 keeps: (environment steps, mean return of the last 100 episodes)."""

    points: list[tuple[int, float]] = field(default_factory=list)

    def add(self, env_steps: int, mean_return: float | None) -> None:
        if mean_return is not None and (not self.points or env_steps > self.points[-1][0]):
            self.points.append((env_steps, mean_return))


@dataclass
class Progress:
    """What a learner's snapshot keeps beside the networks: the job's environment steps it last saw and the weights'
    version it last put."""

    env_steps: int = 0
    version: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"env_steps": self.env_steps, "version": self.version}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.env_steps, self.version = int(state["env_steps"]), int(state["version"])


class Learner:
    def __init__(self, cfg: RLConfig, replay: ReplayClient, spec: EnvSpec, say: Callable[[str], None] = print,
                 preempted: Callable[[], bool] = lambda: False) -> None:
        self.cfg, self.replay, self.say, self.preempted = cfg, replay, say, preempted
        self.left = False
        """Whether the group stopped because one of its members was preempted (it forms again smaller, from the
        snapshots of the last step)."""
        self.ctx = init()
        torch.manual_seed(cfg.seed)
        self.online = q_network(spec.obs_size, spec.actions, cfg.hidden)
        self.target = copy.deepcopy(self.online)
        self.model = DistributedDataParallel(self.online)
        self.optimizer = torch.optim.Adam(self.online.parameters(), lr=cfg.lr)
        self.curve = Curve()
        self.progress = Progress()
        self.ckpt = Checkpointer(self.model, self.optimizer, state={"target": self.target,
                                                                           "progress": self.progress})
        self.start = self.ckpt.restore()
        self.share = max(1, cfg.batch // self.ctx.world_size)
        self._pushed_at = 0.0
        self._updated: dict[str, torch.Tensor] | None = None
        """New priorities of the last batch, not sent yet (they go with the next request for a sample)."""
        self.prefetch = Prefetcher(replay, lambda: (self.share, cfg.target_ratio if cfg.mode == "scale" else None))

    def _wait_for_data(self) -> None:
        while True:
            stats = self.replay.stats()
            if int(stats["size"]) >= self.cfg.learning_starts:  # type: ignore[call-overload]
                return
            time.sleep(WAIT_S * 4)

    def _push(self, steps_done: int, force: bool = False) -> None:
        """Rank 0 puts the weights after ``steps_done`` optimizer steps as version ``steps_done + 1``, at most every
        PUSH_EVERY_S unless ``force``."""
        now = time.monotonic()
        if self.ctx.rank != 0 or (not force and now - self._pushed_at < PUSH_EVERY_S):
            return
        self._pushed_at = now
        self.progress.version = steps_done + 1
        self.replay.put_weights(steps_done + 1, {k: v.detach().clone() for k, v in self.online.state_dict().items()})

    def _stop_now(self, env_steps: int, mean_return: float | None) -> bool:
        """Whether to stop after this step, the same on every rank (one small all-reduce a step): rank 0's word that
        the job has trained enough, or any rank told to stop (preempted: the whole group leaves at this step, its
        snapshot taken, and forms again smaller)."""
        done = env_steps >= self.cfg.env_steps or (
            self.cfg.stop_return > 0 and mean_return is not None and mean_return >= self.cfg.stop_return)
        flags = torch.tensor([1.0 if done and self.ctx.rank == 0 else 0.0, 1.0 if self.preempted() else 0.0])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        self.left = bool(flags[1].item() > 0) and not flags[0].item() > 0
        return bool(flags.max().item() > 0)

    def run(self) -> int:
        """Train until rank 0 says enough (or this learner is preempted); returns the steps trained."""
        if self.start == 0:
            self._wait_for_data()
        self._push(self.start, force=True)
        step = self.start
        while True:
            try:
                finished = self._step(step)
            except (StaleIncarnation, RuntimeError):
                if not self._told():
                    raise
                self.left = True  # the group dissolved under a notice before its members could agree on a step
                return step
            step += 1
            if finished:
                return step

    def _told(self) -> bool:
        """Whether this process has been told to stop (waiting a little: the buffer's fence, or a member that left,
        can learn of the group's new round before the notice reaches this process)."""
        deadline = time.monotonic() + NOTICE_WAIT_S
        while not self.preempted():
            if time.monotonic() > deadline:
                return False
            time.sleep(WAIT_S)
        return True

    def _step(self, step: int) -> bool:
        """One step (numbered ``step``); whether the group stops after it."""
        reply = self.prefetch.next(self._updated)
        self._updated = None
        env_steps, mean_return = int(reply.meta["env_steps"]), reply.meta.get("mean_return")
        self.curve.add(env_steps, mean_return)
        tensors = reply.tensors
        batch = {name: tensors[name] for name in ("obs", "action", "reward", "next_obs", "discount")}
        weights = tensors["_weights"] if self.cfg.alpha > 0 else None
        loss, td = double_dqn_loss(self.model, self.target, batch, weights, picker=self.online)
        self.optimizer.zero_grad()
        loss.backward()
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.online.parameters(), self.cfg.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg.lr
        self.optimizer.step()
        if self.cfg.alpha > 0:  # sent with the next request for a sample
            self._updated = {"slots": tensors["_slots"], "written": tensors["_written"], "priorities": td}
        if (step + 1) % self.cfg.target_every == 0:
            self.target.load_state_dict(self.online.state_dict())
        self.progress.env_steps = env_steps
        self.ckpt.step(step)
        # reported as td_loss, not loss: a TD loss that rises as the returns grow is no divergence
        report(step, samples=len(batch["action"]), td_loss=loss.item())
        self._push(step + 1)
        if self._stop_now(env_steps, mean_return):
            if not self.left:
                self._push(step + 1, force=True)
            return True
        return False

    def close(self) -> None:
        self.prefetch.close()
        self.ckpt.close()
        dist.destroy_process_group()
