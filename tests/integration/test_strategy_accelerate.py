"""convoy.accelerate applying each strategy kind on 2 real gloo ranks (tests/fixtures/strategy_accelerate.py:
DDP, ZeRO's sharded optimizer, FSDP2 shards, checkpointing, micro-batches, pipelines with each schedule, also two
of them on 4 ranks; sequences cut over 2 ranks, and on 4 ranks over two pairs and all four; each equal to one
process; local SGD equal to averaged replicas; a rank of a sequence cut killed mid-step), and convoy plan end to
end: the table, the strategy file a job then runs with, convoy run --strategy auto planning first, a limit nothing
fits (a file from another model is refused in tests/unit/test_strategy_search.py)."""

from __future__ import annotations

import json
import re
import signal
import sys
from pathlib import Path

import pytest
from helpers import FIXTURES, REPO, ProcessScope

pytestmark = pytest.mark.slow
EXAMPLE = str(REPO / "examples" / "train_strategy.py")
TINY = ["--width", "32", "--layers", "2", "--heads", "2", "--vocab", "256", "--context", "16", "--batch", "4"]


def test_every_strategy_kind_wraps_for_real_and_trains_like_one_process(procs: ProcessScope) -> None:
    outputs = procs.gloo_ranks(str(FIXTURES / "strategy_accelerate.py"), 2, [])
    for rank, output in enumerate(outputs):
        for name in ("ddp mb8x1", "zero mb4x2", "fsdp mb8x1", "fsdp ckpt mb4x2", "ddp ckpt mb4x2"):
            assert f"rank {rank}: {name} t1 ok" in output, output
        for nodes in (2, 1):
            assert f"rank {rank}: local H3 mb8x1 t1 on {nodes} node(s) ok" in output, output
        for name in ("p2/1f1b mb8x1", "p2/interleaved mb4x2", "p2/gpipe mb2x4", "p2/1f1b bf16 mb4x2"):
            assert f"rank {rank}: pipeline {name} t1 ok" in output, output
        for name in ("s2 mb8x1", "s2 mb2x4", "s2 bf16 mb8x1"):
            assert f"rank {rank}: sequence {name} t1 ok" in output, output
        assert f"rank {rank}: ok (24 checks)" in output, output
    assert procs.wait_no_leftovers() == []


def test_two_pipelines_or_sequence_groups_of_two_ranks_and_one_of_four_train_like_one_process(
        procs: ProcessScope) -> None:
    outputs = procs.gloo_ranks(str(FIXTURES / "strategy_accelerate.py"), 4, [], env={"CHECK": "groups"})
    for rank, output in enumerate(outputs):
        assert f"rank {rank}: pipeline p2/interleaved mb4x2 t1 ok" in output, output
        assert f"rank {rank}: sequence s4 mb4x2 t1 ok" in output, output
        assert f"rank {rank}: ok (10 checks)" in output, output
    assert procs.wait_no_leftovers() == []


