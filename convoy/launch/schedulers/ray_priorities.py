"""This job's side of the cluster's claims board (``ray_claims``): its claim renewed, the others' read back, and the
nodes it gives back to jobs of higher priority. Calls to the board never block a tick: each answer is taken on a
later tick, when it has come."""

from __future__ import annotations

import time
from typing import Any, Iterable

from convoy.launch.schedulers.ray_agent import ClaimsBoard
from convoy.launch.schedulers.ray_claims import NodeClaim, free_for, to_give
from convoy.launch.schedulers.ray_nodes import NodeShare, RayNode, fits

BOARD = "convoy-claims"
READ_FIRST_S = 10.0
SETTLE_S = 5.0
"""After giving nodes back, how long before giving more (the job that wanted them places its agents meanwhile)."""


class Priorities:
    def __init__(self, ray: Any, namespace: str, job_id: str, priority: int, min_nodes: int, share: NodeShare) -> None:
        self.ray, self.job_id, self.priority, self.min_nodes, self.share = ray, job_id, priority, min_nodes, share
        self.since = time.time()
        # restarted by Ray elsewhere if its node is lost: it is empty then, and every job's next renewal refills it
        self.board = ray.remote(ClaimsBoard).options(name=BOARD, namespace=namespace, lifetime="detached",
                                                     get_if_exists=True, num_cpus=0, max_restarts=-1).remote()
        self.others: list[NodeClaim] = []
        self.reading: Any = self.board.all.remote()
        self.settle_until = 0.0
        self.ray.wait([self.reading], timeout=READ_FIRST_S)  # where the other jobs' agents are, before placing any
        self.read()

    def read(self) -> None:
        """Take the board's last answer if it has come, and ask again."""
        if self.reading is not None:
            if not self.ray.wait([self.reading], timeout=0)[0]:
                return
            try:
                answer = self.ray.get(self.reading)
            except self.ray.exceptions.RayError:
                answer = None  # the board is being restarted; the claims come back on the next read
            if answer is not None:
                self.others = [NodeClaim.from_dict(entry) for entry in answer if entry["job_id"] != self.job_id]
        self.reading = self.board.all.remote()

    def free(self, node: RayNode) -> bool:
        """The node has room for one more of this job's agents besides what other jobs' agents hold there."""
        return free_for(node, self.share, self.others, self.job_id)

    def publish(self, held: Iterable[str], wanting: int, nodes: list[RayNode]) -> None:
        fitting = tuple(node.node_id for node in nodes if fits(node, self.share)) if wanting else ()
        claim = NodeClaim(self.job_id, self.priority, self.since, self.min_nodes, self.share.request(),
                          tuple(held), wanting, fitting)
        self.board.put.remote(claim.as_dict())

    def to_give(self, held: Iterable[str], now: float) -> int:
        """How many of its nodes this job gives back now (0 while the last ones are still being taken up)."""
        if now < self.settle_until:
            return 0
        mine = NodeClaim(self.job_id, self.priority, self.since, self.min_nodes, self.share.request(), tuple(held))
        giving = to_give([*self.others, mine], self.job_id)
        if giving:
            self.settle_until = now + SETTLE_S
        return giving

    def close(self) -> None:
        try:
            self.ray.get(self.board.remove.remote(self.job_id), timeout=5)
        except Exception:  # noqa: BLE001 (the board or the cluster gone: the claim goes stale on its own)
            pass
