"""Which ranks share fast links, who sends what to whom in each allreduce, and what it costs.

Pure (no torch): ``allreduce/collectives.py`` does the communication. Every algorithm is modelled as
the rings gloo runs (a ring allreduce of ``k`` ranks takes ``2 (k - 1)`` steps of ``S / k``
bytes each), on two kinds of link: inside a group (``intra``) and across groups (``inter``,
where all the streams leaving one group share its uplink).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from convoy.errors import ConfigError

CHOICE_MARGIN = 0.05
"""A more elaborate algorithm must beat a simpler one by this much (in prediction or in a trial)."""
TRIAL_WITHIN = 0.25
"""``auto`` tries, at the real size, every algorithm predicted within this much of the fastest."""
PLAIN = ("flat", "leader", "reduce_scatter")
"""``flat``: one ring over all ranks. ``leader``: reduce to each group's first rank, allreduce
among those, broadcast back. ``reduce_scatter``: reduce-scatter inside each group, allreduce
shard i among the ranks at local index i of every group, all-gather inside each group."""
CODED = ("leader_coded", "reduce_scatter_coded")
"""The two hierarchical algorithms with what crosses between two groups losslessly coded
(``allreduce/float_codec.py``): fewer bytes on the slow link for some CPU time per byte. Only
measured lines price them (the model has no term for the coding's CPU time)."""
ALGORITHMS = (*PLAIN, *CODED)
"""Simplest first: where two are close, ``auto`` keeps the earlier one."""


def uncoded(algorithm: str) -> str:
    """The algorithm whose phases ``algorithm`` runs (``leader_coded`` -> ``leader``)."""
    return algorithm.removesuffix("_coded")


def check_algorithm(algorithm: str, auto: bool = True) -> None:
    """Raise ``ConfigError`` unless ``algorithm`` names one (or, with ``auto``, is ``"auto"``)."""
    if algorithm not in ALGORITHMS and not (auto and algorithm == "auto"):
        raise ConfigError(f"unknown allreduce algorithm {algorithm!r}; choose from {', '.join(ALGORITHMS)}"
                          + (" or 'auto'" if auto else ""))


def simplest_within(times: Mapping[str, float], margin: float = CHOICE_MARGIN) -> str:
    """The first algorithm of ``times`` (listed simplest first) within ``margin`` of the fastest."""
    fastest = min(times.values())
    return next(algorithm for algorithm, took in times.items() if (1 - margin) * took <= fastest)


def size_class(nbytes: int) -> int:
    """Messages from 2^(c-1) to 2^c - 1 bytes share class ``c``: ``auto`` decides once per class."""
    return max(int(nbytes), 1).bit_length()


@dataclass(frozen=True)
class Topology:
    """Groups of ranks joined by fast links (a node, a rack, or any grouping the user gives).

    Every rank of the world appears in exactly one group; a group's first rank is its leader."""

    groups: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not self.groups:
            raise ConfigError("topology has no groups; give at least one group of ranks")
        seen: dict[int, int] = {}
        for index, group in enumerate(self.groups):
            if not group:
                raise ConfigError(f"topology group {index} has no ranks; every group needs at least one")
            for rank in group:
                if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
                    raise ConfigError(f"topology group {index} holds {rank!r}; ranks are whole numbers >= 0")
                if rank in seen:
                    raise ConfigError(f"rank {rank} is in topology groups {seen[rank]} and {index}; "
                                      "each rank must be in exactly one group")
                seen[rank] = index
        missing = sorted(set(range(len(seen))) - set(seen))
        if missing:
            raise ConfigError(f"topology covers ranks up to {max(seen)} but not {missing[:8]}; "
                              "every rank 0..world_size-1 must be in one group")

    @classmethod
    def from_groups(cls, groups: Sequence[Sequence[int]]) -> Topology:
        return cls(tuple(tuple(group) for group in groups))

    @classmethod
    def uniform(cls, world_size: int, group_size: int) -> Topology:
        """Consecutive ranks in groups of ``group_size`` (as agents number a node's workers)."""
        if world_size < 1 or group_size < 1 or world_size % group_size:
            raise ConfigError(f"cannot split {world_size} ranks into groups of {group_size}; "
                              "world size must be a positive multiple of the group size")
        return cls.from_groups([range(start, start + group_size) for start in range(0, world_size, group_size)])

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Topology:
        """One group per node: from ``CONVOY_TOPOLOGY`` (set by convoy agents), else torchrun's
        ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` (nodes of equal size)."""
        env = os.environ if env is None else env
        if "CONVOY_TOPOLOGY" in env:
            try:
                listed = json.loads(env["CONVOY_TOPOLOGY"])
                nodes = sorted((int(node_rank), int(nproc)) for node_rank, _, nproc in listed)
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"CONVOY_TOPOLOGY={env['CONVOY_TOPOLOGY']!r} is not [[node_rank, host, nproc], ...]"
                                  ) from exc
            groups, start = [], 0
            for _, nproc in nodes:
                groups.append(range(start, start + nproc))
                start += nproc
            return cls.from_groups(groups)
        try:
            return cls.uniform(int(env["WORLD_SIZE"]), int(env["LOCAL_WORLD_SIZE"]))
        except (KeyError, ValueError) as exc:
            raise ConfigError("no topology in the environment: run under convoy or torchrun (CONVOY_TOPOLOGY, or "
                              "WORLD_SIZE and LOCAL_WORLD_SIZE), or give the groups with Topology.from_groups"
                              ) from exc

    @property
    def world_size(self) -> int:
        return sum(len(group) for group in self.groups)

    @property
    def leaders(self) -> tuple[int, ...]:
        return tuple(group[0] for group in self.groups)

    @property
    def is_uniform(self) -> bool:
        return len({len(group) for group in self.groups}) == 1

    def group_of(self, rank: int) -> int:
        return next(index for index, group in enumerate(self.groups) if rank in group)

    def local_index(self, rank: int) -> int:
        return self.groups[self.group_of(rank)].index(rank)

    def shard_groups(self) -> tuple[tuple[int, ...], ...]:
        """For ``reduce_scatter``: the ranks at local index i of every group, for each i."""
        if not self.is_uniform:
            raise ConfigError(f"the reduce_scatter allreduce needs groups of equal size (got sizes "
                              f"{[len(g) for g in self.groups]}); use algorithm 'leader' or 'auto'")
        return tuple(tuple(group[i] for group in self.groups) for i in range(len(self.groups[0])))

    def partner(self, rank: int, crossing: str) -> int:
        """With two groups, the rank across that ``rank`` sums its chunks with: the other leader
        (``crossing="leader"``), or the rank at the same local index in the other group."""
        if len(self.groups) != 2:
            raise ConfigError(f"a rank has one partner across only with two groups (this topology has "
                              f"{len(self.groups)})")
        if crossing == "leader":
            if rank not in self.leaders:
                raise ValueError(f"rank {rank} does not cross in the leader algorithm (the leaders are {self.leaders})")
            return sum(self.leaders) - rank
        return sum(self.shard_groups()[self.local_index(rank)]) - rank

    def key(self) -> str:
        """A short name for this grouping (for caching measurements per topology)."""
        return "-".join(".".join(map(str, group)) for group in self.groups)[:200]


