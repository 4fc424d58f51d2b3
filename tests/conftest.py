"""Shared fixtures: ``procs`` scopes and cleans up the real processes one test starts."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `import helpers` from any test module

from helpers import ProcessScope  # noqa: E402


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
