"""What ``auto`` measures, for ``HierarchicalAllreduce`` (``collectives.py``): the links' costs, each
algorithm's line at two probe sizes, the trials at real message sizes, and the job's cache of all three.

Every function here that moves data is collective over the default group (or the group it is given):
call it on every rank in the same order, as the allreduce itself is called. Buffers go on ``device``:
the CPU where gloo reduces CPU tensors, else the GPU (``measure``'s caller picks).
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from convoy.parallel.topology import CostModel, Link, Topology, simplest_within

PROBE_BYTES = (1 << 20, 32 << 20)
PROBE_REPS = 7
SMALL_PROBE_REPS = 21
"""The small probe's reps: it is cheap, and a rep's spread is large next to its time."""
TRIAL_ROUNDS, TRIAL_MAX_ROUNDS, TRIAL_BUDGET_S = 9, 45, 2.0
"""Calls each candidate gets in an ``auto`` trial (``HierarchicalAllreduce.choose``): at least
``TRIAL_ROUNDS``, more where the candidates are predicted to take less than ``TRIAL_BUDGET_S`` in all
(``trial_rounds``)."""


def trial_rounds(round_s: float) -> int:
    """Rounds of a trial whose round (every candidate once) is predicted to take ``round_s``. A small
    message's time spreads more next to its size (one preemption of a rank on a busy machine is
    several milliseconds), and its rounds are cheap."""
    if round_s <= 0:
        return TRIAL_MAX_ROUNDS
    return max(TRIAL_ROUNDS, min(TRIAL_MAX_ROUNDS, int(TRIAL_BUDGET_S / round_s)))


def fit_link(run: Callable[[torch.Tensor], None], group: Any, ring_ranks: int,
             device: torch.device | str = "cpu") -> tuple[float, float]:
    """(fixed s, s/byte) of a link from the fastest of ``PROBE_REPS`` ring allreduces of ``ring_ranks``
    on ``group`` at two sizes (what the link can do: a busy moment of the machine only adds)."""
    points = []
    for nbytes in PROBE_BYTES:
        buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        run(buffer)  # warm the connections
        times = []
        for _ in range(PROBE_REPS):
            dist.barrier(group=group)
            began = time.perf_counter()
            run(buffer)
            times.append(time.perf_counter() - began)
        points.append((float(nbytes), min(times)))
    link = Link.fit_ring(ring_ranks, points[0], points[1])
    return link.latency_s, link.s_per_byte


def time_algorithms(run: Callable[[torch.Tensor, str], None], usable: Sequence[str],
                    device: torch.device | str = "cpu") -> tuple[tuple[str, Link], ...]:
    """A line (fixed cost + cost per byte) per algorithm through its median time at each probe
    size. The algorithms take turns in an order drawn anew each rep (the same on every rank), so
    a slow moment of the machine, or the state one algorithm leaves behind, hits all of them
    alike; a rep counts the slowest rank, as the allreduce is done only when every rank is."""
    medians = []
    for nbytes in PROBE_BYTES:
        buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        for algorithm in usable:
            run(buffer, algorithm)  # warm the connections
        reps = SMALL_PROBE_REPS if nbytes == PROBE_BYTES[0] else PROBE_REPS
        times = torch.zeros(len(usable), reps, dtype=torch.float64, device=device)
        for rep in range(reps):
            for index in random.Random(rep).sample(range(len(usable)), len(usable)):
                dist.barrier()
                began = time.perf_counter()
                run(buffer, usable[index])
                times[index, rep] = time.perf_counter() - began
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        medians.append(times.median(dim=1).values.cpu().tolist())
    small, large = PROBE_BYTES
    return tuple((algorithm, Link.fit_line((small, medians[0][index]), (large, medians[1][index])))
                 for index, algorithm in enumerate(usable))


class Trial:
    """One size class's trial: the candidates take turns, ``rounds`` calls each, in an order drawn
    anew every round (the same on every rank, so no candidate always follows another); ``times[i]``
    holds candidate i's times on this rank. ``settle`` keeps the one least slower than its round's
    fastest (median over rounds, slowest rank), a more elaborate one only when it wins by
    ``CHOICE_MARGIN`` (``topology.simplest_within``)."""

    def __init__(self, candidates: list[str], rounds: int = TRIAL_ROUNDS) -> None:
        self.candidates, self.rounds = candidates, rounds
        self.times: list[list[float]] = [[] for _ in candidates]
        self.calls = 0

    def next(self) -> str:
        turn, n = divmod(self.calls, len(self.candidates))
        return random.Random(turn).sample(self.candidates, len(self.candidates))[n]

    def record(self, algorithm: str, seconds: float) -> None:
        self.times[self.candidates.index(algorithm)].append(seconds)
        self.calls += 1

    @property
    def complete(self) -> bool:
        return self.calls == self.rounds * len(self.candidates)

    def settle(self, group: Any = None, device: torch.device | str = "cpu") -> str:
        """The algorithm to keep (collective over ``group``, the job's ranks, None: the default group;
        every rank settles on the same call). A call counts the slowest rank; a candidate scores the
        median over rounds of its time over the round's fastest (a round runs every candidate back to
        back, so a slow moment of the machine cancels)."""
        times = torch.tensor(self.times, dtype=torch.float64, device=device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
        scores = (times / times.min(dim=0).values).median(dim=1).values.cpu().tolist()
        return simplest_within(dict(zip(self.candidates, scores, strict=True)))


def cache_file(directory: Path | None, topology: Topology, settings: str = "") -> Path | None:
    """Where a job keeps what it measured for ``topology`` with the allreduce's ``settings`` (its chunk
    size, lanes and coding change every algorithm's line and the trials' choices); None: no cache."""
    if directory is None:
        return None
    return directory / f"links-{hashlib.sha1(f'{topology.key()}|{settings}'.encode()).hexdigest()[:12]}.json"


def load_cache(path: Path | None, rank: int) -> tuple[CostModel, dict[int, str]] | None:
    """Rank 0 reads the job's cache and every rank gets its cost model and settled trials (collective)."""
    found: list[Any] = [None]
    if rank == 0 and path is not None and path.exists():
        try:
            found[0] = json.loads(path.read_text())
        except (OSError, ValueError):
            found[0] = None
    dist.broadcast_object_list(found, src=0)
    if found[0] is None:
        return None
    saved = found[0]
    cost = CostModel(Link(*saved["intra"]), Link(*saved["inter"]),
                     tuple((name, Link(*line)) for name, line in saved["measured"]))
    return cost, {int(kind): algorithm for kind, algorithm in saved.get("decided", {}).items()}


