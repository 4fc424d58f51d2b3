"""A worker's memory predicted from ONE measured iteration of the chief, with a margin learnt from the errors.

The model: a worker's peak is its process baseline (interpreter, imports, data pipeline: the chief's tree
sampled before the model was built) + the model state it holds (parameters, gradients, optimizer state) + a
runtime overhead that does not depend on the batch (kernels' code pages, allocator arenas, lazy buffers) + the
activations and temporaries of an iteration, which grow with the batch's bytes (batch size x bytes per
sample). The chief's iteration gives ``rest = peak - baseline - chief state``. Where the runtime also measured
the batch-dependent bytes of that iteration (``activation_bytes``), the rest splits into overhead and
activations and only the activations scale to the worker's batch; where it did not, one iteration cannot
split them, so the rest scales up for a larger batch and is kept whole for a smaller one (the safe side of
each). A worker with the chief's batch is predicted at the chief's peak either way. The limit adds a margin
learnt from how far measured peaks (the chief's own later iterations included) missed their predictions
(``MarginModel``), not a fixed percentage. Pure: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from convoy.errors import ConfigError

PAGE_BYTES = 4096
MIB = 1024 * 1024
PRIOR_SPREAD = 0.03
"""The spread of relative errors assumed before any worker has reported (a small prior)."""
PRIOR_WEIGHT = 2.0
"""How many observed errors the prior counts as."""
SPREAD_FACTOR = 2.0
"""The margin covers the mean error plus this many spreads."""
MIN_MARGIN = 0.01
DLROVER_MARGIN, DLROVER_SAMPLES, DLROVER_OOM_FACTOR = 0.5, 5, 2


@dataclass(frozen=True)
class IterationShape:
    """What one iteration of a process is made of."""

    state_bytes: int
    """Model state the process holds: parameters + gradients + optimizer state (dense parts, for a PS worker)."""
    batch_size: int
    sample_bytes: int
    """Bytes of one input sample as the iteration loads it."""

    @property
    def batch_bytes(self) -> int:
        return self.batch_size * self.sample_bytes

    def validate(self, what: str) -> None:
        if self.batch_size <= 0:
            raise ConfigError(f"{what}: batch_size is {self.batch_size}; it must be at least 1")
        if self.sample_bytes <= 0:
            raise ConfigError(f"{what}: sample_bytes is {self.sample_bytes}; a sample has at least 1 byte")
        if self.state_bytes < 0:
            raise ConfigError(f"{what}: state_bytes is {self.state_bytes}; it cannot be negative")


@dataclass(frozen=True)
class MeasuredIteration:
    """The chief's measuring iteration: its shape and what its process tree used (peaks sampled by the agent
    during the iteration; the baseline sampled before the model was built)."""

    shape: IterationShape
    peak_rss_bytes: int
    peak_uss_bytes: int
    baseline_rss_bytes: int
    baseline_uss_bytes: int
    activation_bytes: int | None = None
    """The iteration's bytes that grow with the batch, where the runtime measured them; None: unknown."""

    def validate(self) -> None:
        self.shape.validate("the measured iteration")
        if self.activation_bytes is not None and self.activation_bytes < 0:
            raise ConfigError(f"the measured iteration: activation_bytes is {self.activation_bytes}; it cannot be "
                              "negative")
        for name in ("peak_rss_bytes", "peak_uss_bytes", "baseline_rss_bytes", "baseline_uss_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"the measured iteration: {name} is {getattr(self, name)}; it cannot be negative")
        if self.peak_rss_bytes == 0:
            raise ConfigError("the measured iteration has no memory sample (peak RSS 0): the sampler saw no "
                              "process; measure the iteration again")
        if self.peak_uss_bytes > self.peak_rss_bytes:
            raise ConfigError(f"the measured iteration's peak USS {_mib(self.peak_uss_bytes)} exceeds its peak RSS "
                              f"{_mib(self.peak_rss_bytes)}; the samples are inconsistent")


@dataclass(frozen=True)
class MemoryPrediction:
    """A worker's predicted peak (the need) and the limit it is started with (the need plus the margin)."""

    rss_bytes: int
    uss_bytes: int
    margin: float
    limit_bytes: int
    measured_peak_rss_bytes: int
    """The chief's measured peak this prediction scales (quoted when a limit is refused)."""
    baseline_rss_bytes: int
    state_bytes: int
    overhead_rss_bytes: int
    activation_rss_bytes: int


def predict(measured: MeasuredIteration, worker: IterationShape, margin: float) -> MemoryPrediction:
    """A worker's peak memory from the chief's one measured iteration (the model in the module docstring)."""
    measured.validate()
    worker.validate("the worker")
    if margin < 0:
        raise ConfigError(f"margin is {margin}; it cannot be negative")
    scale = worker.batch_bytes / measured.shape.batch_bytes
    overhead_rss, activation_rss = _split(measured, measured.peak_rss_bytes - measured.baseline_rss_bytes)
    overhead_uss, activation_uss = _split(measured, measured.peak_uss_bytes - measured.baseline_uss_bytes)
    if measured.activation_bytes is None:
        scale = max(1.0, scale)
    worker_activation_rss = math.ceil(activation_rss * scale)
    rss = measured.baseline_rss_bytes + worker.state_bytes + overhead_rss + worker_activation_rss
    uss = measured.baseline_uss_bytes + worker.state_bytes + overhead_uss + math.ceil(activation_uss * scale)
    return MemoryPrediction(rss, uss, margin, _pages(rss * (1 + margin)), measured.peak_rss_bytes,
                            measured.baseline_rss_bytes, worker.state_bytes, overhead_rss, worker_activation_rss)


def _split(measured: MeasuredIteration, above_baseline: int) -> tuple[int, int]:
    """The chief's memory above its baseline and state, as (overhead, activations); all activations where the
    runtime did not measure them."""
    rest = max(0, above_baseline - measured.shape.state_bytes)
    if measured.activation_bytes is None:
        return 0, rest
    activations = min(measured.activation_bytes, rest)
    return rest - activations, activations


@dataclass
class MarginModel:
    """The margin learnt from relative prediction errors ``measured / predicted - 1`` as workers report their
    real peaks: the mean error plus ``SPREAD_FACTOR`` spreads, where a small prior (mean 0, spread
    ``PRIOR_SPREAD``, weight ``PRIOR_WEIGHT``) stands in for the errors not seen yet; never below the worst
    underestimate seen, nor below ``MIN_MARGIN``."""

    prior_spread: float = PRIOR_SPREAD
    prior_weight: float = PRIOR_WEIGHT
    errors: list[float] = field(default_factory=list)

    def margin(self) -> float:
        count, weight = len(self.errors), self.prior_weight
        mean = sum(self.errors) / (count + weight)
        spread_sq = (weight * self.prior_spread ** 2 + sum((e - mean) ** 2 for e in self.errors)) / (count + weight)
        worst = max(self.errors, default=0.0)
        return max(MIN_MARGIN, mean + SPREAD_FACTOR * math.sqrt(spread_sq), worst)

    def record(self, predicted_bytes: int, measured_bytes: int) -> float:
        """A worker's measured peak against its prediction (the need, not the limit); returns the error."""
        if predicted_bytes <= 0 or measured_bytes <= 0:
            raise ConfigError(f"a prediction error needs positive figures, got predicted {predicted_bytes} and "
                              f"measured {measured_bytes} bytes")
        error = measured_bytes / predicted_bytes - 1
        self.errors.append(error)
        return error

    def record_oom(self, predicted_bytes: int, limit_bytes: int, overshoot_bytes: int) -> float:
        """A worker killed at its limit needed at least the limit plus what it overshot: that lower bound is
        recorded as its error."""
        return self.record(predicted_bytes, limit_bytes + max(0, overshoot_bytes))

    def state(self) -> dict[str, Any]:
        return {"prior_spread": self.prior_spread, "prior_weight": self.prior_weight, "errors": list(self.errors)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> MarginModel:
        try:
            return cls(float(state["prior_spread"]), float(state["prior_weight"]),
                       [float(e) for e in state["errors"]])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"margin state is malformed ({exc!r}); start from the prior") from exc


def check_limit(requested_bytes: int, prediction: MemoryPrediction, role: str = "worker") -> None:
    """A limit the user set below the measured need is refused, quoting the measurement."""
    if requested_bytes < prediction.rss_bytes:
        raise ConfigError(
            f"memory limit {_mib(requested_bytes)} for role {role} is below its measured need "
            f"{_mib(prediction.rss_bytes)} (the chief's measuring iteration peaked at "
            f"{_mib(prediction.measured_peak_rss_bytes)} RSS, scaled to this role's batch); raise the limit to at "
            f"least {_mib(prediction.limit_bytes)} or set memory = \"auto\"")


def place_workers(free_by_node: dict[str, int], limit_bytes: int, requested: int | None = None,
                  reserve_bytes: int = 0) -> dict[str, int]:
    """How many workers of ``limit_bytes`` each node takes: as many as fit (``requested`` None), or
    ``requested`` spread over the nodes with the most free memory left; refused if they do not fit."""
    if limit_bytes <= 0:
        raise ConfigError(f"a worker's memory limit is {limit_bytes} bytes; it must be positive")
    if requested is not None and requested < 0:
        raise ConfigError(f"the requested worker count is {requested}; it cannot be negative")
    room = {node: max(0, (free - reserve_bytes) // limit_bytes) for node, free in free_by_node.items()}
    fits = sum(room.values())
    if requested is None:
        return room
    if requested > fits:
        free = ", ".join(f"{node} {_mib(bytes_)}" for node, bytes_ in sorted(free_by_node.items()))
        raise ConfigError(f"{requested} workers of {_mib(limit_bytes)} each do not fit: the nodes' free memory "
                          f"({free or 'no nodes'}) holds {fits}; ask for at most {fits} workers or add nodes")
    placed = {node: 0 for node in free_by_node}
    for _ in range(requested):
        node = max((n for n in placed if placed[n] < room[n]),
                   key=lambda n: (free_by_node[n] - placed[n] * limit_bytes, n))
        placed[node] += 1
    return placed


def relaunch_limit(limit_bytes: int, overshoot_bytes: int, margin: float) -> int:
    """The limit for a worker relaunched after an OOM kill: raised by the measured overshoot, and at least by
    the margin (a cgroup stops a tree at its limit, so the overshoot it reports can be 0)."""
    return _pages(limit_bytes + max(max(0, overshoot_bytes), margin * limit_bytes))


def dlrover_allocation(container_used_samples: list[int]) -> int:
    """What DLRover's rule allocates a worker: the largest of the latest ``DLROVER_SAMPLES`` samples of the
    container's used memory (``psutil.virtual_memory().used``), plus 50%; for the benchmark's comparison."""
    if not container_used_samples:
        raise ConfigError("DLRover's rule needs at least one memory sample")
    return int((1 + DLROVER_MARGIN) * max(container_used_samples[-DLROVER_SAMPLES:]))


def dlrover_after_oom(allocated_bytes: int) -> int:
    """DLRover's rule after an OOM kill: double the memory."""
    return DLROVER_OOM_FACTOR * allocated_bytes


def _pages(value: float) -> int:
    return math.ceil(value / PAGE_BYTES) * PAGE_BYTES


def _mib(value: int) -> str:
    return f"{value / MIB:.1f} MiB"
