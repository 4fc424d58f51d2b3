"""A job of several hosts from torchrun's command line: the same ``convoy run`` line on each host (two launchers on
loopback here). The first to claim the endpoint serves the master there, the others join it; the workers get the
variables torchrun gives for the same lines; a wrong or missing token is one line, exit 2, the job unharmed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import ProcessScope, fixture, one_error_line

from convoy.ports import unclaimed_port

pytestmark = pytest.mark.slow
TORCHRUN = [str(Path(sys.executable).parent / "torchrun")]
ENV_DUMP = fixture("env_dump.py")
EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py")


def _ranks(out: Path) -> dict[int, dict[str, str]]:
    return {int(path.stem.removeprefix("rank")): json.loads(path.read_text()) for path in out.glob("rank*.json")}


def test_static_two_host_lines_give_the_variables_torchrun_gives(procs: ProcessScope, tmp_path: Path) -> None:
    """``--nnodes 2 --node-rank K --master-addr A --master-port P`` on each host, under torchrun, then under convoy:
    the node ranks follow --node-rank (host 1 starts first, still rank 1), and each rank's variables agree."""
    seen: dict[str, dict[int, dict[str, str]]] = {}
    for launcher in ("torchrun", "convoy"):
        port, out = unclaimed_port(), tmp_path / launcher
        jobs = []
        for node_rank in (1, 0):
            line = ["--nnodes=2", "--nproc-per-node=2", f"--node-rank={node_rank}", "--master-addr=127.0.0.1",
                    f"--master-port={port}", "--max-restarts=1", ENV_DUMP, "--out", out]
            if launcher == "torchrun":
                jobs.append(procs.start(line, command=TORCHRUN))
            else:
                jobs.append(procs.start(["run", "--run-dir", tmp_path / "shared", *line]))
        results = [job.wait(timeout=120) for job in jobs]
        assert [r.returncode for r in results] == [0, 0], "\n".join(r.explain() for r in results)
        seen[launcher] = _ranks(out)
        if launcher == "convoy":
            claims = [r for r in results if "claimed 127.0.0.1" in r.stdout]
            assert len(claims) == 1, [r.stdout for r in results]
            assert any("joining the master at 127.0.0.1" in r.stdout for r in results)
    assert sorted(seen["convoy"]) == sorted(seen["torchrun"]) == [0, 1, 2, 3], seen
    for rank, theirs in seen["torchrun"].items():
        ours = seen["convoy"][rank]
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                     "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "TORCHELASTIC_MAX_RESTARTS"):
            assert ours[name] == theirs[name], (rank, name, ours, theirs)
        assert ours["MASTER_ADDR"] == "127.0.0.1" and ours["MASTER_PORT"].isdigit(), ours
    assert procs.wait_no_leftovers() == []


def test_joiners_need_the_job_token_and_a_hand_started_master_makes_all_joiners(procs: ProcessScope,
                                                                               tmp_path: Path) -> None:
    port = unclaimed_port()
    line = ["--nnodes", "2", "--nproc_per_node", "1", "--rdzv-backend", "c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]
    claimer = procs.start(["run", *line, "--rdzv-conf", "token=the-jobs-token,join_timeout=60", "--run-dir",
                           tmp_path / "a", EXAMPLE, "--steps", 6])
    claimer.wait_output(r"this host claimed 127\.0\.0\.1:\d+ and serves the master there")
    wrong = procs.run(["run", *line, "--rdzv-conf", "token=not-it", "--run-dir", tmp_path / "b", EXAMPLE], timeout=60)
    assert wrong.returncode == 2, wrong.explain()
    assert "rejected the token" in one_error_line(wrong), wrong.explain()
    missing = procs.run(["run", *line, "--rdzv-conf", "join_timeout=1", "--run-dir", tmp_path / "c", EXAMPLE],
                        timeout=60)
    assert missing.returncode == 2 and "no token came to" in one_error_line(missing), missing.explain()
    joiner = procs.start(["run", *line, "--rdzv-conf", "token=the-jobs-token", "--run-dir", tmp_path / "b", EXAMPLE,
                          "--steps", 6])
    results = [claimer.wait(timeout=120), joiner.wait(timeout=120)]
    assert [r.returncode for r in results] == [0, 0], "\n".join(r.explain() for r in results)
    assert "round 1: 2 nodes, world size 2" in results[0].stdout, "the refused joiners never took a place"
    assert "the job succeeded" in results[1].stdout

    # a master started by hand on the endpoint: every launcher joins it, with the token file it wrote
    port = unclaimed_port()
    master = procs.start(["master", "--host", "127.0.0.1", "--port", port, "--nnodes", 1, "--run-dir",
                          tmp_path / "m"])
    master.wait_output(r"master of job \w+ at")
    alone = procs.run(["run", "--nnodes", "1", "--endpoint", f"127.0.0.1:{port}", "--token-file",
                       tmp_path / "m" / "token", "--run-dir", tmp_path / "d", EXAMPLE, "--steps", 3], timeout=120)
    assert alone.returncode == 0 and "joining the master" in alone.stdout, alone.explain()
    assert master.wait(timeout=30).returncode == 0
    assert not list((tmp_path / "b" / "nodes").glob("token-*")), "the joiner's copy of the token is removed"
    assert procs.wait_no_leftovers() == []
