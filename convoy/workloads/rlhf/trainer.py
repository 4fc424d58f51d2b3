"""A trainer process, one of a role group (``group = true``): the trainers form their own torch.distributed world,
each takes its share of a step's groups from the store (made by versions >= the step's own - k), and DDP averages
their GRPO gradients. Trainer 0 then writes the new weights to the host's weight board (the rollouts copy them from
there) and publishes the version, with its digest, to the store and as an event.

A snapshot after every step (``Checkpointer``): a trainer that fails re-forms the group with the others from it, no
finished step lost, while the rollouts go on generating with the last weights they hold. The restored weights are
published again as a new version (a version the failed group published and lost is never the rollouts' last).
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from convoy.errors import ConfigError
from convoy.parallel.transport import IncarnationFence
from convoy.runtime.checkpoint import Checkpointer
from convoy.runtime.init import init
from convoy.worker.events import emit
from convoy.worker.report import report
from convoy.worker.role_env import SERVICE_HOST_ENV, role
from convoy.workloads.lookahead.generator import LookaheadGenerator
from convoy.workloads.rlhf.buckets import Manifest
from convoy.workloads.rlhf.config import GRPOConfig
from convoy.workloads.rlhf.evaluate import held_out_reward
from convoy.workloads.rlhf.store_client import StoreClient
from convoy.workloads.rlhf.store_service import GROUP_TENSORS
from convoy.workloads.rlhf.task import Arithmetic, reward
from convoy.workloads.rlhf.train_step import StepSettings, grpo_step
from convoy.workloads.rlhf.weight_board import WeightBoard
from convoy.workloads.rlhf.weight_service import WeightService

TAKE_WAIT_S = 0.05
SAY_WAITING_S = 30.0
"""A trainer waiting this long for its groups says so (with the store's counts), and again as long as it waits."""


@dataclass
class Progress:
    """What a snapshot keeps beside the model and optimizer: the newest version, the samples trained on and the
    held-out curve."""

    version: int = 0
    samples: int = 0
    seconds: float = 0.0
    """Time trained (``minutes`` bounds it), across restarts."""
    curve: list[tuple[int, float]] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version, "samples": self.samples, "seconds": self.seconds,
                "curve": [list(p) for p in self.curve]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.version, self.samples, self.seconds = int(state["version"]), int(state["samples"]), float(state["seconds"])
        self.curve = [(int(s), float(r)) for s, r in state["curve"]]


class Trainer:
    def __init__(self, cfg: GRPOConfig, store: StoreClient, board_path: Path, models: tuple[Any, Any],
                 say: Callable[[str], None] = print) -> None:
        """``models``: (policy, tokenizer); the reference is a frozen copy of the policy as loaded."""
        self.cfg, self.store, self.say = cfg, store, say
        self.ctx = init()
        world = self.ctx.world_size
        if cfg.groups_per_step % world:
            raise ConfigError(f"groups_per_step {cfg.groups_per_step} does not split among {world} trainers: make it "
                              "a multiple of the trainer count")
        self.share = cfg.groups_per_step // world
        self.policy, self.tokenizer = models
        self.reference = copy.deepcopy(self.policy).eval().requires_grad_(False)
        self.policy.train()
        self.model = DistributedDataParallel(self.policy)
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=cfg.lr, weight_decay=0.0)
        self.progress = Progress()
        self.ckpt = Checkpointer(self.model, self.optimizer, state={"progress": self.progress})
        self.start = self.ckpt.restore()
        self.task = Arithmetic(cfg.seed, cfg.low, cfg.high, cfg.ops)
        self.score = cfg.scorer() or reward
        self.held_out = self.task.held_out(cfg.eval_prompts)
        self.board = self._board(board_path) if self.ctx.rank == 0 else None
        self.weights = WeightService(self.board, os.environ.get(SERVICE_HOST_ENV, "127.0.0.1"),
                                     admit=IncarnationFence(role()).check) if self.board is not None else None
        """Trainer 0's board on the transport, for rollouts that cannot map it (another host)."""
        self.decoder = LookaheadGenerator(self.policy, self.tokenizer, pack_weights=False) \
            if self.ctx.rank == 0 else None
        """Trainer 0's evaluations' decoder (over the policy itself, weights unpacked: they change every step); its
        memory of earlier answers drafts the next evaluation's."""
        self.waited_s = 0.0
        """Time spent waiting for groups (the trainers idle)."""
        self.longest_wait_s = 0.0
        """The longest one step waited for its groups."""

    def _board(self, path: Path) -> WeightBoard:
        named = dict(self.policy.named_parameters())
        if path.exists():  # a trainer group that came back: the rollouts hold the board it wrote before
            board = WeightBoard.open(path)
            board.manifest.check(named)
            return board
        return WeightBoard.create(path, Manifest.of(named))

    def _publish(self) -> None:
        """Trainer 0: the weights as a new version on the board, then to the store with its digest."""
        if self.board is not None:
            version = max(self.progress.version, self.board.current()[0] + 1)
            hashed = self.board.publish(version, dict(self.policy.named_parameters()))
            assert self.weights is not None
            self.store.call("publish", {"version": version, "digest": hashed, "board": str(self.board.path),
                                        "board_id": self.board.board_id, "weights_at": self.weights.address})
            emit("weights_published", f"trainer 0 published version {version}: digest {hashed}")
        else:
            version = self.progress.version
        agreed = torch.tensor([version])
        dist.broadcast(agreed, 0)  # every trainer takes groups for the version trainer 0 published
        self.progress.version = int(agreed.item())

    def _take(self) -> dict[str, torch.Tensor]:
        """This trainer's share of groups for the current version (waiting while the rollouts make them)."""
        parts: list[dict[str, torch.Tensor]] = []
        have, began, said = 0, time.monotonic(), time.monotonic()
        while have < self.share:
            reply = self.store.call("take", {"count": self.share - have, "current": self.progress.version})
            if reply.op == "taken":
                parts.append(reply.tensors)
                have += int(reply.meta["groups"])
                continue
            if time.monotonic() - said > SAY_WAITING_S:
                said = time.monotonic()
                stats = self.store.call("stats").meta
                self.say(f"trainer {self.ctx.rank}: waited {said - began:.0f} s for groups of version >= "
                         f"{self.progress.version - self.cfg.max_lag} (store: {stats['held']} held, "
                         f"{stats['prompts_leased']} prompts leased, {stats['prompts_waiting']} waiting)")
            time.sleep(TAKE_WAIT_S)
        self.waited_s += time.monotonic() - began
        self.longest_wait_s = max(self.longest_wait_s, time.monotonic() - began)
        length = max(int(part["tokens"].shape[1]) for part in parts)
        batch = {name: torch.cat([torch.nn.functional.pad(part[name], (0, length - int(part[name].shape[1])))
                                  for part in parts]) for name in GROUP_TENSORS[:3]}
        batch["rewards"] = torch.cat([part["rewards"] for part in parts])
        batch["versions"] = torch.cat([part["versions"] for part in parts])
        return batch

    def settings(self) -> StepSettings:
        return StepSettings(self.cfg.group_size, self.cfg.temperature, self.cfg.clip, self.cfg.beta,
                            self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else float("inf"))

    def _spent(self) -> bool:
        return self.cfg.minutes > 0 and self.progress.seconds >= 60 * self.cfg.minutes

    def _out_of_time(self) -> bool:
        """Whether ``minutes`` have been trained (trainer 0's clock, the same answer on every trainer)."""
        flag = torch.tensor([1 if self._spent() and self.ctx.rank == 0 else 0])
        dist.broadcast(flag, 0)
        return bool(flag.item())

    def run(self) -> int:
        """Steps until ``cfg.steps`` (or ``cfg.minutes``); returns the steps done."""
        self._publish()
        if self.start == 0 and self.ctx.rank == 0:
            self._evaluate()
        step = self.start
        while step < self.cfg.steps and not self._out_of_time():
            began = time.monotonic()
            batch = self._take()
            lag = self.progress.version - int(batch["versions"].min())
            if lag > self.cfg.max_lag:  # the store's rule: never trained on
                raise ConfigError(f"the store handed out a group {lag} versions old (k = {self.cfg.max_lag})")
            for group in self.optimizer.param_groups:
                group["lr"] = self.cfg.lr
            measured = grpo_step(self.model, self.reference, self.optimizer, batch, self.settings())
            samples = torch.tensor([int(batch["rewards"].numel())])
            dist.all_reduce(samples)
            self.progress.samples += int(samples.item())
            self.progress.version += 1
            self.progress.seconds += time.monotonic() - began
            if self.ctx.rank == 0 and ((step + 1) % self.cfg.eval_every == 0 or step + 1 == self.cfg.steps
                                       or self._spent()):
                self._evaluate()
            self.ckpt.step(step)
            self._publish()
            report(step, measured["loss"], samples=int(batch["rewards"].numel()), grad_norm=measured["grad_norm"],
                   reward=measured["reward"], kl=measured["kl"], lag=lag, version=self.progress.version)
            step += 1
        return step

    def _evaluate(self) -> None:
        began = time.monotonic()
        value, failed = held_out_reward(self.policy, self.tokenizer, self.held_out, self.cfg.max_new_tokens,
                                        self.score, self.decoder if self.cfg.lookahead else None)
        self.progress.curve.append((self.progress.samples, value))
        raised = f", the reward function raised on {failed} (scored 0)" if failed else ""
        self.say(f"trainer: held-out reward {100 * value:.1f}% after {self.progress.samples} samples (version "
                 f"{self.progress.version}; {len(self.held_out)} prompts{raised}, {time.monotonic() - began:.1f} s)")

    def close(self) -> None:
        if self.weights is not None:
            self.weights.close()
        if self.board is not None:
            self.board.close()
        self.ckpt.close()
        self.store.close()
        dist.destroy_process_group()
