"""Shared fixtures: ``procs`` scopes and cleans up the real processes one test starts."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `import helpers` from any test module

from helpers import ProcessScope  # noqa: E402


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A slow test (real multi-process jobs, timed by a loaded 2-core machine) gets one retry; a retry is printed
    as R and listed under "rerun test summary info" (``-rR``), so a flaky one stays in view."""
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("flaky"):
            item.add_marker(pytest.mark.flaky(reruns=1, reruns_delay=2))


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[ProcessScope]:
    """Starts convoy commands for one test; teardown fails the test if any of its processes
    outlived it (then kills them, so one leak cannot disturb the next test)."""
    scope = ProcessScope(tmp_path)
    yield scope
    left = scope.wait_no_leftovers(timeout=10.0)
    scope.kill_all()
    if left:
        pytest.fail("processes left running after the test:\n  " + "\n  ".join(left))


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A run dir that does not exist yet (convoy creates it); its path is unique to the test."""
    return tmp_path / "run"
