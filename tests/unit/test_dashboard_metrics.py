"""The dashboard's metric series: every rank's points in step order, thinned to about a bound per rank (every
k-th step, and its newest point), bounded by row ids, with non-finite losses as gaps."""

from __future__ import annotations

from pathlib import Path

from convoy.control.dashboard import views
from convoy.control.training.status_store import StatusStore


def job_with_points(run_dir: Path, counts: dict[str, int]) -> None:
    """Rows of several ranks, interleaved as ranks report, some steps repeated (a restarted round)."""
    store = StatusStore(run_dir, max_per_task=10**6)
    rows = []
    for step in range(max(counts.values())):
        for task, count in counts.items():
            if step < count:
                loss = float("nan") if step == 3 else 1.0 / (step + 1)
                rows.append((task, "default", 0, step, 1000.0 + step, loss, 0.05, 10.0, 0, None, None))
    rows += [("a:0", "default", 0, 5, 2000.0, 0.5, 0.05, 10.0, 0, None, None)]  # step 5 again, after a restart
    store.add(rows)
    store.close()


def test_every_rank_is_thinned_to_its_bound_with_its_last_point(tmp_path: Path) -> None:
    job_with_points(tmp_path, {"a:0": 1000, "a:1": 999, "a:2": 7})
    got = views.metrics(tmp_path, per_task=100)
    assert sorted(got["series"]) == ["a:0", "a:1", "a:2"]
    first = got["series"]["a:0"]
    assert first["step"][:4] == [0, 5, 10, 20], "every 10th of 1000 steps, and the newest point (step 5 again)"
    assert len(first["step"]) == 101 and first["step"][-1] == 990
    second = got["series"]["a:1"]["step"]
    assert len(second) == 101 and second[-2:] == [990, 998], "its newest point is kept"
    assert got["series"]["a:2"]["step"] == list(range(7)), "a rank under the bound keeps all its points"
    assert got["series"]["a:2"]["loss"][3] is None, "a nan loss is a gap"
    assert got["last_id"] == 1000 + 999 + 7 + 1


def test_a_window_of_row_ids_gives_only_its_points(tmp_path: Path) -> None:
    job_with_points(tmp_path, {"a:0": 50, "a:1": 50})
    everything = views.metrics(tmp_path)
    assert [len(s["step"]) for s in everything["series"].values()] == [51, 50]
    window = views.metrics(tmp_path, after=10, upto=20)
    assert sum(len(s["step"]) for s in window["series"].values()) == 10 and window["last_id"] == 20
    assert views.metrics(tmp_path, after=everything["last_id"]) == {"series": {}, "last_id": everything["last_id"]}
