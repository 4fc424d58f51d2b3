"""The dashboard's nodes page a page at a time (issue 54): a job of hundreds of nodes is read in pages, each node
with the ranks of the last round, and the last page says where the nodes end."""

from __future__ import annotations

from pathlib import Path

from convoy.control.dashboard.views import NODES_PAGE, nodes
from convoy.control.job import Event, Job
from convoy.control.nodes import NodeRegistry
from convoy.control.rendezvous import Rendezvous
from convoy.control.store import Store

COUNT = 450


def _job_of(run_dir: Path) -> None:
    rendezvous = Rendezvous(COUNT, COUNT, 0.0, opened_at=0.0)
    job = Job("abc", rendezvous, 0, 1.0)
    registry = NodeRegistry(timeout_s=30.0)
    for index in range(COUNT):
        registry.register(f"n{index:04d}", "127.0.0.1", 1 + index % 2, now=0.0)
        job.join(f"n{index:04d}", "127.0.0.1", 1 + index % 2, 29500, 0.0)
    assert job.membership is not None
    store = Store(run_dir, "{}")
    store.save(job, [Event("round_closed", "round 1")], "127.0.0.1:1", list(registry.nodes.values()))
    store.close()


def test_the_nodes_come_a_page_at_a_time_with_the_ranks_of_the_round(tmp_path: Path) -> None:
    _job_of(tmp_path)
    first = nodes(tmp_path)
    assert first["total"] == COUNT and len(first["nodes"]) == NODES_PAGE and first["offset"] == 0
    seen, offset, ranks = [], 0, []
    while offset < COUNT:
        page = nodes(tmp_path, offset=offset, limit=100)
        seen += [node["node_id"] for node in page["nodes"]]
        ranks += [rank for node in sorted(page["nodes"], key=lambda n: n["node_rank"])
                  for rank in (w["rank"] for w in node["workers"])]
        offset += 100
    assert sorted(seen) == [f"n{index:04d}" for index in range(COUNT)] and len(set(seen)) == COUNT
    world = sum(1 + index % 2 for index in range(COUNT))
    assert sorted(ranks) == list(range(world)), "every rank once, each node's ranks where its node rank puts them"
    assert nodes(tmp_path, offset=COUNT)["nodes"] == []
