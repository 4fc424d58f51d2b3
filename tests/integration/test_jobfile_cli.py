"""``convoy run job.toml`` on the real command line: a bad file is one line naming its line and key, and starts
nothing; a good one runs the job, with the flags after it overriding it."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import ProcessScope, fixture, one_error_line, records

from convoy.control.store import read_status

pytestmark = pytest.mark.slow


def test_a_bad_job_file_is_one_line_naming_its_line_and_key(procs: ProcessScope, tmp_path: Path) -> None:
    bad = tmp_path / "jobs" / "bad.toml"
    bad.parent.mkdir()
    bad.write_text(f'entrypoint = "{fixture("worker.py")}"\nrun_dir = "run"\npreload = []\n\n'
                   '[roles.worker]\ncount = 2\nmem = "12GiB"\n')
    result = procs.run(["run", bad], timeout=60)
    line = one_error_line(result)
    assert line.startswith(f"convoy: error: {bad}:7: unknown key 'mem' in [roles.worker]"), result.explain()
    assert result.stdout == "", "a refused job starts nothing, so prints nothing"
    assert not (tmp_path / "jobs" / "run").exists(), "not even its run dir"
    assert procs.wait_no_leftovers(timeout=5) == []


def test_a_good_job_file_runs_the_job_with_the_flags_over_it(procs: ProcessScope, tmp_path: Path) -> None:
    record_dir = tmp_path / "records"
    record_dir.mkdir()
    good = tmp_path / "jobs" / "good.toml"  # not the command's working directory, which is tmp_path
    good.parent.mkdir()
    good.write_text(f'entrypoint = "{fixture("worker.py")}"\nargs = ["--record", "{record_dir}", "from-the-file"]\n'
                    'run_dir = "run"\nnproc_per_node = 1\npreload = []\nstop_grace = 1\nmax_restarts = 0\n')
    result = procs.run(["run", good, "--nproc-per-node", "2"], timeout=90)
    assert result.returncode == 0, result.explain()
    seen = records(record_dir, round_id=1)
    assert sorted(seen) == [0, 1], "--nproc-per-node 2 after the file wins over its nproc_per_node = 1"
    assert all(record["argv"][-1] == "from-the-file" for record in seen.values()), "the file's args reach the script"
    assert read_status(tmp_path / "jobs" / "run")["job"]["status"] == "succeeded", "run_dir is relative to the file"
    assert not (tmp_path / "run").exists()
    assert procs.wait_no_leftovers(timeout=5) == []


def test_the_roles_of_a_job_file_run_with_a_flag_over_a_count(procs: ProcessScope, tmp_path: Path) -> None:
    """[roles.ps] and [roles.worker] reach the running job; --workers after the file changes the worker count."""
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    roles = jobs / "roles.toml"
    roles.write_text(f'entrypoint = "{fixture("role_train.py")}"\nrun_dir = "run"\npreload = []\nstop_grace = 1\n\n'
                     '[roles.ps]\ncount = 1\n\n[roles.worker]\ncount = 1\ncpus = 1\n')
    result = procs.run(["run", roles, "--workers", "2"], timeout=90)
    assert result.returncode == 0, result.explain()
    assert "convoy: job succeeded: every role finished (ps x1, worker x2)" in result.stdout, result.explain()
    for rank in (0, 1):
        assert f"[worker{rank}]: worker{rank} of 2 did 3 steps with 1 ps" in result.stdout, result.explain()
    assert procs.wait_no_leftovers(timeout=5) == []
