"""What the job state machine's tests share: a two-node job, its nodes joining, a worker's failure report."""

from __future__ import annotations

from convoy.control.job import Event, Job
from convoy.control.protocol.messages import WorkerExit
from convoy.control.rendezvous import Rendezvous

NODES = {"n0": ("10.0.0.1", 2), "n1": ("10.0.0.2", 2)}


def make_job(max_restarts: int = 3, min_nodes: int = 2, max_nodes: int = 2, wait_s: float = 0.0,
             join_timeout_s: float = 60.0) -> Job:
    return Job("job1", Rendezvous(min_nodes, max_nodes, wait_s, opened_at=0.0), max_restarts, join_timeout_s)


def join_all(job: Job, now: float, nodes: tuple[str, ...] = ("n0", "n1")) -> list[Event]:
    events: list[Event] = []
    for node_id in nodes:
        host, nproc = NODES[node_id]
        _, new = job.join(node_id, host, nproc, 29500, now)
        events += new
    return events


def failure(node_id: str, round_id: int, rank: int, local_rank: int = 0, **fields: object) -> WorkerExit:
    fields.setdefault("exitcode", 1)
    return WorkerExit(node_id=node_id, round_id=round_id, rank=rank, local_rank=local_rank, **fields)  # type: ignore[arg-type]


def kinds(events: list[Event]) -> list[str]:
    return [e.kind for e in events]
