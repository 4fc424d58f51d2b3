"""Page-Hinkley test on the streaming loss: says when the loss has risen for good, not just by noise.

Each observation is one mini-batch's mean loss divided by a reference loss (the loss on the
training data), so the thresholds do not depend on the target's scale. The test sums
``x_t - mean(x_1..x_t) - delta`` and signals when that sum has climbed more than ``threshold``
above its lowest point. At the start the running mean holds a prior of ``baseline_weight``
observations at 1.0 (the reference level), so a stream that is drifted from its first batch is
caught too; after a detection the test restarts without a prior and follows the new level.
"""

from __future__ import annotations

from dataclasses import dataclass

from convoy.workloads.gbdt.errors import GBDTError


@dataclass
class PageHinkley:
    """Detector state; ``update`` returns True on the observation that signals a drift (then it starts over)."""

    delta: float = 0.1
    """Rise of the relative loss that is tolerated as noise, per observation."""
    threshold: float = 0.5
    """How far the cumulative excess must climb above its minimum to signal a drift."""
    min_observations: int = 2
    """Observations needed after a (re)start before a drift may be signalled."""
    baseline_weight: float = 5.0
    """How many observations' worth of prior the reference level 1.0 has in the running mean at the start."""
    count: int = 0
    weight: float = -1.0
    mean: float = 1.0
    cumulative: float = 0.0
    minimum: float = 0.0

    def __post_init__(self) -> None:
        if self.delta < 0 or self.threshold <= 0 or self.min_observations < 1 or self.baseline_weight < 0:
            raise GBDTError(f"Page-Hinkley needs delta >= 0, threshold > 0, min_observations >= 1 and "
                            f"baseline_weight >= 0 (got {self.delta}, {self.threshold}, {self.min_observations}, "
                            f"{self.baseline_weight})")
        if self.weight < 0:
            self.weight = self.baseline_weight

    def update(self, value: float) -> bool:
        """Add one observation (relative mini-batch loss); True when a drift is detected."""
        self.count += 1
        self.weight += 1
        self.mean += (value - self.mean) / self.weight
        self.cumulative += value - self.mean - self.delta
        self.minimum = min(self.minimum, self.cumulative)
        if self.count >= self.min_observations and self.cumulative - self.minimum > self.threshold:
            self.reset()
            return True
        return False

    def reset(self) -> None:
        """Forget the stream so far (after a drift was handled)."""
        self.count, self.weight, self.mean, self.cumulative, self.minimum = 0, 0.0, 0.0, 0.0, 0.0

    def state(self) -> dict[str, float]:
        """Everything needed to resume the test (saved with the model; ``PageHinkley(**state)`` restores it)."""
        return {name: getattr(self, name) for name in (
            "delta", "threshold", "min_observations", "baseline_weight", "count", "weight", "mean", "cumulative",
            "minimum")}
