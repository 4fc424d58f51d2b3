"""The RL job's training config: one dataclass every role reads with ``convoy.train_config`` (values from the job
file's ``[train]`` table or ``--set key=value``); hot fields change in place while the job runs (``convoy config
set``), restart fields by a restart of the processes that read them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from convoy.errors import ConfigError
from convoy.worker.live_config import hot, restart

MODES = ("scale", "throttle", "none")
SLICINGS = ("seeds", "start-boxes")


@dataclass
class RLConfig:
    env: str = restart("CartPole-v1", doc="gymnasium environment id (vector observation, discrete actions)")
    seed: int = restart(0, min=0, doc="seed of the networks and of the actors' exploration")
    env_steps: int = hot(150_000, min=1, doc="environment steps the job trains for")
    step_cost: float = hot(0.0, min=0.0, max=10.0,
                                  doc="seconds each environment step takes (a simulator's cost)")
    seeds: int = restart(10_000, min=1, doc="reset seeds of the state space")
    slices: int = restart(16, min=1, doc="slices the state space is cut into, dealt to the actors")
    slicing: str = restart("seeds", choices=SLICINGS, doc="seeds: ranges of reset seeds; start-boxes: boxes of "
                                                          "initial states (environments that declare them)")
    n_step: int = restart(3, min=1, max=20, doc="steps of each transition's return")
    gamma: float = restart(0.99, min=0.0, max=1.0, doc="discount")
    target_ratio: float = hot(16.0, min=1e-6, doc="samples per insert the controller (or throttle) holds (> 0)")
    tolerance: float = hot(0.1, min=0.01, max=0.9, doc="how far samples per insert may stray before scaling")
    mode: str = restart("scale", choices=MODES, doc="scale: the controller scales; throttle: the faster side "
                                                           "waits (Reverb's rate limiter); none: neither")
    batch: int = restart(128, min=1, max=65536, doc="transitions per learner step (over all learners)")
    lr: float = hot(1e-3, min=0.0, max=1.0, doc="Adam's learning rate")
    grad_clip: float = hot(10.0, min=0.0, doc="the gradients' largest norm per learner step (0: not clipped)")
    hidden: int = restart(256, min=4, max=8192, doc="width of the Q-network's hidden layers")
    target_every: int = hot(20, min=1, doc="learner steps between target-network updates")
    capacity: int = restart(50_000, min=1, doc="replay capacity in transitions")
    capacity_bytes: int = restart(0, min=0, doc="replay capacity in bytes (0: no bound)")
    alpha: float = restart(0.6, min=0.0, max=1.0, doc="prioritized replay's exponent (0: uniform)")
    beta: float = restart(0.4, min=0.0, max=1.0, doc="importance-weight exponent")
    learning_starts: int = hot(1_000, min=1, doc="transitions in the buffer before learners sample")
    epsilon_start: float = hot(1.0, min=0.0, max=1.0, doc="exploration at the start")
    epsilon_end: float = hot(0.04, min=0.0, max=1.0, doc="exploration after the decay")
    epsilon_steps: int = hot(8_000, min=0, doc="environment steps the exploration decays over")
    insert_batch: int = hot(32, min=1, max=4096, doc="transitions an actor sends at once")
    weights_every_s: float = hot(0.5, min=0.0, doc="how often actors fetch newer weights")
    snapshot_every_s: float = hot(5.0, min=0.1, doc="seconds between the buffer's snapshots")
    throttle_error: float = hot(0.0, min=0.0, doc="throttle mode: slack in samples (0: one learner batch "
                                                         "plus one actor batch at the target ratio)")
    stop_return: float = hot(0.0, doc="end early once the mean return of the last 100 episodes reaches this "
                                             "(0: train for env_steps)")
    plot: str = hot("", doc="write the learning curve to this PNG (relative to the run dir)")

    def validate(self) -> None:
        if not (self.target_ratio > 0 and math.isfinite(self.target_ratio)):
            raise ConfigError(f"target_ratio must be > 0 (samples per insert), got {self.target_ratio}")
        if self.slicing not in SLICINGS:
            raise ConfigError(f"slicing must be one of {', '.join(SLICINGS)}, got {self.slicing!r}")
        if self.slicing == "seeds" and self.slices > self.seeds:
            raise ConfigError(f"slices {self.slices} > seeds {self.seeds}: each slice needs at least one seed")
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.epsilon_end > self.epsilon_start:
            raise ConfigError("epsilon_end must not exceed epsilon_start")

