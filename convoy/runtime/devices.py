"""Which process-group backend and device a worker uses, and the NCCL settings convoy starts it with.

Pure: ``init.py`` feeds it what torch sees (CUDA devices, LOCAL_RANK) and applies the choice. On a CUDA
node a worker takes the device of its LOCAL_RANK and gets ``cpu:gloo,cuda:nccl``: CUDA tensors go through
NCCL, CPU tensors (data positions, metrics, a Checkpointer's agreement) through gloo on the same group.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from convoy.errors import ConfigError

CUDA_BACKEND = "cpu:gloo,cuda:nccl"
NCCL_ENV_DEFAULTS = {
    # torch's own error handling: a collective that outlives the process group's timeout (a dead peer) aborts
    # the communicators and ends the process, so a survivor of a failed round exits instead of hanging in NCCL
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    # a watchdog that finds the communicators wedged past this many seconds ends the process too
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "60",
}
"""Set in a CUDA worker's environment before its process group starts, unless the job's environment sets them."""

_KNOWN = ("gloo", "nccl", CUDA_BACKEND, "cuda:nccl,cpu:gloo")


@dataclass(frozen=True)
class BackendChoice:
    """``backend`` as ``init_process_group`` takes it; ``device`` ("cpu" or "cuda:N"); ``device_index`` for CUDA."""

    backend: str
    device: str
    device_index: int | None = None

    @property
    def uses_nccl(self) -> bool:
        return "nccl" in self.backend


def choose_backend(requested: str | None, cuda_devices: int, local_rank: int,
                   visible_devices: str | None = None) -> BackendChoice:
    """The backend and device for the worker with ``local_rank`` on a node where torch sees ``cuda_devices``.

    ``requested`` None: NCCL (with gloo for CPU tensors) where there is a GPU, else gloo. A request torch could
    not honour on this node (NCCL without a GPU, more local ranks than GPUs) is a ConfigError saying what to do."""
    if requested is not None and requested not in _KNOWN:
        raise ConfigError(f"backend {requested!r} is not one convoy runs: use 'gloo' (CPU tensors), 'nccl' (CUDA "
                          f"tensors) or {CUDA_BACKEND!r} (both), or leave it unset to pick by the hardware")
    if requested == "gloo" or (requested is None and cuda_devices == 0):
        return BackendChoice("gloo", "cpu")
    visible = f" (CUDA_VISIBLE_DEVICES={visible_devices})" if visible_devices is not None else ""
    if cuda_devices == 0:
        raise ConfigError(f"backend {requested!r} needs a CUDA device, and torch sees none on this node{visible}; "
                          "use backend='gloo', or run on a node with a GPU and a CUDA build of torch")
    if not 0 <= local_rank < cuda_devices:
        raise ConfigError(f"LOCAL_RANK {local_rank} has no GPU of its own: torch sees {cuda_devices} CUDA "
                          f"device(s) on this node{visible}; start at most {cuda_devices} worker(s) per node "
                          f"(--nproc-per-node {cuda_devices}), or use backend='gloo'")
    backend = CUDA_BACKEND if requested is None else requested
    return BackendChoice(backend, f"cuda:{local_rank}", local_rank)


def nccl_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The NCCL settings to add to ``environ``: convoy's defaults for those the job left unset."""
    return {name: value for name, value in NCCL_ENV_DEFAULTS.items() if name not in environ}
