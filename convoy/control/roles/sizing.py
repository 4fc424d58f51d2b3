"""The master's sizing of a role from one measured iteration of its rank 0 (pure: no I/O).

A role whose count or memory is ``auto`` starts its rank 0 alone; the others wait. When rank 0's agent reports the
measuring iteration, ``measured`` predicts a process's memory (``sizing.predict`` with the margin the
``MarginModel`` has learnt so far), refuses an explicit limit below the need (``check_limit``), and decides how
many processes fit the nodes' free memory and CPUs (``auto`` count) or where the requested ones go. Every process
reports its peak as it runs; the peak at a clean exit is the error the margin learns from. A process killed at its
limit is relaunched with the limit raised by its overshoot (``relaunch_limit``), a few times per rank.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from convoy.control.job import Event
from convoy.control.protocol import messages as p
from convoy.control.roles.flat import flat
from convoy.control.roles.memory_model import (IterationShape, MarginModel, MeasuredIteration, MemoryPrediction,
                                               check_limit, place_workers, predict, relaunch_limit)
from convoy.errors import ConfigError
from convoy.roles_config import RoleSpec

MAX_OOM_RELAUNCHES = 3
"""Relaunches of one rank after OOM kills, each with a raised limit, before its next kill counts as a failure."""
NODE_RESERVE_FRACTION = 0.05
"""Of a node's free memory, this share is kept free (the agent, page cache, what the estimate misses)."""
MIB = 1024 * 1024
Key = tuple[str, int, int]


def needs_sizing(spec: RoleSpec) -> bool:
    return spec.count.auto or spec.memory_auto


@dataclass
class NodeMemory:
    available_bytes: int = 0
    limit_bytes: int = 0
    cpus: int = 0


@dataclass
class ProcessRecord:
    """What status shows of one role process: the prediction, the limit it runs under, its measured peak."""

    node_id: str = ""
    predicted_bytes: int = 0
    limit_bytes: int = 0
    peak_bytes: int = 0
    mechanism: str = ""
    state: str = "running"
    error: float | None = None


@dataclass
class SizedRole:
    spec: RoleSpec
    measured: MeasuredIteration | None = None
    prediction: MemoryPrediction | None = None
    measuring_node: str = ""
    measuring_begun: bool = False
    relaunches: dict[int, int] = field(default_factory=dict)
    """OOM relaunches so far, per rank."""
    rank_limits: dict[int, int] = field(default_factory=dict)
    """A rank's own limit, raised after an OOM kill (else the role's)."""


@dataclass(frozen=True)
class Sizing:
    """What the master does once a role is measured: run ``count`` processes (None: the count it has), rank ->
    node for the ranks still to start, and the limit each gets."""

    role: str
    count: int | None
    homes: dict[int, str]
    limit_bytes: int
    why: str