def ring_cross_bytes(topology: Topology, ring: Sequence[int], nbytes: float) -> float:
    """Bytes a ring allreduce of ``nbytes`` over ``ring`` sends between groups, in all."""
    k = len(ring)
    if k < 2:
        return 0.0
    pairs = zip(ring, [*ring[1:], ring[0]], strict=True)
    crossing = sum(topology.group_of(a) != topology.group_of(b) for a, b in pairs)
    return crossing * 2 * (k - 1) / k * nbytes


def cross_bytes(topology: Topology, algorithm: str, nbytes: float) -> float:
    """Bytes an allreduce of ``nbytes`` per rank sends across group boundaries, summed over links."""
    check_algorithm(algorithm, auto=False)
    if algorithm == "flat":
        return ring_cross_bytes(topology, range(topology.world_size), nbytes)
    if algorithm == "leader":
        return ring_cross_bytes(topology, topology.leaders, nbytes)
    shards = topology.shard_groups()
    return sum(ring_cross_bytes(topology, ring, nbytes / len(shards)) for ring in shards)


def min_cross_bytes(topology: Topology, nbytes: float) -> float:
    """The least any allreduce must send between groups: each of G groups sends 2 (G - 1) / G of
    the data out (the bandwidth lower bound of allreduce, with a group as one party)."""
    num_groups = len(topology.groups)
    return 2 * (num_groups - 1) * nbytes


@dataclass(frozen=True)
class Link:
    """The alpha-beta cost of one message on a link: ``latency_s + nbytes * s_per_byte``."""

    latency_s: float
    s_per_byte: float

    def cost(self, steps: float, nbytes: float) -> float:
        return steps * self.latency_s + nbytes * self.s_per_byte

    @classmethod
    def fit_ring(cls, ranks: int, small: tuple[float, float], large: tuple[float, float]) -> Link:
        """From the times of a ring allreduce of ``ranks`` at two sizes, ``(nbytes, seconds)`` each."""
        steps = 2 * (ranks - 1)
        per_step_bytes = [size / ranks for size, _ in (small, large)]
        slope = (large[1] - small[1]) / max(steps * (per_step_bytes[1] - per_step_bytes[0]), 1e-30)
        s_per_byte = max(slope, 1e-13)
        latency = max((small[1] - steps * per_step_bytes[0] * s_per_byte) / steps, 0.0)
        return cls(latency, s_per_byte)

    @classmethod
    def fit_line(cls, small: tuple[float, float], large: tuple[float, float]) -> Link:
        """A straight line through two ``(nbytes, seconds)`` points: a fixed cost plus a cost per byte."""
        s_per_byte = max((large[1] - small[1]) / max(large[0] - small[0], 1e-30), 1e-13)
        return cls(max(small[1] - small[0] * s_per_byte, 0.0), s_per_byte)


