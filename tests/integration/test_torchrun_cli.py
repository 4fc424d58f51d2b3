"""torchrun's command lines, run under torchrun and under ``convoy run`` with the same flags: the workers get the
same variables (RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK, ROLE_*, MASTER_*, TORCHELASTIC_*) and the launchers
exit with the same code. Flags convoy cannot honour are one line naming them and why, exit 2, nothing started
(``tests/unit/test_torchrun_flags.py`` goes through every flag of torchrun's own parser)."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
from helpers import ProcessScope, fixture

from convoy.ports import unclaimed_port

pytestmark = pytest.mark.slow
TORCHRUN = [str(Path(sys.executable).parent / "torchrun")]
SCRIPT = fixture("env_dump.py")
LOOPBACK = {"localhost", "127.0.0.1"}


def case_argv(case: str, tmp: Path, port: int) -> tuple[list[str], list[str]]:
    """(launcher flags, the script and its arguments) of one table row; OUT is filled in per launcher."""
    script = [SCRIPT]
    flags = {
        "standalone": ["--standalone", "--nproc_per_node=2"],
        "rdzv": ["--nnodes=1", "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}",
                 "--rdzv-id=job42", "--max-restarts=2"],
        "static": ["--nnodes", "1", "--node_rank", "0", "--master_addr", "127.0.0.1", "--master_port", str(port),
                   "--nproc_per_node", "2", "--max_restarts", "1"],
        "streams": ["--standalone", "--nproc-per-node", "2", "--role", "trainer", "--monitor-interval", "1",
                    "--log-dir", str(tmp / "LAUNCHER-logs"), "-r", "3", "-t", "0:3", "--local-ranks-filter", "0",
                    "--run-path", "--max-restarts", "0"],
        "fails": ["--standalone", "--nproc-per-node", "2", "--max-restarts", "0"],
        "no-python": ["--standalone", "--nproc-per-node", "2", "--no-python", "--max-restarts", "0"],
        "module": ["--standalone", "--nproc-per-node", "2", "--max-restarts", "0", "-m"],
        # taken and meaning nothing more here: how workers start, where torch's own events go, what to copy out
        "launch": ["--standalone", "--nproc_per_node", "2", "--start-method", "fork", "--event_log_handler", "null",
                   "--duplicate-stdout-filters", "", "--shutdown_timeout", "5", "--signals-to-handle",
                   "SIGTERM,SIGINT,SIGUSR1", "--max-restarts", "0"],
        "local-addr": ["--standalone", "--nproc-per-node", "2", "--local_addr", "127.0.0.2", "--max-restarts", "0"],
    }[case]
    if case == "no-python":
        wrapper = tmp / "env_dump.sh"
        wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {SCRIPT} \"$@\"\n")
        wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
        script = [str(wrapper)]
    if case == "module":
        script = ["env_dump"]
    return flags, script


def run_under(procs: ProcessScope, launcher: str, case: str, tmp: Path) -> tuple[int, dict[int, dict], str]:
    out = tmp / launcher
    flags, script = case_argv(case, tmp, unclaimed_port())
    flags = [flag.replace("LAUNCHER", launcher) for flag in flags]
    exit_code = ["--exit", "3"] if case == "fails" else []
    env = {"PYTHONPATH": str(Path(SCRIPT).parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if launcher == "torchrun":
        result = procs.run([*flags, *script, "--out", out, *exit_code], command=TORCHRUN, env=env, timeout=120)
    else:
        result = procs.run(["run", "--run-dir", tmp / "run", *flags, *script, "--out", out, *exit_code], env=env,
                           timeout=120)
    ranks = {int(path.stem.removeprefix("rank")): json.loads(path.read_text()) for path in out.glob("rank*.json")}
    return result.returncode, ranks, result.output


@pytest.mark.parametrize("case", ["standalone", "rdzv", "static", "streams", "fails", "no-python", "module", "launch",
                                  "local-addr"])
def test_a_torchrun_command_line_means_the_same_under_convoy(procs: ProcessScope, tmp_path: Path, case: str) -> None:
    torch_code, torch_ranks, torch_output = run_under(procs, "torchrun", case, tmp_path)
    convoy_code, convoy_ranks, convoy_output = run_under(procs, "convoy", case, tmp_path)
    assert convoy_code == torch_code, f"torchrun exited {torch_code}, convoy {convoy_code}:\n{convoy_output}"
    assert sorted(convoy_ranks) == sorted(torch_ranks) == [0, 1], (torch_output, convoy_output)
    for rank, theirs in torch_ranks.items():
        ours = convoy_ranks[rank]
        for name, value in theirs.items():
            if name == "MASTER_PORT":
                assert ours[name].isdigit(), ours
            elif name == "MASTER_ADDR" and case != "local-addr":
                assert {ours[name], value} <= LOOPBACK, (ours[name], value)
            elif name == "TORCHELASTIC_RUN_ID" and case not in ("rdzv",):
                assert ours[name], "a run id is set"
            elif name == "TORCHELASTIC_USE_AGENT_STORE" and case == "no-python":
                assert (value, ours[name]) == ("True", "False"), "no Python process of convoy's serves the store"
            elif name == "TORCHELASTIC_MAX_RESTARTS" and case == "standalone":
                assert (value, ours[name]) == ("0", "3"), "without --max-restarts: torchrun's 0, convoy's 3"
            else:
                assert ours[name] == value, f"rank {rank} {name}: torchrun {value!r}, convoy {ours[name]!r}"
    if case == "streams":
        assert "rank 0 of 2" in convoy_output and "rank 1 of 2" not in convoy_output, convoy_output
        logs = list((tmp_path / "convoy-logs").rglob("rank1.log"))
        assert logs and "rank 1 of 2" in logs[0].read_text(), "the filtered rank's output is in its log file"


@pytest.mark.parametrize(("argv", "named"), [
    (["--rdzv-endpoint", "10.1.2.3:port", "--nnodes", "2"], "--rdzv-endpoint 10.1.2.3:port"),
    (["--nnodes", "2", "--node-rank", "5", "--master-addr", "10.1.2.3"], "--node-rank 5"),
    (["--rdzv-backend", "etcd"], "--rdzv-backend etcd"),
    (["--node-rank", "1", "--nnodes", "2"], "--node-rank 1"),
    (["-r", "1"], "--redirects 1"),
    (["--nproc-per-node", "gpu"], "--nproc-per-node gpu"),
    (["--standalone", "--nnodes", "2"], "--standalone"),
    (["--rdzv-conf", "foo=1"], "--rdzv-conf foo"),
    (["--no-such-flag"], "--no-such-flag"),
    (["--numa-binding", "node"], "--numa-binding node: convoy does not bind"),
    (["--logs_specs", "mine"], "--logs-specs mine: convoy loads no"),
    (["--virtual-local-rank"], "--virtual-local-rank: convoy gives each worker"),
    (["--duplicate-stdout-filters", "loss"], "--duplicate-stdout-filters loss: convoy captures"),
    (["--event-log-handler", "kafka"], "--event-log-handler kafka"),
    (["--start_method", "thread"], "--start-method thread"),
    (["--signals-to-handle", "SIGTERM,SIGFOO"], "--signals-to-handle SIGFOO"),
    (["--local-addr", "192.0.2.1"], "--local-addr 192.0.2.1: not an address of this host"),
])
def test_a_flag_convoy_cannot_honour_is_one_line_naming_it(procs: ProcessScope, tmp_path: Path, argv: list[str],
                                                           named: str) -> None:
    result = procs.run(["run", "--run-dir", tmp_path / "run", *argv, SCRIPT, "--out", tmp_path / "out"], timeout=60)
    assert result.returncode == 2, result.explain()
    assert result.stderr.count("\n") == 1 and named in result.stderr, result.explain()
    assert not (tmp_path / "run").exists() and not (tmp_path / "out").exists(), "nothing started"


def test_local_addr_on_several_hosts_is_where_the_others_reach_node_rank_0(procs: ProcessScope,
                                                                             tmp_path: Path) -> None:
    """The same torchrun line on two "hosts" (two launchers on loopback), each with its own --local-addr: every
    worker's MASTER_ADDR is the address node rank 0 gave, as under torchrun."""
    port = unclaimed_port()
    launchers = [procs.start(["run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job7", "--rdzv-conf", "token=abc",
                              "--node-rank", node_rank, "--local-addr", f"127.0.0.{node_rank + 2}", "--preload", "",
                              "--run-dir", tmp_path / f"run{node_rank}", SCRIPT, "--out", tmp_path / "out"])
                 for node_rank in (0, 1)]
    for launcher in launchers:
        result = launcher.wait(timeout=120)
        assert result.returncode == 0, result.explain()
    ranks = {path.stem: json.loads(path.read_text()) for path in (tmp_path / "out").glob("rank*.json")}
    assert {name: env["MASTER_ADDR"] for name, env in ranks.items()} == {"rank0": "127.0.0.2", "rank1": "127.0.0.2"}
    assert {env["GROUP_RANK"] for env in ranks.values()} == {"0", "1"}
