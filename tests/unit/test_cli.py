"""The command line: what reaches the script, what reaches the config, and the error path."""

from __future__ import annotations

from pathlib import Path

import pytest

from convoy.cli import _master_config, _worker_config, build_parser, main


def test_everything_after_the_script_belongs_to_the_script() -> None:
    args = build_parser().parse_args(
        ["run", "--nnodes", "1:3", "--nproc-per-node", "4", "--preload", "", "train.py", "--nnodes", "9", "-m", "x"])
    workers = _worker_config(args)
    assert (workers.entrypoint, workers.args, workers.module) == ("train.py", ["--nnodes", "9", "-m", "x"], False)
    assert workers.nproc_per_node == 4 and workers.preload == ()
    master = _master_config(args)
    assert (master.rendezvous.min_nodes, master.rendezvous.max_nodes) == (1, 3)


def test_module_mode_and_preload_list() -> None:
    args = build_parser().parse_args(["run", "--preload", "torch,numpy", "-m", "pkg.train", "--lr", "0.1"])
    workers = _worker_config(args)
    assert (workers.entrypoint, workers.module, workers.args) == ("pkg.train", True, ["--lr", "0.1"])
    assert workers.preload == ("torch", "numpy")


def test_run_defaults_listen_on_loopback_and_master_on_all_interfaces() -> None:
    parser = build_parser()
    assert parser.parse_args(["run", "s.py"]).host == "127.0.0.1"
    assert parser.parse_args(["master"]).host == "0.0.0.0"


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
    master = _master_config(args)
    assert (master.max_regroups, master.regroup_window_s) == (3, 45.0)


def test_a_bad_regroup_budget_is_one_error_line_naming_the_flag(capsys: pytest.CaptureFixture[str],
                                                                tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("")
    assert main(["run", "--max-regroups", "0", "--run-dir", str(tmp_path / "r"), str(script)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("convoy: error: --max-regroups 0")
