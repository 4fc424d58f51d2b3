"""``convoy.init()``: the process group and job context, from the environment the agent sets."""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from convoy.errors import ConfigError
from convoy.ports import free_port
from convoy.runtime.devices import choose_backend, nccl_environment
from convoy.worker.role_env import GROUP_ROUND_ENV

DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Context:
    """Who this worker is in the job; ``topology`` is ``[(node_rank, host, nproc), ...]``."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    topology: tuple[tuple[int, str, int], ...]
    round_id: int
    restart_count: int
    job_id: str
    run_dir: Path
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError as exc:
        raise ConfigError(f"environment variable {name}={value!r} is not a whole number") from exc


def init(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Context:
    """Set up the default process group and return the job context.

    On a node with GPUs each worker takes the device of its LOCAL_RANK and the group is
    ``cpu:gloo,cuda:nccl`` (NCCL for CUDA tensors, gloo for CPU ones), formed at once so that a
    broken NCCL set-up fails here; elsewhere it is gloo (``devices.py`` chooses). ``timeout_s`` bounds
    every collective: under NCCL one that outlives it (a dead peer) ends the process instead of hanging.
    Under ``convoy run`` or ``torchrun`` it uses RANK/WORLD_SIZE/MASTER_*; run as a plain
    ``python script.py`` it becomes a one-process job, so the same script works on a laptop.
    """
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port("127.0.0.1")))
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    cuda_devices = torch.cuda.device_count() if backend != "gloo" and torch.cuda.is_available() else 0
    choice = choose_backend(backend, cuda_devices, local_rank, os.environ.get("CUDA_VISIBLE_DEVICES"))
    device = torch.device(choice.device)
    if choice.device_index is not None:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        options: dict = {}
        if choice.uses_nccl:
            os.environ.update(nccl_environment(os.environ))  # read by ProcessGroupNCCL as it is made
            options["device_id"] = device
        dist.init_process_group(choice.backend, timeout=datetime.timedelta(seconds=timeout_s), **options)
    topology = tuple(tuple(entry) for entry in json.loads(os.environ.get("CONVOY_TOPOLOGY", "[]")))
    return Context(
        rank=rank, world_size=world_size, local_rank=local_rank,
        local_world_size=_env_int("LOCAL_WORLD_SIZE", 1), node_rank=_env_int("GROUP_RANK", 0),
        num_nodes=_env_int("GROUP_WORLD_SIZE", 1), topology=topology,  # type: ignore[arg-type]
        round_id=_env_int("CONVOY_ROUND", _env_int(GROUP_ROUND_ENV, 1)),
        restart_count=_env_int("TORCHELASTIC_RESTART_COUNT", 0),
        job_id=os.environ.get("CONVOY_JOB_ID", os.environ.get("TORCHELASTIC_RUN_ID", "local")),
        run_dir=Path(os.environ.get("CONVOY_RUN_DIR", ".")), backend=choice.backend, device=device,
    )
