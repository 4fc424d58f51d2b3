"""The round's TCPStore is served by rank 0's process before its script runs (``convoy/agent/round_store.py``): a
rank that reaches the store while rank 0's script has not yet called ``init_process_group`` is served, whether
rank 0 was forked (the agent's listening socket handed over) or is a standby (it binds the port itself). Without
torch preloaded, or with torchrun's opt-out, the workers are told there is no agent store, and rank 0's
``init_process_group`` hosts it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ProcessScope, fixture

from convoy.ports import unclaimed_port

pytestmark = pytest.mark.slow
EARLY = fixture("early_store.py")


def test_a_rank_reaches_the_store_while_rank_0s_script_sleeps(procs: ProcessScope, run_dir: Path) -> None:
    result = procs.run(["run", "--nproc-per-node", "2", "--max-restarts", "0", "--run-dir", run_dir, EARLY],
                       timeout=120)
    assert result.returncode == 0, result.explain()
    assert re.search(r"rank 0: rank 1 wrote [\d.]+ while rank 0 slept", result.stdout), result.explain()
    assert sorted(re.findall(r"rank (\d): store True, allreduce 3", result.stdout)) == ["0", "1"], result.explain()
    assert procs.wait_no_leftovers() == []


def test_a_standby_rank_0_binds_the_port_and_serves_the_store_before_its_script(procs: ProcessScope,
                                                                               tmp_path: Path) -> None:
    """The path of a node whose fork server is gone: the agent orders a warm standby, which cannot be handed a
    socket."""
    common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(unclaimed_port()), "WORLD_SIZE": "2",
              "TORCHELASTIC_USE_AGENT_STORE": "True", "OMP_NUM_THREADS": "1"}
    ready_read, ready_write = os.pipe()
    with open(tmp_path / "rank0.out", "wb") as out:
        standby = subprocess.Popen([sys.executable, "-m", "convoy.agent.standby", "torch", str(ready_write)],
                                   stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                                   env=procs.env(), pass_fds=(ready_write,))
    os.close(ready_write)
    try:
        assert os.read(ready_read, 1) == b"R", "the standby preloaded torch"
        order = {"env": {**common, "RANK": "0", "CONVOY_STORE_BIND": "1"}, "argv": [EARLY], "entrypoint": EARLY,
                 "module": False}
        assert standby.stdin is not None
        standby.stdin.write(json.dumps(order).encode() + b"\n")
        standby.stdin.close()
        rank1 = procs.start([EARLY], command=[sys.executable], env={**common, "RANK": "1"})
        assert standby.wait(60) == 0, (tmp_path / "rank0.out").read_text()
        assert rank1.wait(60).returncode == 0
    finally:
        os.close(ready_read)
        standby.kill()
        standby.wait()
    output = (tmp_path / "rank0.out").read_text()
    assert re.search(r"rank 0: rank 1 wrote [\d.]+ while rank 0 slept", output), output
    assert "rank 0: store True, allreduce 3" in output, output


@pytest.mark.parametrize("how", ["opt-out", "no-torch-preloaded"])
def test_without_the_round_store_rank_0s_init_process_group_hosts_it(procs: ProcessScope, run_dir: Path,
                                                                     how: str) -> None:
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if how == "opt-out" else {}
    preload = ["--preload", "json"] if how == "no-torch-preloaded" else []
    result = procs.run(["run", "--nproc-per-node", "2", "--max-restarts", "0", "--run-dir", run_dir, *preload,
                        EARLY, "--plain"], env=env, timeout=120)
    assert result.returncode == 0, result.explain()
    assert sorted(re.findall(r"rank (\d): store False, allreduce 3", result.stdout)) == ["0", "1"], result.explain()