def test_a_rank_killed_inside_a_sequence_cut_fails_its_peer_at_once_not_at_the_timeout(procs: ProcessScope) -> None:
    from convoy.ports import unclaimed_port

    port = str(unclaimed_port())
    ranks = [procs.start([], command=[sys.executable, str(FIXTURES / "strategy_accelerate.py")], env={
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1", "CHECK": "kill"}) for rank in (0, 1)]
    killed, peer = ranks[1].wait(120), ranks[0].wait(60)
    assert killed.returncode == -signal.SIGKILL and "rank 1: first step ok" in killed.stdout, killed.explain()
    assert peer.returncode == 3, peer.explain()  # its step raised: no hang, no step taken as done
    failed = re.search(r"rank 0: second step failed after ([\d.]+) s", peer.stdout)
    assert failed and float(failed.group(1)) < 30, peer.explain()
    assert procs.wait_no_leftovers() == []


def test_plan_writes_the_strategy_and_the_script_runs_with_it(procs: ProcessScope, tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    result = procs.start(["plan", "--nodes", 1, "--nproc-per-node", 2, "--memory", "1GB", "--keep", 2,
                          "--first-steps", 1, "--out", out, EXAMPLE, *TINY]).wait()
    assert result.returncode == 0, result.explain()
    assert re.search(r"^candidate +pred MB +pred s +search s +meas MB", result.stdout, re.MULTILINE), result.stdout
    assert "PICK" in result.stdout and "dropped: " in result.stdout, result.stdout
    assert re.search(r"FSDP's gathers and reduce-scatters timed on the model's \d+ units: [\d.]+ s a micro-step",
                     result.stdout), result.stdout
    planned = json.loads(out.read_text())
    assert planned["world_size"] == 2 and "Transformer of" in planned["model_summary"], planned
    job = procs.start(["run", "--nproc-per-node", 2, "--run-dir", tmp_path / "run", EXAMPLE, *TINY,
                       "--steps", 2, "--strategy", out]).wait()
    assert job.returncode == 0, job.explain()
    assert "strategy: " in job.stdout and "step 1 loss" in job.stdout, job.stdout
    assert procs.wait_no_leftovers() == []


def test_run_with_strategy_auto_plans_first_and_the_workers_train_with_the_pick(procs: ProcessScope,
                                                                               tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job = procs.start(["run", "--nproc-per-node", 2, "--run-dir", run_dir, "--strategy", "auto", "--strategy-memory",
                       "1GB", EXAMPLE, *TINY, "--steps", 2]).wait()
    assert job.returncode == 0, job.explain()
    picked = re.search(r"^picked (.+) \(search [\d.]+ s\); wrote (.+)$", job.stdout, re.MULTILINE)
    assert picked and Path(picked.group(2)) == run_dir / "convoy-strategy.json", job.stdout
    assert f"strategy: {picked.group(1)}" in job.stdout and "step 1 loss" in job.stdout, job.stdout
    assert json.loads((run_dir / "convoy-strategy.json").read_text())["world_size"] == 2
    assert procs.wait_no_leftovers() == []


def test_a_script_the_search_cannot_build_is_one_line_and_the_job_never_starts(procs: ProcessScope,
                                                                               tmp_path: Path) -> None:
    script = tmp_path / "plain.py"
    script.write_text("print('training')\n")  # no workload(): the dry-run ranks refuse it
    job = procs.start(["run", "--nproc-per-node", 2, "--run-dir", tmp_path / "run", "--strategy", "auto",
                       script]).wait()
    assert job.returncode == 2, job.explain()
    assert job.stderr.count("\n") == 1 and "has no workload() function; define one" in job.stderr, job.stderr
    assert "training" not in job.stdout and not (tmp_path / "run" / "convoy-strategy.json").exists()
    assert procs.wait_no_leftovers() == []


def test_plan_with_a_limit_nothing_fits_names_the_smallest_need(procs: ProcessScope, tmp_path: Path) -> None:
    result = procs.start(["plan", "--nproc-per-node", 2, "--memory", "100KB", "--out", tmp_path / "s.json",
                          EXAMPLE, *TINY]).wait()
    assert result.returncode == 2, result.explain()
    assert re.search(r"no candidate fits 0.10 MB per rank: the smallest need is [\d.]+ MB \((fsdp|pipeline) ",
                     result.stderr), result.stderr
    assert not (tmp_path / "s.json").exists()


def test_plan_refuses_its_own_flags_after_the_script_saying_where_they_go(procs: ProcessScope, tmp_path: Path) -> None:
    """The form ``convoy plan SCRIPT --nodes 2 ...`` once planned 1 node x 2 ranks with 2000 MB without a word:
    the flags went to the script, which dropped them."""
    out = tmp_path / "s.json"
    result = procs.start(["plan", "--out", out, EXAMPLE, "--nodes", 2, "--nproc-per-node", 2, "--memory", "1.5GB",
                          *TINY]).wait()
    assert result.returncode == 2, result.explain()
    line = ("convoy plan: --nodes 2 --nproc-per-node 2 --memory 1.5GB came after the script, where it goes to "
            f"{EXAMPLE}, not to convoy plan; put convoy plan's flags before the script")
    assert line in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert "planning" not in result.stdout and not out.exists()
