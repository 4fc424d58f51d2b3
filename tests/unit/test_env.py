"""The worker environment: torchrun's full variable set plus the documented CONVOY_* ones."""

from __future__ import annotations

import json

from convoy.agent.env import interface_of, spawn_env, worker_env
from convoy.agent.round_store import hosted_by_rank0
from convoy.control.protocol.messages import MemberInfo, RoundInfo

# what torchrun (torch/distributed/elastic/agent/server/local_elastic_agent.py) gives every worker
TORCHRUN_VARS = {
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
}


def two_node_round(restart_count: int = 2) -> RoundInfo:
    members = [
        MemberInfo(node_rank=0, node_id="hostA-1", host="10.0.0.1", nproc=2, rank_offset=0),
        MemberInfo(node_rank=1, node_id="hostB-7", host="10.0.0.2", nproc=2, rank_offset=2),
    ]
    return RoundInfo(job_id="abc123", round_id=3, members=members, world_size=4, master_addr="10.0.0.1",
                     master_port=29517, restart_count=restart_count, max_restarts=5)


def test_worker_env_of_the_last_rank() -> None:
    info = two_node_round()
    env = worker_env(info, info.members[1], 1, "/runs/r", "10.0.0.9:4000", "/runs/r/logs/round3/rank3.log")
    assert TORCHRUN_VARS <= set(env)
    expected = {
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2", "ROLE_NAME": "default", "ROLE_RANK": "3", "ROLE_WORLD_SIZE": "4",
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29517", "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "5", "TORCHELASTIC_RUN_ID": "abc123",
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # rank 0's process serves the round's store before its script
        "CONVOY_JOB_ID": "abc123", "CONVOY_ROUND": "3", "CONVOY_RESTART_COUNT": "2", "CONVOY_RUN_DIR": "/runs/r",
        "CONVOY_NODE_ID": "hostB-7", "CONVOY_NODE_RANK": "1", "CONVOY_NUM_NODES": "2",
        "CONVOY_MASTER": "10.0.0.9:4000", "CONVOY_LOG_FILE": "/runs/r/logs/round3/rank3.log",
    }
    assert {k: env[k] for k in expected} == expected
    assert json.loads(env["CONVOY_TOPOLOGY"]) == [[0, "10.0.0.1", 2], [1, "10.0.0.2", 2]]
    assert all(isinstance(v, str) for v in env.values()), "an environment holds only strings"


def test_every_worker_of_a_round_gets_a_distinct_rank_and_the_same_rendezvous() -> None:
    info = two_node_round()
    envs = [worker_env(info, m, lr, "/r", "m:1", f"/r/{m.node_rank}{lr}.log")
            for m in info.members for lr in range(m.nproc)]
    assert sorted(int(e["RANK"]) for e in envs) == [0, 1, 2, 3]
    assert [(e["GROUP_RANK"], e["LOCAL_RANK"]) for e in envs] == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"], e["WORLD_SIZE"]) for e in envs} == {("10.0.0.1", "29517", "4")}


def test_uneven_nodes_get_their_own_local_world_size() -> None:
    members = [MemberInfo(node_rank=0, node_id="a", host="h0", nproc=3, rank_offset=0),
               MemberInfo(node_rank=1, node_id="b", host="h1", nproc=1, rank_offset=3)]
    info = RoundInfo(job_id="j", round_id=1, members=members, world_size=4, master_addr="h0", master_port=1,
                     restart_count=0, max_restarts=0)
    env = worker_env(info, members[1], 0, "/r", "m:1", "/r/x.log")
    assert (env["RANK"], env["LOCAL_WORLD_SIZE"], env["WORLD_SIZE"]) == ("3", "1", "4")


def test_spawn_env_keeps_the_agents_environment_and_sets_torchrun_defaults() -> None:
    base = {"PATH": "/usr/bin", "MY_SETTING": "x"}
    env = spawn_env(4, base)
    assert env["PATH"] == "/usr/bin" and env["MY_SETTING"] == "x"
    assert env["LOCAL_WORLD_SIZE"] == "4"
    assert env["OMP_NUM_THREADS"] == "1", "torchrun's default with several workers per node"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert base == {"PATH": "/usr/bin", "MY_SETTING": "x"}, "the caller's dict is not modified"


def test_spawn_env_respects_the_users_thread_count_and_single_workers() -> None:
    assert spawn_env(4, {"OMP_NUM_THREADS": "8"})["OMP_NUM_THREADS"] == "8"
    assert "OMP_NUM_THREADS" not in spawn_env(1, {})


def test_gloo_is_pointed_at_the_interface_other_nodes_reach() -> None:
    assert interface_of("127.0.0.1") == "lo"
    assert spawn_env(1, {}, host="127.0.0.1")["GLOO_SOCKET_IFNAME"] == "lo"
    assert spawn_env(1, {"GLOO_SOCKET_IFNAME": "eth9"}, host="127.0.0.1")["GLOO_SOCKET_IFNAME"] == "eth9"
    assert "GLOO_SOCKET_IFNAME" not in spawn_env(1, {}, host="192.0.2.77")  # no interface holds it
    assert "GLOO_SOCKET_IFNAME" not in spawn_env(1, {}, host="node-a.example")  # a name, not an address
    assert interface_of("not an address") is None


def test_the_round_store_is_rank_0s_where_its_process_has_torch_preloaded_and_the_user_did_not_opt_out() -> None:
    preload = ("torch", "torch._dynamo")
    assert hosted_by_rank0(False, preload, {})
    assert hosted_by_rank0(False, ("numpy", "torch.distributed"), {})
    assert not hosted_by_rank0(True, preload, {}), "--no-python: no Python process of convoy's runs before the script"
    assert not hosted_by_rank0(False, (), {}), "without torch preloaded, the store would delay the script's start"
    assert not hosted_by_rank0(False, ("torchvision",), {})
    assert not hosted_by_rank0(False, preload, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}), "torchrun's opt-out"
    info = two_node_round()
    env = worker_env(info, info.members[0], 0, "/r", "m:1", "/r/x.log", round_store=False)
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "False", "rank 0's init_process_group hosts the store"
