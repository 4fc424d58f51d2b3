"""Which Ray nodes get an agent, what an agent holds, and what is said when MIN nodes cannot be placed (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from convoy.cli.options import job_config
from convoy.errors import ConfigError
from convoy.launch.schedulers.ray_nodes import NodeShare, RayNode, fits, from_listing, missing, node_name, to_place
from convoy.ray_config import RayConfig, parse_resources
from convoy.roles_config import RoleCount, RoleSpec


def node(suffix: str, cpus: float = 1, alive: bool = True, **resources: float) -> RayNode:
    return RayNode(suffix * 28, "127.0.0.1", alive, {"CPU": cpus, "memory": 2.0**32, **resources})


def test_an_agent_goes_on_each_alive_node_with_room_up_to_max_one_per_node() -> None:
    share = NodeShare(cpus=1, resources={"convoy_node": 1})
    nodes = [node("a", convoy_node=1), node("b"), node("c", convoy_node=1), node("d", alive=False, convoy_node=1),
             node("e", cpus=0.5, convoy_node=1), node("f", convoy_node=2)]
    assert [n.node_id[0] for n in to_place(nodes, share, (), max_nodes=8)] == ["a", "c", "f"]
    assert [n.node_id[0] for n in to_place(nodes, share, (), max_nodes=2)] == ["a", "c"]
    holding = [node_name("a" * 28)]
    assert [n.node_id[0] for n in to_place(nodes, share, holding, max_nodes=2)] == ["c"]
    assert to_place(nodes, share, holding, max_nodes=1) == []
    assert [n.node_id[0] for n in to_place(nodes, share, holding, 3, skip=[node_name("c" * 28)])] == ["f"]


def test_what_is_missing_is_named_per_resource() -> None:
    nodes = [node("a"), node("b"), node("c", cpus=4)]
    gpus = missing(nodes, NodeShare(cpus=1, gpus=1), min_nodes=2)
    assert gpus.startswith("0 of the 2 node(s) MIN asks for can be placed on the Ray cluster (3 alive node(s))")
    assert "GPU 1 per node: no node has any" in gpus and "CPU" not in gpus
    cpus = missing(nodes, NodeShare(cpus=2), min_nodes=2)
    assert "CPU 2 per node: 1 node(s) have that much (the most on one: 4)" in cpus
    together = missing([node("a", x=1), node("b", y=1)], NodeShare(resources={"x": 1, "y": 1}), min_nodes=1)
    assert "x 1 per node" not in together and "only 0 node(s) have all of CPU 1, x 1, y 1" in together
    assert fits(node("a", GPU=2), NodeShare(gpus=2)) and not fits(node("a", alive=False), NodeShare())


def test_the_listing_of_ray_nodes_and_their_convoy_names() -> None:
    listed = from_listing([{"NodeID": "ab" * 14, "NodeManagerAddress": "10.0.0.2", "Alive": True,
                            "Resources": {"CPU": 2.0}}, {"NodeID": "cd" * 14, "Alive": False}])
    assert listed[0] == RayNode("ab" * 14, "10.0.0.2", True, {"CPU": 2.0}) and not listed[1].alive
    assert listed[0].name == "ray-" + "ab" * 6


def roles(*specs: tuple[str, float | None, int, int]) -> tuple[RoleSpec, ...]:
    return tuple(RoleSpec(name=name, count=RoleCount(minimum, minimum), cpus=cpus, gpus=gpus)
                 for name, cpus, gpus, minimum in specs)


def test_an_agents_share_is_the_jobs_own_unless_given() -> None:
    config = RayConfig()
    assert config.node_cpus(nproc_per_node=4, roles=(), min_nodes=2) == 4.0
    job = roles(("ps", 1.0, 0, 2), ("worker", 0.5, 1, 4), ("chief", None, 0, 1))
    assert config.node_cpus(1, job, min_nodes=2) == 2.0  # (2 + 2) over 2 nodes
    assert config.node_cpus(1, roles(("worker", None, 0, 3)), min_nodes=1) == 1.0
    assert config.node_gpus(job, min_nodes=2) == 2.0 and config.node_gpus((), 2) == 0.0
    given = RayConfig(cpus=3, gpus=1)
    assert given.node_cpus(1, job, 2) == 3 and given.node_gpus(job, 2) == 1


@pytest.mark.parametrize("config, words", [
    (RayConfig(address=""), "--address"),
    (RayConfig(placement_timeout_s=0), "--placement-timeout 0"),
    (RayConfig(cpus=-1), "--ray-cpus -1"),
    (RayConfig(gpus=float("nan")), "--ray-gpus nan"),
    (RayConfig(resources={"CPU": 1}), "not a custom resource name"),
    (RayConfig(resources={"bad name": 1}), "not a custom resource name"),
    (RayConfig(resources={"ok": 0}), "--ray-resource ok=0: need an amount > 0"),
])
def test_bad_ray_settings_are_named(config: RayConfig, words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("+", r"\+")):
        config.validate()


def test_resources_from_flags() -> None:
    assert parse_resources(["a=1", "b.c=0.5"]) == {"a": 1.0, "b.c": 0.5}
    for bad in ("a", "a=x"):
        with pytest.raises(ConfigError, match="give NAME=AMOUNT"):
            parse_resources([bad])


def test_a_job_file_chooses_ray_and_the_command_line_overrides_it(tmp_path: Path) -> None:
    from convoy.cli.main import build_parser

    (tmp_path / "train.py").write_text("")
    job = tmp_path / "job.toml"
    job.write_text('entrypoint = "train.py"\nscheduler = "ray"\naddress = "10.0.0.1:6379"\nray_cpus = 2\n'
                   'ray_resource = ["trainer_node=1"]\nplacement_timeout = 4\n')
    argv = ["run", "--ray-resource", "gpu_type=1", str(job), "--placement-timeout", "6"]
    config, _ = job_config(build_parser("run").parse_args(argv), argv[1:])
    assert config.scheduler == "ray" and config.ray.address == "10.0.0.1:6379" and config.ray.cpus == 2
    assert config.ray.resources == {"trainer_node": 1.0, "gpu_type": 1.0} and config.ray.placement_timeout_s == 6
    job.write_text('entrypoint = "train.py"\nscheduler = "slurm"\n')
    with pytest.raises(ConfigError, match="--scheduler 'slurm': choose one of local, ray"):
        job_config(build_parser("run").parse_args(["run", str(job)]), [str(job)])
