"""Config parsing and validation: every error is a ConfigError naming the field and the bad value."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from convoy.config import (
    JobConfig,
    MasterConfig,
    RendezvousConfig,
    WorkerConfig,
    check_entrypoint,
    check_run_dir,
    default_run_dir,
    parse_address,
    parse_nnodes,
)
from convoy.errors import ConfigError, ConvoyError
from convoy.roles_config import RoleCount, RoleSpec


@pytest.mark.parametrize(("spec", "expected"), [
    ("1", (1, 1)), ("2", (2, 2)), ("1:4", (1, 4)), ("3:3", (3, 3)), ("16", (16, 16)),
])
def test_parse_nnodes_accepts_n_and_min_max(spec: str, expected: tuple[int, int]) -> None:
    assert parse_nnodes(spec) == expected


@pytest.mark.parametrize("spec", ["0", "3:1", "x", "", "1:2:3", "-1", "1.5", ":2", "2:", "0:2", "a:b", "2:x"])
def test_parse_nnodes_rejects_bad_specs_naming_them(spec: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_nnodes(spec)
    assert "--nnodes" in str(info.value) and repr(spec) in str(info.value)


def test_config_errors_are_convoy_errors() -> None:
    assert issubclass(ConfigError, ConvoyError)


def test_a_bad_argument_is_also_a_value_error() -> None:
    """Library callers catch ValueError for a bad argument, as they do with torch and torchtitan."""
    with pytest.raises(ValueError, match="--nnodes"):
        parse_nnodes("3:1")


@pytest.mark.parametrize(("spec", "expected"), [
    ("10.0.0.5:29400", ("10.0.0.5", 29400)),
    ("localhost:1", ("localhost", 1)),
    ("node-7.cluster.local:65535", ("node-7.cluster.local", 65535)),
    ("[::1]:8080", ("::1", 8080)),
])
def test_parse_address(spec: str, expected: tuple[str, int]) -> None:
    assert parse_address(spec) == expected


@pytest.mark.parametrize("spec", ["10.0.0.5", ":29400", "host:", "host:0", "host:65536", "host:x", "", "host:-1"])
def test_parse_address_rejects_bad_addresses(spec: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_address(spec)
    assert "--master" in str(info.value) and repr(spec) in str(info.value)


def worker_config(tmp_path: Path, **fields: object) -> WorkerConfig:
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    values: dict[str, object] = {"entrypoint": str(script)}
    values.update(fields)
    return WorkerConfig(**values)  # type: ignore[arg-type]


def test_valid_worker_config_passes(tmp_path: Path) -> None:
    worker_config(tmp_path, nproc_per_node=4, stop_grace_s=0.0).validate()
    WorkerConfig(entrypoint="json.tool", module=True).validate()


@pytest.mark.parametrize(("fields", "expected"), [
    ({"nproc_per_node": 0}, "--nproc-per-node 0"),
    ({"nproc_per_node": -2}, "--nproc-per-node -2"),
    ({"stop_grace_s": -1.0}, "--stop-grace -1.0"),
    ({"entrypoint": ""}, "no training script given"),
    ({"entrypoint": "/nonexistent/train.py"}, "script '/nonexistent/train.py' not found"),
    ({"entrypoint": "no_such_module_xyz", "module": True}, "module 'no_such_module_xyz' not found"),
    ({"entrypoint": "no_such_pkg_xyz.sub", "module": True}, "module 'no_such_pkg_xyz.sub' not found"),
    ({"entrypoint": ".relative", "module": True}, "module '.relative' not found"),
])
def test_worker_config_errors_name_the_field(tmp_path: Path, fields: dict[str, object], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected.replace(".", r"\.").replace("(", r"\(")):
        worker_config(tmp_path, **fields).validate()


def test_script_directory_needs_a_main(tmp_path: Path) -> None:
    package = tmp_path / "app"
    package.mkdir()
    with pytest.raises(ConfigError, match="directory without __main__.py"):
        WorkerConfig(entrypoint=str(package)).validate()
    (package / "__main__.py").write_text("")
    WorkerConfig(entrypoint=str(package)).validate()


def master_config(tmp_path: Path, **fields: object) -> MasterConfig:
    values: dict[str, object] = {"run_dir": tmp_path / "run"}
    values.update(fields)
    return MasterConfig(**values)  # type: ignore[arg-type]


def test_valid_master_config_creates_its_run_dir(tmp_path: Path) -> None:
    config = master_config(tmp_path, run_dir=tmp_path / "a" / "b" / "run", rendezvous=RendezvousConfig(1, 4, 0.0, 5.0))
    config.validate()
    assert config.run_dir.is_dir()


@pytest.mark.parametrize(("fields", "expected"), [
    ({"max_restarts": -1}, "--max-restarts -1"),
    ({"port": 70000}, "--port 70000"),
    ({"port": -1}, "--port -1"),
    ({"heartbeat_s": 0.0}, "heartbeat"),
    ({"heartbeat_s": 5.0, "heartbeat_timeout_s": 5.0}, "heartbeat"),
    ({"rendezvous": RendezvousConfig(3, 1)}, "nnodes 3:1"),
    ({"rendezvous": RendezvousConfig(0, 1)}, "nnodes 0:1"),
    ({"rendezvous": RendezvousConfig(1, 1, wait_s=-1.0)}, "--rdzv-wait"),
    ({"rendezvous": RendezvousConfig(1, 1, join_timeout_s=0.0)}, "--join-timeout"),
    ({"max_regroups": 0}, "--max-regroups 0"),
    ({"regroup_window_s": 0.0}, "--regroup-window 0.0"),
    ({"regroup_window_s": float("nan")}, "--regroup-window nan"),
])
def test_master_config_errors_name_the_field(tmp_path: Path, fields: dict[str, object], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        master_config(tmp_path, **fields).validate()


def test_run_dir_that_is_a_file_is_rejected(tmp_path: Path) -> None:
    existing = tmp_path / "file"
    existing.write_text("")
    for run_dir in (existing, existing / "below"):
        with pytest.raises(ConfigError) as info:
            check_run_dir(run_dir)
        assert repr(str(run_dir)) in str(info.value) and "run dir" in str(info.value)


def test_run_dir_of_an_earlier_job_is_not_reused(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "state.db").write_bytes(b"")
    with pytest.raises(ConfigError, match="already holds a job's state"):
        master_config(tmp_path, run_dir=run_dir).validate()


def test_job_config_validates_workers_and_master(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--nproc-per-node"):
        JobConfig(master=master_config(tmp_path), workers=worker_config(tmp_path, nproc_per_node=0)).validate()
    with pytest.raises(ConfigError, match="--max-restarts"):
        JobConfig(master=master_config(tmp_path, max_restarts=-3), workers=worker_config(tmp_path)).validate()
    job = JobConfig(master=master_config(tmp_path, rendezvous=RendezvousConfig(1, 3)), workers=worker_config(tmp_path))
    job.validate()
    assert job.num_agents == 3


def test_default_run_dirs_are_fresh() -> None:
    first, second = default_run_dir(), default_run_dir()
    assert first.parent == Path("convoy-runs") and first != second


def test_default_preload_imports_torch_ahead() -> None:
    assert WorkerConfig().preload[0] == "torch"


def test_control_plane_does_not_import_torch() -> None:
    import subprocess

    code = ("import sys, convoy.cli.main, convoy.control.master, convoy.launch.run, convoy.agent.agent, "
            "convoy.agent.workers; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


def test_a_job_declares_no_roles_unless_asked() -> None:
    assert JobConfig().roles == (), "no roles: every worker is one of today's single default role"


def test_roles_with_their_own_scripts_need_no_job_script(tmp_path: Path) -> None:
    (tmp_path / "ps.py").write_text("")
    (tmp_path / "worker.py").write_text("")
    roles = (RoleSpec("ps", entrypoint=str(tmp_path / "ps.py")),
             RoleSpec("worker", entrypoint=str(tmp_path / "worker.py")))
    JobConfig(master=master_config(tmp_path), workers=WorkerConfig(), roles=roles).validate()


@pytest.mark.parametrize(("roles", "expected"), [
    ((RoleSpec("ps", entrypoint="/nonexistent/ps.py"),), "role 'ps': script '/nonexistent/ps.py' not found"),
    ((RoleSpec("ps", entrypoint="no_such_module_xyz", module=True),), "role 'ps': module 'no_such_module_xyz'"),
    ((RoleSpec("ps"), RoleSpec("ps")), "role 'ps' given twice"),
    ((RoleSpec("worker", count=RoleCount(0, 0)),), "role 'worker': count 0"),
    ((RoleSpec("worker", cpus=-1.0),), "role 'worker': cpus -1.0"),
])
def test_job_config_checks_its_roles(tmp_path: Path, roles: tuple[RoleSpec, ...], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        JobConfig(master=master_config(tmp_path), workers=worker_config(tmp_path), roles=roles).validate()


def test_a_role_without_a_script_needs_the_jobs(tmp_path: Path) -> None:
    (tmp_path / "ps.py").write_text("")
    roles = (RoleSpec("ps", entrypoint=str(tmp_path / "ps.py")), RoleSpec("worker"))
    with pytest.raises(ConfigError, match="no training script given"):
        JobConfig(master=master_config(tmp_path), workers=WorkerConfig(), roles=roles).validate()
    JobConfig(master=master_config(tmp_path), workers=worker_config(tmp_path), roles=roles).validate()


@pytest.mark.parametrize(("entrypoint", "module", "expected"), [
    ("", False, "no training script given"), ("/nonexistent/x.py", False, "script '/nonexistent/x.py' not found"),
    ("no_such_module_xyz", True, "module 'no_such_module_xyz' not found"),
])
def test_check_entrypoint_is_the_one_check_of_every_script(entrypoint: str, module: bool, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        check_entrypoint(entrypoint, module)
    check_entrypoint("json.tool", True)
