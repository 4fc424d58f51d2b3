"""The scale simulator's mechanics at N = 64 (``benchmarks/scale.py``): a real master, 64 simulated agents over real
HTTP with the job's token; all of them hold the first round, their heartbeats are answered, a node that goes silent
is dropped and every other agent holds the next round; the master ends when told. The figures at larger N are
the benchmark's."""

from __future__ import annotations

import sys

import pytest

from helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "benchmarks" / "scripts"))

pytestmark = pytest.mark.slow


def test_64_simulated_agents_hold_a_round_heartbeat_and_regroup_without_a_silent_one() -> None:
    import scale

    row = scale.measure(64, steady_s=2.0, timeout_s=60.0, heartbeat_timeout_s=5.0)  # a silent node lost in 5 s
    assert "stopped" not in row, row
    assert isinstance(row["round_s"], float) and row["round_s"] >= 0
    assert isinstance(row["beats"], int) and row["beats"] >= 64, "every agent heartbeats in the steady window"
    assert isinstance(row["next_round_s"], float), row
    assert 0 < row["rss_mb"] < 1000 and row["state_mb"] > 0, row
    assert isinstance(row["told_s"], float) and row["told_s"] <= row["next_round_s"], row


def test_64_simulated_agents_of_a_job_of_roles_start_their_processes_and_move_a_lost_nodes() -> None:
    import scale_roles

    row = scale_roles.measure(64, steady_s=2.0, timeout_s=60.0, heartbeat_timeout_s=5.0)
    assert "stopped" not in row, row
    assert isinstance(row["started_s"], float) and row["started_s"] <= row["addresses_s"], row
    assert isinstance(row["beats"], int) and row["beats"] >= 64, "every agent heartbeats in the steady window"
    assert isinstance(row["moved_s"], float) and isinstance(row["known_s"], float), row