class RoleSizing:
    """Sizing state of a job's roles; the RoleMaster calls it under the master's lock."""

    def __init__(self, specs: tuple[RoleSpec, ...]) -> None:
        self.specs = {spec.name: spec for spec in specs}
        self.roles = {spec.name: SizedRole(spec) for spec in specs if needs_sizing(spec)}
        self.margin = MarginModel()
        self.nodes: dict[str, NodeMemory] = {}
        self.processes: dict[Key, ProcessRecord] = {}
        self.changed = False
        """Something status shows changed since the master last wrote it."""

    def waits(self, role: str, rank: int) -> bool:
        """A process of a sized role that waits for its role's measurement (every rank but 0)."""
        sized = self.roles.get(role)
        return sized is not None and sized.prediction is None and rank > 0

    def measures(self, role: str, rank: int) -> bool:
        sized = self.roles.get(role)
        return sized is not None and sized.prediction is None and rank == 0

    def limit_for(self, role: str, rank: int) -> int:
        """The memory limit a process of ``role`` starts under (0: none): a rank's raised limit after an OOM
        kill, the role's explicit ``memory``, or the prediction with the margin learnt so far."""
        spec, sized = self.specs[role], self.roles.get(role)
        if sized is not None and rank in sized.rank_limits:
            return sized.rank_limits[rank]
        if spec.memory_bytes is not None:
            return spec.memory_bytes
        if sized is None or sized.prediction is None or self.measures(role, rank):
            return 0
        return _pages(sized.prediction.rss_bytes * (1 + self.margin.margin()))

    def placed(self, key: Key, node_id: str) -> None:
        """A process was assigned to a node: status lists it from now on."""
        sized = self.roles.get(key[0])
        predicted = sized.prediction.rss_bytes if sized is not None and sized.prediction is not None else 0
        self.processes[key] = ProcessRecord(node_id, predicted, self.limit_for(key[0], key[1]))
        self.changed = True

    def node_memory(self, node_id: str, available_bytes: int, limit_bytes: int, cpus: int = 0) -> None:
        known = self.nodes.setdefault(node_id, NodeMemory())
        known.available_bytes, known.limit_bytes = available_bytes, limit_bytes
        known.cpus = cpus or known.cpus

    def memory(self, report: p.MemoryReport) -> list[tuple[str, int, int, p.MeasuredIterationReport]]:
        """Take a node's report; returns the measuring iterations it completes (role, rank, incarnation, figures)."""
        if report.memory_available_bytes:
            self.node_memory(report.node_id, report.memory_available_bytes, report.memory_limit_bytes)
        done = []
        for proc in report.processes:
            record = self.processes.get((proc.role, proc.rank, proc.incarnation))
            if record is not None and (proc.peak_rss_bytes > record.peak_bytes or proc.mechanism != record.mechanism):
                record.peak_bytes = max(record.peak_bytes, proc.peak_rss_bytes)
                record.mechanism = proc.mechanism or record.mechanism
                self.changed = True
            sized = self.roles.get(proc.role)
            if sized is None or proc.rank != 0 or sized.prediction is not None:
                continue
            sized.measuring_begun = sized.measuring_begun or proc.measuring or proc.measured is not None
            if proc.measured is not None:
                done.append((proc.role, proc.rank, proc.incarnation, proc.measured))
        return done

    def measured(self, role: str, node_id: str, figures: p.MeasuredIterationReport,
                 running: dict[str, int], waiting: list[int]) -> Sizing:
        """Predict the role's memory from its rank 0's measuring iteration and decide its processes.

        ``running``: the role's processes per node now (rank 0 among them); ``waiting``: ranks held for the
        measurement. A ConfigError (a limit below the need, workers that do not fit) fails the job."""
        sized = self.roles[role]
        shape = IterationShape(figures.state_bytes, figures.batch_size, figures.sample_bytes)
        sized.measured = MeasuredIteration(shape, figures.peak_rss_bytes, figures.peak_uss_bytes,
                                           figures.baseline_rss_bytes, figures.baseline_uss_bytes,
                                           figures.activation_bytes)
        prediction = predict(sized.measured, shape, self.margin.margin())
        if sized.spec.memory_bytes is not None:
            check_limit(sized.spec.memory_bytes, prediction, role)
        sized.prediction, sized.measuring_node = prediction, node_id
        limit = self.limit_for(role, 1)
        record = self.processes.get((role, 0, _incarnation_of(self.processes, role, 0)))
        if record is not None:
            record.predicted_bytes = prediction.rss_bytes
        self.changed = True
        free = {node: max(0, known.available_bytes) for node, known in self.nodes.items() if known.available_bytes}
        if not free:
            raise ConfigError(f"no node reported its free memory, so role {role}'s processes of {_mib(limit)} "
                              "cannot be placed; check that the agents are this convoy's version")
        what = (f"predicted {_mib(prediction.rss_bytes)} per process from the measuring iteration (peak "
                f"{_mib(figures.peak_rss_bytes)} RSS over {figures.duration_s:.2f} s, batch {figures.batch_size}), "
                f"limit {_mib(limit)} (margin {self.margin.margin():.1%})")
        if figures.gpu_peak_bytes is not None:  # the same batch on every process: the same GPU memory each
            what += f"; GPU memory {_mib(figures.gpu_peak_bytes)} per process (the iteration's reserved peak)"
        if sized.spec.count.auto:
            room = self._room(free, limit, running, sized.spec)
            homes = _spread(room, 1)
            return Sizing(role, 1 + len(homes), homes, limit,
                          f"{what}; {_fits(room, running)} fit the nodes' free memory and CPUs")
        placed = place_workers(free, limit, len(waiting), _reserve(free))
        homes = dict(zip(sorted(waiting), [node for node, n in sorted(placed.items()) for _ in range(n)]))
        return Sizing(role, None, homes, limit, what)

    def _room(self, free: dict[str, int], limit: int, running: dict[str, int], spec: RoleSpec) -> dict[str, int]:
        """More processes each node takes: as many as its free memory holds, at most one per CPU it has left
        (``cpus`` per process, default 1) after the role's processes running there."""
        room = place_workers(free, limit, None, _reserve(free))
        per_process = spec.cpus or 1.0
        for node, fits in room.items():
            cpus = self.nodes[node].cpus or 1
            room[node] = max(0, min(fits, int(cpus // per_process) - running.get(node, 0)))
        return room

    def exited(self, key: Key, report: p.RoleReport) -> list[Event]:
        """A process ended: at a clean exit its peak against its prediction is an error the margin learns. Not
        the measuring rank 0's: a chief also evaluates and triggers checkpoints, which the others do not."""
        record = self.processes.get(key)
        if record is None:
            return []
        record.peak_bytes = max(record.peak_bytes, report.memory_peak_bytes)
        record.state, self.changed = ("oom-killed" if report.oom_killed else "exited"), True
        if report.exitcode != 0 or report.oom_killed or not record.predicted_bytes or not record.peak_bytes:
            return []
        if key[1] == 0 and key[0] in self.roles:
            return []
        record.error = self.margin.record(record.predicted_bytes, record.peak_bytes)
        return [Event("memory_measured", f"{key[0]} {key[1]} peaked at {_mib(record.peak_bytes)} against "
                                         f"{_mib(record.predicted_bytes)} predicted ({record.error:+.1%}); the "
                                         f"margin is now {self.margin.margin():.1%}", record.node_id)]

    def oom(self, key: Key, report: p.RoleReport) -> tuple[int, str] | None:
        """A process killed at its limit: its new limit and why, or None when its rank was relaunched too often
        (the kill then counts as a failure of the role)."""
        role, rank, _ = key
        record, sized = self.processes.get(key), self.roles.get(role)
        if record is None or sized is None or not record.limit_bytes:
            return None
        if sized.relaunches.get(rank, 0) >= MAX_OOM_RELAUNCHES:
            return None
        sized.relaunches[rank] = sized.relaunches.get(rank, 0) + 1
        if record.predicted_bytes:
            self.margin.record_oom(record.predicted_bytes, record.limit_bytes, report.overshoot_bytes)
        raised = relaunch_limit(record.limit_bytes, report.overshoot_bytes, self.margin.margin())
        sized.rank_limits[rank] = raised
        self.changed = True
        return raised, (f"{role} {rank} was OOM-killed at its limit {_mib(record.limit_bytes)} (overshoot "
                        f"{_mib(report.overshoot_bytes)}); relaunched with {_mib(raised)} (OOM relaunch "
                        f"{sized.relaunches[rank]} of {MAX_OOM_RELAUNCHES}, not counted as a restart)")

    def measuring_failed(self, key: Key, report: p.RoleReport) -> str | None:
        """Why the job fails when the measuring process of a role ended before its measurement (None: it is not
        that process)."""
        role, rank, _ = key
        if not self.measures(role, rank):
            return None
        sized = self.roles[role]
        where = ("crashed in the measuring iteration" if sized.measuring_begun
                 else "ended before its measuring iteration")
        return (f"{role} 0 {where} (convoy.measure_iteration), which sizes role {role}: it "
                f"{report.describe()}; no other {role} was started. Fix the script (its log: "
                f"{report.log_path or 'the role logs'}) and run the job again")

    def state(self) -> dict[str, Any]:
        """What a restarted master needs to go on sizing (JSON-ready; the specs come from roles.json)."""
        def role_state(sized: SizedRole) -> dict[str, Any]:
            return {"measured": asdict(sized.measured) if sized.measured else None,
                    "prediction": asdict(sized.prediction) if sized.prediction else None,
                    "measuring_node": sized.measuring_node, "measuring_begun": sized.measuring_begun,
                    "relaunches": sized.relaunches, "rank_limits": sized.rank_limits}
        return {"margin": self.margin.state(), "nodes": {node: flat(memory) for node, memory in self.nodes.items()},
                "processes": [[*key, flat(record)] for key, record in self.processes.items()],
                "roles": {name: role_state(sized) for name, sized in self.roles.items()}}

    def load_state(self, saved: dict[str, Any]) -> None:
        """Take back what ``state()`` gave."""
        self.margin = MarginModel.from_state(saved["margin"])
        self.nodes = {node: NodeMemory(**memory) for node, memory in saved["nodes"].items()}
        self.processes = {(role, rank, inc): ProcessRecord(**record) for role, rank, inc, record in saved["processes"]}
        for name, entry in saved["roles"].items():
            sized = self.roles[name]
            measured = entry["measured"]
            if measured is not None:
                sized.measured = MeasuredIteration(**{**measured, "shape": IterationShape(**measured["shape"])})
            sized.prediction = MemoryPrediction(**entry["prediction"]) if entry["prediction"] else None
            sized.measuring_node, sized.measuring_begun = entry["measuring_node"], entry["measuring_begun"]
            sized.relaunches = {int(rank): count for rank, count in entry["relaunches"].items()}
            sized.rank_limits = {int(rank): limit for rank, limit in entry["rank_limits"].items()}
        self.changed = True

    def rows(self) -> list[dict[str, object]]:
        """Per process, for ``convoy status``: predicted, limit and measured peak in bytes (0: none)."""
        return [{"role": role, "rank": rank, "incarnation": incarnation, "node": record.node_id,
                 "predicted_bytes": record.predicted_bytes, "limit_bytes": record.limit_bytes,
                 "peak_bytes": record.peak_bytes, "mechanism": record.mechanism, "state": record.state}
                for (role, rank, incarnation), record in sorted(self.processes.items())]


def _incarnation_of(processes: dict[Key, ProcessRecord], role: str, rank: int) -> int:
    return max((key[2] for key in processes if key[:2] == (role, rank)), default=0)


def _spread(room: dict[str, int], first_rank: int) -> dict[int, str]:
    """Rank -> node for the processes ``room`` allows, nodes in name order."""
    nodes = [node for node, count in sorted(room.items()) for _ in range(count)]
    return {first_rank + i: node for i, node in enumerate(nodes)}


def _fits(room: dict[str, int], running: dict[str, int]) -> str:
    total = sum(room.values())
    return f"{total} more (beside the {sum(running.values())} running)"


def _reserve(free: dict[str, int]) -> int:
    return int(NODE_RESERVE_FRACTION * min(free.values(), default=0))


def _pages(value: float) -> int:
    return -(-int(value) // 4096) * 4096


def _mib(value: int) -> str:
    return f"{value / MIB:.1f} MiB"
