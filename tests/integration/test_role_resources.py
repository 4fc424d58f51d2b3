"""What a role declares it takes, end to end: its ``cpus`` held by the kernel (and the mechanism named), its
``gpus`` handed out per node as CUDA_VISIBLE_DEVICES, a LOCAL_RANK per process; a role asking for more GPUs than
the host has, and scaling a role whose count is fixed, refused in one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import ProcessScope, fixture, one_error_line, wait_for

pytestmark = pytest.mark.slow

SCRIPT = fixture("role_resources.py")


def job_file(tmp_path: Path, trainer_gpus: int) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(f"""entrypoint = "{SCRIPT}"
max_restarts = 0

[roles.spinner]
count = 1
cpus = 0.25

[roles.trainer]
count = 2
gpus = {trainer_gpus}
""")
    return path


def test_cpus_are_held_by_the_kernel_and_gpus_handed_out_one_device_each(procs: ProcessScope, run_dir: Path,
                                                                       tmp_path: Path) -> None:
    result = procs.run(["run", "--preload", "", "--run-dir", run_dir, job_file(tmp_path, 1)],
                       env={"CUDA_VISIBLE_DEVICES": "7,9"})
    assert result.returncode == 0, result.explain()
    seen = {(r["role"], r["rank"]): r for r in map(json.loads, (run_dir / "resources.jsonl").read_text().split("\n")
                                                   [:-1])}
    assert sorted(seen[("trainer", rank)]["devices"] for rank in (0, 1)) == ["7", "9"], seen
    assert seen[("spinner", 0)]["devices"] == "", "a role that takes no GPU sees none where the job hands them out"
    assert sorted(r["local_rank"] for r in seen.values()) == ["0", "1", "2"], "one slot each on the node"
    events = (run_dir / "events.jsonl").read_text()
    started = re.search(r"spinner 0 is running at \S+ \(local0, pid \d+, 0\.25 CPU\(s\) by ([a-z0-9-]+)", events)
    assert started is not None, "its start names how its cpus hold it: " + events
    assert seen[("spinner", 0)]["share"] < 0.45, f"a quarter of a CPU by {started.group(1)}: {seen}"


def test_a_role_asking_more_gpus_than_the_host_has_is_one_line(procs: ProcessScope, run_dir: Path,
                                                               tmp_path: Path) -> None:
    result = procs.run(["run", "--preload", "", "--run-dir", run_dir, job_file(tmp_path, 3)],
                       env={"CUDA_VISIBLE_DEVICES": "7,9"})
    assert result.returncode == 2, result.explain()
    assert one_error_line(result) == ("convoy: error: role 'trainer': gpus 3: each process takes 3 GPU(s) and this "
                                      "host has 2 (CUDA_VISIBLE_DEVICES='7,9'); lower the role's gpus, or run the "
                                      "job on nodes that have them")
    assert not run_dir.exists() or not (run_dir / "state.db").exists(), "nothing started"


def test_scaling_the_ps_is_refused_saying_why(procs: ProcessScope, run_dir: Path, tmp_path: Path) -> None:
    release = tmp_path / "release"
    job = procs.start(["run", "--ps", "1", "--workers", "1", "--preload", "", "--stop-grace", "1", "--run-dir",
                       run_dir, fixture("role_train.py"), "--hold-until", release])
    wait_for(lambda: (run_dir / "role_records.jsonl").exists(), 30, "the PS to start")
    refused = procs.run(["scale", "--run-dir", run_dir, "ps=2"])
    assert refused.returncode == 2, refused.explain()
    assert "role ps cannot change its count (1): the parameter servers' layout (which PS holds which tensors) is " \
           "fixed when the workers set it up" in one_error_line(refused)
    release.touch()
    assert job.wait().returncode == 0


@pytest.mark.parametrize(("key", "value", "said"), [
    ("cpus", "0", "roles.trainer.cpus: cpus 0: need a positive number, e.g. 2 or 0.5"),
    ("cpus", "-2", "roles.trainer.cpus: cpus -2: need a positive number, e.g. 2 or 0.5"),
    ("gpus", "-1", "roles.trainer.gpus: gpus -1: need a whole number of devices, 0 or more, e.g. 1"),
])
def test_a_bad_cpus_or_gpus_is_one_line_naming_the_role_and_the_key(procs: ProcessScope, run_dir: Path,
                                                                    tmp_path: Path, key: str, value: str,
                                                                    said: str) -> None:
    path = tmp_path / "job.toml"
    path.write_text(f'entrypoint = "{SCRIPT}"\n\n[roles.trainer]\n{key} = {value}\n')
    result = procs.run(["run", "--run-dir", run_dir, path])
    assert one_error_line(result) == f"convoy: error: {path}:4: {said}"
    assert not run_dir.exists(), "nothing started"
