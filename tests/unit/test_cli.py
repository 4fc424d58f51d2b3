"""The command line: what reaches the script, what reaches the config, and the error path."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from convoy.cli import options as cli_options
from convoy.cli.main import build_parser, main
from convoy.config import JobConfig
from convoy.errors import ConfigError
from convoy.roles_config import RoleCount, RoleSpec


def test_everything_after_the_script_belongs_to_the_script() -> None:
    args = build_parser().parse_args(
        ["run", "--nnodes", "1:3", "--nproc-per-node", "4", "--preload", "", "train.py", "--nnodes", "9", "-m", "x"])
    workers = cli_options.worker_config(args)
    assert (workers.entrypoint, workers.args, workers.module) == ("train.py", ["--nnodes", "9", "-m", "x"], False)
    assert workers.nproc_per_node == 4 and workers.preload == ()
    master = cli_options.master_config(args)
    assert (master.rendezvous.min_nodes, master.rendezvous.max_nodes) == (1, 3)


def test_module_mode_and_preload_list() -> None:
    args = build_parser().parse_args(["run", "--preload", "torch,numpy", "-m", "pkg.train", "--lr", "0.1"])
    workers = cli_options.worker_config(args)
    assert (workers.entrypoint, workers.module, workers.args) == ("pkg.train", True, ["--lr", "0.1"])
    assert workers.preload == ("torch", "numpy")


def test_run_and_master_listen_on_loopback_unless_host_is_given() -> None:
    parser = build_parser()
    assert parser.parse_args(["run", "s.py"]).host == "127.0.0.1"
    assert parser.parse_args(["master"]).host == "127.0.0.1"
    assert parser.parse_args(["master", "--host", "0.0.0.0"]).host == "0.0.0.0"


def test_config_errors_become_one_line_and_exit_code_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["run", "--nnodes", "3:1", "--run-dir", str(tmp_path / "r"), str(tmp_path / "missing.py")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("convoy: error: ")


def test_status_of_a_dir_without_a_job(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["status", "--run-dir", str(tmp_path)]) == 2
    assert "no convoy job state in" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["run", "master"])
def test_regroup_budget_flags_reach_the_master_config(command: str) -> None:
    args = build_parser().parse_args([command, "--max-regroups", "3", "--regroup-window", "45"])
    master = cli_options.master_config(args)
    assert (master.max_regroups, master.regroup_window_s) == (3, 45.0)


def test_a_bad_regroup_budget_is_one_error_line_naming_the_flag(capsys: pytest.CaptureFixture[str],
                                                                tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("")
    assert main(["run", "--max-regroups", "0", "--run-dir", str(tmp_path / "r"), str(script)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("convoy: error: --max-regroups 0")


def job_file(tmp_path: Path, text: str) -> Path:
    (tmp_path / "train.py").write_text("")
    (tmp_path / "other.py").write_text("")
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def job_config(argv: list[str]) -> tuple[JobConfig, argparse.Namespace]:
    return cli_options.job_config(build_parser("run").parse_args(argv), argv[1:])


JOB = """\
entrypoint = "train.py"
args = ["--lr", "0.1"]
nnodes = "1:2"
nproc_per_node = 2
max_restarts = 3
relaunch = true

