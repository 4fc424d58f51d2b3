"""``convoy run --scheduler ray``: the same job, its nodes placed on a Ray cluster (``schedulers/ray.py``)."""

from __future__ import annotations

from typing import Callable

from convoy.config import JobConfig
from convoy.launch.run import prepare_job, run_job
from convoy.launch.schedulers.ray import RayScheduler, connect


def run_ray_job(config: JobConfig, console: Callable[[str], None] = print) -> int:
    """Run the job with one agent per Ray node; 0 on success, 1 on failure, 128+N on signal N. A lost agent is
    placed again wherever a node has room (the job's MIN:MAX and --join-timeout bound how long it waits)."""
    config.validate()
    ray = connect(config.ray.address)
    try:
        master_host = ray.util.get_node_ip_address()  # the driver's node: where the agents reach the master
        port, token_file, token = prepare_job(config, master_host)
        return run_job(RayScheduler(ray, config, token, token_file, port, master_host), token, True, console)
    finally:
        ray.shutdown()
