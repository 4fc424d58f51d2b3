"""``convoy run --scheduler ray``: the same job, its nodes placed on a Ray cluster (``schedulers/ray.py``).

The launch is written to ``RUN_DIR/ray_launch.json`` (the command line, its directory, the master's address): a
driver that was killed leaves its agents training, and ``convoy run --resume RUN_DIR`` on the same machine starts
the master again from the run dir and takes the agents back before they give up on it (``master_timeout_s``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Sequence

from convoy.config import JobConfig
from convoy.control.token import TOKEN_FILE, read_token
from convoy.errors import ConfigError
from convoy.launch.run import prepare_job, run_job
from convoy.launch.schedulers.ray import RayScheduler, connect

LAUNCH_FILE = "ray_launch.json"


def run_ray_job(config: JobConfig, console: Callable[[str], None] = print, argv: Sequence[str] = (),
                resume: dict[str, Any] | None = None) -> int:
    """Run the job with one agent per Ray node; 0 on success, 1 on failure, 128+N on signal N. A lost agent is
    placed again wherever a node has room (the job's MIN:MAX and --join-timeout bound how long it waits).
    ``argv``: the command line, kept for ``--resume``; ``resume``: what ``read_launch`` found."""
    config.validate(resume=resume is not None)
    ray = connect(config.ray.address)
    run_dir = config.master.run_dir
    try:
        if resume is not None:
            config.master.job_id, port, master_host = resume["job_id"], resume["port"], resume["master_host"]
            config.workers.role_groups = any(role.group for role in config.roles)
            token = read_token(run_dir / TOKEN_FILE)
        else:
            master_host = ray.util.get_node_ip_address()  # the driver's node: where the agents reach the master
            port, _, token = prepare_job(config, master_host)
            _write_launch(run_dir, {"argv": list(argv), "cwd": os.getcwd(), "job_id": config.master.job_id,
                                    "port": port, "master_host": master_host})
        scheduler = RayScheduler(ray, config, token, run_dir / TOKEN_FILE, port, master_host, resume is not None)
        return run_job(scheduler, token, True, console)
    finally:
        ray.shutdown()


def read_launch(run_dir: Path) -> dict[str, Any]:
    """What a driver of ``run_dir`` wrote at its start; a clear error where it is not a job that Ray placed."""
    path = run_dir / LAUNCH_FILE
    try:
        launch = json.loads(path.read_text())
        for key, kind in (("argv", list), ("cwd", str), ("job_id", str), ("port", int), ("master_host", str)):
            if not isinstance(launch.get(key), kind):
                raise ValueError(f"no {key}")
    except FileNotFoundError:
        raise ConfigError(f"--resume {str(run_dir)!r}: no {LAUNCH_FILE} there; --resume takes back a job started "
                          "with --scheduler ray whose driver was killed") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--resume {str(run_dir)!r}: {LAUNCH_FILE} cannot be read ({exc})") from None
    return launch


def _write_launch(run_dir: Path, launch: dict[str, Any]) -> None:
    temporary = run_dir / f".{LAUNCH_FILE}.tmp"
    temporary.write_text(json.dumps(launch))
    os.replace(temporary, run_dir / LAUNCH_FILE)