[roles.worker]
count = 2
memory = "1GiB"
"""


def test_a_job_file_gives_the_options_and_roles(tmp_path: Path) -> None:
    config, args = job_config(["run", str(job_file(tmp_path, JOB))])
    assert (config.workers.entrypoint, config.workers.args) == (str(tmp_path / "train.py"), ["--lr", "0.1"])
    assert (config.master.rendezvous.min_nodes, config.master.rendezvous.max_nodes) == (1, 2)
    assert (config.workers.nproc_per_node, config.master.max_restarts, args.relaunch) == (2, 3, True)
    assert config.roles == (RoleSpec("worker", count=RoleCount(2, 2), memory_bytes=1 << 30),)


def test_flags_before_and_after_the_job_file_override_it(tmp_path: Path) -> None:
    path = str(job_file(tmp_path, JOB))
    config, _ = job_config(["run", "--nnodes", "1", "--max-restarts", "9", path, "--nproc-per-node", "4",
                            "--max-restarts", "7", "--workers", "auto", "--role", "ps=2"])
    assert (config.master.rendezvous.min_nodes, config.master.rendezvous.max_nodes) == (1, 1), "--nnodes 1 is given"
    assert (config.workers.nproc_per_node, config.master.max_restarts) == (4, 7), "the later flag wins"
    assert config.workers.entrypoint == str(tmp_path / "train.py")
    assert [(role.name, str(role.count), role.memory_bytes) for role in config.roles] == [
        ("worker", "auto", 1 << 30), ("ps", "2", None)], "a flag changes a declared role's count only"


def test_a_script_after_the_job_file_replaces_its_entrypoint_and_args(tmp_path: Path) -> None:
    path = str(job_file(tmp_path, JOB))
    config, _ = job_config(["run", path, "--stop-grace", "1", str(tmp_path / "other.py"), "--epochs", "2"])
    assert (config.workers.entrypoint, config.workers.args) == (str(tmp_path / "other.py"), ["--epochs", "2"])
    assert config.workers.stop_grace_s == 1.0


def test_role_flags_without_a_job_file() -> None:
    config, _ = job_config(["run", "--ps", "2", "--workers", "auto", "--role", "evaluator=1", "train.py"])
    assert [(role.name, str(role.count), role.failure_policy) for role in config.roles] == [
        ("ps", "2", "restore-one"), ("worker", "auto", "restart-one"), ("evaluator", "1", "restart-job")]


def test_a_job_without_roles_is_as_before() -> None:
    config, args = job_config(["run", "--nnodes", "2", "--nproc-per-node", "2", "--run-dir", "r", "train.py", "--x"])
    assert config.roles == ()
    assert config == JobConfig(master=cli_options.master_config(args), workers=cli_options.worker_config(args))


@pytest.mark.parametrize(("argv", "expected"), [
    (["run", "--ps", "0", "s.py"], "--ps '0': count 0: need at least 1"),
    (["run", "--workers", "4:2", "s.py"], "--workers '4:2': count 4:2: MIN 4 > MAX 2"),
    (["run", "--role", "actor", "s.py"], "--role 'actor' is not NAME=COUNT"),
    (["run", "--workers", "2", "--role", "worker=3", "s.py"], "role 'worker' given twice: by --workers 2 and by "
                                                              "--role worker=3"),
    (["run", "--workers", "4"], "--workers 4: no worker role possible"),
])
def test_bad_role_flags_name_the_flag(argv: list[str], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        job_config(argv)


def test_a_bad_job_file_is_one_line_naming_file_line_and_key(capsys: pytest.CaptureFixture[str],
                                                            tmp_path: Path) -> None:
    path = job_file(tmp_path, 'entrypoint = "train.py"\n\n[roles.worker]\nmem = "1GiB"\n')
    assert main(["run", "--run-dir", str(tmp_path / "r"), str(path)]) == 2
    err = capsys.readouterr().err
    assert err == f"convoy: error: {path}:4: unknown key 'mem' in [roles.worker]: did you mean 'memory'? " \
                  "a role takes entrypoint, args, module, count, memory, cpus, gpus, failure_policy, service, after, " \
                  "group, max_replacements, replacement_window_s\n"
    assert not (tmp_path / "r").exists(), "nothing started, not even the run dir"


def test_the_run_help_tells_how_to_give_a_job_file(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    assert "JOB.toml" in out and "[roles.NAME]" in out and "--workers" in out and "--role" in out


@pytest.mark.parametrize("flags, expected", [
    (["--nnodes", "1:2", "--strategy", "auto"], "--strategy auto cannot plan this job: --nnodes 1:2 is elastic"),
    (["--strategy", "auto", "--endpoint", "127.0.0.1:29400"], "several hosts (--endpoint): plan once with convoy plan"),
    (["--strategy", "auto", "--strategy-memory", "lots"], "--strategy-memory 'lots' is not a size"),
    (["--strategy", "{tmp}/none.json"], "cannot read strategy file {tmp}/none.json"),
    (["--nproc-per-node", "2", "--strategy", "{tmp}/four.json"], "was planned for 4 ranks; this job has 2"),
])
def test_bad_strategy_flags_are_one_line_and_nothing_is_planned(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                                flags: list[str], expected: str) -> None:
    from convoy.strategy.plan import Strategy, StrategyFile

    script = tmp_path / "s.py"
    script.write_text("")
    StrategyFile(Strategy(micro_batch=8), "f", "Net of 1.00 M parameters", 4, 8).save(tmp_path / "four.json")
    flags = [flag.format(tmp=tmp_path) for flag in flags]
    assert main(["run", "--run-dir", str(tmp_path / "r"), *flags, str(script)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected.format(tmp=tmp_path) in err, err
    assert not (tmp_path / "r" / "convoy-strategy.json").exists()
