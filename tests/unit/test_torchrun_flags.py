"""torchrun's flags turned into convoy run's (pure): both spellings, values in either form, convoy's own options
and the script's arguments left as they are."""

from __future__ import annotations

import os

import pytest

from convoy.errors import ConfigError
from convoy.torchrun_flags import translate


@pytest.mark.parametrize(("given", "wanted"), [
    (["--standalone", "--nproc_per_node=2", "t.py", "--lr", "1"], ["--nproc-per-node", "2", "t.py", "--lr", "1"]),
    (["--nproc-per-node", "cpu", "t.py"], ["--nproc-per-node", str(os.cpu_count()), "t.py"]),
    (["--rdzv_backend=c10d", "--rdzv_endpoint=localhost:29411", "--rdzv_id=7", "t.py"],
     ["--port", "29411", "--job-id", "7", "t.py"]),
    (["--master_addr", "127.0.0.1", "--master_port", "29500", "--node_rank", "0", "t.py"],
     ["--master-port", "29500", "t.py"]),
    (["--role", "trainer", "--role", "ps=2", "-r", "3", "-t", "0:3", "--run-path", "--monitor-interval", "5", "t.py"],
     ["--role-name", "trainer", "--role", "ps=2", "--redirects", "3", "--tee", "0:3", "t.py"]),
    (["--rdzv-conf", "join_timeout=60,last_call_timeout=2,read_timeout=9", "t.py"],
     ["--join-timeout", "60", "--rdzv-wait", "2", "t.py"]),
    (["--set", "steps=1", "--run-dir", "r", "--auto-apply", "nan", "--preload", "", "t.py", "--set", "x"],
     ["--set", "steps=1", "--run-dir", "r", "--auto-apply", "nan", "--preload", "", "t.py", "--set", "x"]),
    (["-m", "pkg.train", "--standalone"], ["-m", "pkg.train", "--standalone"]),
    (["--no_python", "./run.sh", "-r", "1"], ["--no-python", "./run.sh", "-r", "1"]),
    # several hosts, the same command on each: convoy's --endpoint (the first to claim it serves the master)
    (["--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.5:29400", "--rdzv-id=7", "t.py"],
     ["--nnodes", "2", "--endpoint", "10.0.0.5:29400", "--job-id", "7", "t.py"]),
    (["--nnodes", "1:4", "--rdzv_endpoint", "node0", "--rdzv-conf", "token=abc,join_timeout=30", "t.py"],
     ["--nnodes", "1:4", "--endpoint", "node0:29400", "--join-token", "abc", "--join-timeout", "30", "t.py"]),
    (["--rdzv-endpoint", "10.0.0.5:29400", "--rdzv-conf", "token_file=/shared/tok", "t.py"],
     ["--endpoint", "10.0.0.5:29400", "--token-file", "/shared/tok", "t.py"]),
    (["--nnodes=2", "--node_rank=1", "--master_addr=10.0.0.5", "--master_port=1234", "t.py"],
     ["--nnodes", "2", "--node-rank", "1", "--endpoint", "10.0.0.5:1234", "t.py"]),
    (["--nnodes", "2", "--node-rank", "0", "--master-addr", "10.0.0.5", "t.py"],
     ["--nnodes", "2", "--node-rank", "0", "--endpoint", "10.0.0.5:29500", "t.py"]),
])
def test_torchrun_flags_become_convoys(given: list[str], wanted: list[str]) -> None:
    assert translate(given) == wanted


@pytest.mark.parametrize(("given", "named"), [
    (["--nnodes", "2", "--rdzv-endpoint", "10.0.0.5:port"], "--rdzv-endpoint 10.0.0.5:port"),
    (["--nnodes", "2", "--node-rank", "first", "--master-addr", "h"], "--node-rank first"),
    (["--rdzv-conf", "tokn=abc"], "--rdzv-conf tokn"),
    (["--nnodes", "2", "--standalone"], "--standalone runs one node"),
    (["--rdzv-backend", "etcd-v2"], "--rdzv-backend etcd-v2"),
    (["--tee", "2"], "--tee 2"),
    (["--nproc-per-node", "gpu"], "this host has no GPU"),
    (["--nproc-per-node", "many"], "--nproc-per-node 'many'"),
    (["--master-port", "0"], "--master-port 0"),
    (["--monitor-interval", "-1"], "--monitor-interval -1"),
    (["--rdzv-id"], "--rdzv-id needs a value"),
])
def test_a_flag_that_cannot_be_honoured_is_named(given: list[str], named: str) -> None:
    with pytest.raises(ConfigError) as refused:
        translate([*given, "t.py"] if given != ["--rdzv-id"] else given)
    assert named in str(refused.value)


def test_gpus_count_for_gpu_and_auto() -> None:
    assert translate(["--nproc-per-node", "gpu", "t.py"], gpus=8)[:2] == ["--nproc-per-node", "8"]
    assert translate(["--nproc-per-node", "auto", "t.py"], gpus=4)[:2] == ["--nproc-per-node", "4"]
