"""Group-wise local SGD on 4 real gloo ranks (2 model groups x 2 pipeline stages): the checks run
inside tests/fixtures/local_sgd_check.py (every=1 equals synchronous training; shard groups are
identical right after each sync; Nesterov equals torch's SGD on the averaged delta). The example
trains a character-level LM under ``convoy run``, survives a group's node dying and coming back
(the joining group copies its shards from a peer), and bad input exits with a clear error."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from helpers import FIXTURES, REPO, ProcessScope, wait_for

pytestmark = pytest.mark.slow
EXAMPLE = str(REPO / "examples" / "train_local_sgd.py")
SMALL = ["--width", 32, "--layers", 2, "--heads", 2, "--context", 32, "--batch", 8, "--micro", 2,
         "--corpus-bytes", 400000, "--eval-batches", 2]


def test_local_sgd_checks_on_four_ranks(procs: ProcessScope) -> None:
    outputs = procs.gloo_ranks(str(FIXTURES / "local_sgd_check.py"), 4, [])
    for rank, output in enumerate(outputs):
        assert f"rank {rank}: every=1 equals synchronous training" in output, output
        for name in ("average ok", "average staggered ok", "nesterov ok", "nesterov staggered ok"):
            assert f"rank {rank}: {name}" in output, output
        assert re.search(rf"^rank {rank}: ok \(\d+ checks\)", output, re.MULTILINE), output
    assert procs.wait_no_leftovers() == []


def test_example_trains_and_counts_bytes_between_groups(procs: ProcessScope, run_dir: Path) -> None:
    job = procs.start(["run", "--nnodes", 2, "--nproc-per-node", 2, "--run-dir", run_dir, EXAMPLE, *SMALL,
                       "--steps", 24, "--every", 4, "--log-every", 4])
    result = job.wait()
    assert result.returncode == 0, result.explain()
    out = result.stdout
    assert "2 groups x 2 shards, sync local (average, every 4)" in out, out
    assert len(re.findall(r"\[rank0\]: step \d+: shard 0 synced over 2 group\(s\)", out)) == 6, out
    assert "replicas identical after the last step: yes" in out, out
    losses = [float(v) for v in re.findall(r"\[rank1\]: step \d+ loss ([\d.]+)", out)]
    assert losses[-1] < losses[0] - 0.5, losses
    per_step = re.search(r"sent to other groups ([\d.]+) MB by rank 0", out)
    assert per_step and float(per_step.group(1)) > 0, out


def test_bad_layout_fails_with_a_clear_error(procs: ProcessScope, run_dir: Path) -> None:
    job = procs.start(["run", "--nnodes", 1, "--nproc-per-node", 2, "--max-restarts", 0, "--run-dir", run_dir,
                       EXAMPLE, *SMALL, "--shards", 3, "--steps", 2])
    result = job.wait()
    assert result.returncode != 0
    log = (run_dir / "logs" / "round1" / "rank0.log").read_text()
    assert "error: world size 2 is not n groups x 3 shards; run a multiple of 3 workers" in log, log
    assert procs.wait_no_leftovers() == []


def test_a_group_that_dies_is_left_out_and_one_that_joins_copies_its_shards(procs: ProcessScope,
                                                                             run_dir: Path) -> None:
    # the agents are started by hand (no launcher to report a dead one): the master finds a lost node by its
    # silence, here in 5 s
    master = procs.start(["master", "--host", "127.0.0.1", "--port", "0", "--nnodes", "1:2", "--rdzv-wait", 1,
                          "--heartbeat-timeout", 5, "--run-dir", run_dir])
    port = int(master.wait_output(r"at 127\.0\.0\.1:(\d+);", timeout=60).group(1))

    def agent(node: str):
        return procs.start(["agent", "--master", f"127.0.0.1:{port}", "--token-file", run_dir / "token",
                            "--node-id", node, "--nproc-per-node", 2, "--preload", "", "--stop-grace", 1, EXAMPLE,
                            *SMALL, "--steps", 200, "--every", 4, "--log-every", 4, "--step-time", 0.05])

    first, second = agent("a"), agent("b")
    master.wait_output(r"round 1: 2 nodes, world size 4")
    leader = wait_for(lambda: next((a for a in (first, second) if re.search(r"\[rank1\]: step 20 loss", a.stdout())),
                                   None), 120, "step 20 on group 0")
    other = second if leader is first else first
    other.proc.send_signal(signal.SIGKILL)  # the node of group 1 dies, its workers with it
    master.wait_output(r"round 2: 1 nodes, world size 2")  # noticed by the master or by the survivors' sync
    leader.wait_output(r"1 groups x 2 shards, sync local .*starting at step (\d+) \(round 2, "
                                r"in-memory snapshot of step \d+\)", timeout=60)
    leader.wait_output(r"\[rank0\]: step \d+: shard 0 synced over 1 group", timeout=60)  # syncs alone
    joiner = agent("c")  # a fresh node: nothing in its memory
    master.wait_output(r"node c joins: growing to 2 nodes")
    grown = leader.wait_output(r"2 groups x 2 shards, sync local .*starting at step (\d+) \(round 3, "
                               r"in-memory snapshot of step \d+ \(own\)\)", timeout=60)
    for process in (leader, joiner):
        result = process.wait()
        assert result.returncode == 0, result.explain()
    assert master.wait(timeout=60).returncode == 0
    out = leader.stdout()
    assert "sent by a peer holding it to ranks without it" in out, out
    before = [int(s) for s in re.findall(r"\[rank1\]: step (\d+) loss", out[:grown.start()])]
    assert int(grown.group(1)) > max(before), "a finished step was redone when the group joined"
    assert re.search(r"\[rank0\]: step 199: shard 0 synced over 2 group\(s\)", out), out
    assert "replicas identical after the last step: yes" in out, out
    assert procs.wait_no_leftovers() == []