@dataclass(frozen=True)
class CostModel:
    """Predicted time of each algorithm on a topology.

    From the two links' alpha-beta costs, with each algorithm modelled as the rings gloo runs;
    or, where the job measured an algorithm end to end at two sizes (``measured``: algorithm ->
    fixed cost + cost per byte), from that line, which also holds what the model leaves out
    (in-group phases under CPU contention, per-operation overheads)."""

    intra: Link
    inter: Link
    measured: tuple[tuple[str, Link], ...] = ()

    def _ring(self, topology: Topology, ring: Sequence[int], nbytes: float, streams: int = 1) -> float:
        """A ring allreduce; ``streams`` such rings run at once and share each group's uplink."""
        k = len(ring)
        if k < 2:
            return 0.0
        uplink: dict[int, int] = {}
        for a, b in zip(ring, [*ring[1:], ring[0]], strict=True):
            if topology.group_of(a) != topology.group_of(b):
                uplink[topology.group_of(a)] = uplink.get(topology.group_of(a), 0) + 1
        step_bytes = nbytes / k
        crossing = sum(uplink.values())
        per_step = 0.0  # every edge sends at once: a step lasts as long as its slowest edge
        if uplink:
            per_step = self.inter.cost(1, max(uplink.values()) * streams * step_bytes)
        if crossing < k:
            per_step = max(per_step, self.intra.cost(1, step_bytes))
        return 2 * (k - 1) * per_step

    def plain_only(self) -> CostModel:
        """This model without the coded algorithms' lines (what ``auto`` weighs where it does not code)."""
        return CostModel(self.intra, self.inter, tuple(line for line in self.measured if line[0] in PLAIN))

    def predict(self, topology: Topology, algorithm: str, nbytes: float) -> float:
        """Seconds for ``algorithm`` at ``nbytes``: its measured line, else the rings' model (a coded variant
        unmeasured: its plain algorithm's, the coding's CPU time left out)."""
        check_algorithm(algorithm, auto=False)
        lines = dict(self.measured)
        if algorithm in lines:
            return lines[algorithm].cost(1, nbytes)
        if algorithm in CODED:
            return self.predict(topology, uncoded(algorithm), nbytes)
        biggest = max(len(group) for group in topology.groups)
        if algorithm == "flat":
            return self._ring(topology, range(topology.world_size), nbytes)
        if algorithm == "leader":
            tree = math.ceil(math.log2(biggest)) if biggest > 1 else 0
            local = 2 * self.intra.cost(tree, tree * nbytes)  # reduce to the leader, then broadcast
            return local + self._ring(topology, topology.leaders, nbytes)
        shards = topology.shard_groups()
        local = 2 * self.intra.cost(biggest - 1, (biggest - 1) / biggest * nbytes)  # scatter, then gather
        return local + self._ring(topology, shards[0], nbytes / biggest, streams=len(shards))

    def _predicted(self, topology: Topology, nbytes: float) -> dict[str, float]:
        measured = dict(self.measured)
        usable = [a for a in ALGORITHMS if (uncoded(a) != "reduce_scatter" or topology.is_uniform)
                  and (a in PLAIN or (a in measured and len(topology.groups) == 2))]  # coded: where measured
        return {algorithm: self.predict(topology, algorithm, nbytes) for algorithm in usable}

    def choose(self, topology: Topology, nbytes: float, margin: float = CHOICE_MARGIN) -> str:
        """The simplest algorithm (flat, leader, reduce_scatter, then the coded ones) predicted within ``margin``
        of the fastest: a more elaborate one must win by more than that, as measured lines are noisy
        and the flat ring is the safe default."""
        if len(topology.groups) in (1, topology.world_size):
            return "flat"  # one group, or groups of one: every algorithm is the flat ring or worse
        return simplest_within(self._predicted(topology, nbytes), margin)

    def candidates(self, topology: Topology, nbytes: float, within: float = TRIAL_WITHIN) -> list[str]:
        """The algorithms worth a trial at ``nbytes``: predicted within ``within`` of the fastest
        (simplest first). One candidate means the prediction is clear enough to go by."""
        if len(topology.groups) in (1, topology.world_size):
            return ["flat"]
        predicted = self._predicted(topology, nbytes)
        fastest = min(predicted.values())
        return [algorithm for algorithm, took in predicted.items() if took <= (1 + within) * fastest]