def save_cache(path: Path, topology: Topology, cost: CostModel, decided: Mapping[int, str]) -> None:
    """Write the links, the algorithms' lines and the settled trials (call on one rank)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({
        "topology": topology.key(), "intra": [cost.intra.latency_s, cost.intra.s_per_byte],
        "inter": [cost.inter.latency_s, cost.inter.s_per_byte],
        "measured": [[name, [line.latency_s, line.s_per_byte]] for name, line in cost.measured],
        "decided": {str(kind): algorithm for kind, algorithm in sorted(decided.items())}}))
    tmp.replace(path)


def measure(topology: Topology, rank: int, intra_group: Any, leader_group: Any | None,
            run: Callable[[torch.Tensor, str], None], usable: Sequence[str],
            device: torch.device | str = "cpu") -> CostModel:
    """Time ring allreduces of two sizes inside the first group with more than one rank (on this
    rank's ``intra_group``) and among the leaders (``leader_group``, None off the leaders), fitting
    each link's latency and bandwidth; then each of the ``usable`` algorithms end to end through
    ``run`` at the same sizes (``time_algorithms``). Collective over the default group; every rank
    gets the same model."""
    groups = topology.groups
    local_group = next((i for i, g in enumerate(groups) if len(g) > 1), None)
    mine = [0.0] * 4
    if local_group is not None and rank in groups[local_group]:
        mine[:2] = fit_link(lambda b: dist.all_reduce(b, group=intra_group), intra_group, len(groups[local_group]),
                            device)
    if len(groups) > 1 and leader_group is not None:
        mine[2:4] = fit_link(lambda b: dist.all_reduce(b, group=leader_group), leader_group, len(groups), device)
    every: list[list[float]] = [[] for _ in range(topology.world_size)]
    dist.all_gather_object(every, mine)
    inter = Link(*every[topology.leaders[0]][2:4]) if len(groups) > 1 else None
    intra = Link(*every[groups[local_group][0]][:2]) if local_group is not None else None
    lines = time_algorithms(run, usable, device)
    return CostModel(intra or inter or Link(0.0, 1e-9), inter or intra or Link(0.0, 1e-9), lines)
