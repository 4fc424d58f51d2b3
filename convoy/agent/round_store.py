"""The round's TCPStore, hosted by rank 0's process before its script runs (torchrun's agent store, per round).

Every worker gets ``TORCHELASTIC_USE_AGENT_STORE=True``, so ``init_process_group`` (env:// or tcp://) makes each
rank, rank 0 included, a client of the store at MASTER_ADDR:MASTER_PORT. The agent of the node that gets rank 0
has listened on that port since its join, and hands the listening socket to rank 0's process, which serves the
store on it before the script's first line. So a rank that reaches ``init_process_group`` before rank 0 does (a
rank on another node, which learnt of the round first) is queued by the kernel, not refused: without it,
torch's client backs off and retries, about 0.3 s at a round's start on loopback, more on a later retry.

A standby worker (no fork server: one that failed to start or died) cannot be handed a socket: its rank 0 binds
MASTER_PORT itself, as torch's own rank 0 would, once the agent has let it go. Where no Python process runs the
script (``--no-python``), where the workers do not preload torch (``--preload`` without it: the script may not
use torch, and importing it first would delay its start by a second), or where the user opts out as torchrun's
users do (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), the workers get ``TORCHELASTIC_USE_AGENT_STORE=False`` and
rank 0's ``init_process_group`` hosts the store, as before. The store lives as long as rank 0's process, and a new
round has a new port, so no round reads what an ended one left in its store.
"""

from __future__ import annotations

import os

STORE_FD = "CONVOY_STORE_FD"
"""Rank 0's process: the file descriptor of the listening socket to serve the store on (forked workers)."""
STORE_BIND = "CONVOY_STORE_BIND"
"""Rank 0's process: "1" to bind MASTER_PORT and serve the store there (standby workers)."""
OPT_OUT = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"

_hosted: list[object] = []
"""The store this process serves; referenced for the process's life."""


def hosted_by_rank0(no_python: bool, preload: tuple[str, ...],
                    environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Whether a node's workers use the round's store (``TORCHELASTIC_USE_AGENT_STORE=True``): a Python script
    whose process has torch preloaded (serving the store costs it nothing then; a script run without preloading
    may not use torch at all), and no opt-out. Every node of a job decides alike: their command lines agree."""
    preloads_torch = any(name == "torch" or name.startswith("torch.") for name in preload)
    return not no_python and preloads_torch and environ.get(OPT_OUT, "0") != "1"


def serve_if_asked() -> None:
    """In a worker before its script: serve the round's store where the agent asked this process to (rank 0).
    The variables are taken out of the environment, so what the script starts does not see them. An error (the
    port was taken before a standby could bind it) propagates: the worker exits 1 with torch's message, which
    the agent recognizes, and the master opens the round again on another port."""
    fd = os.environ.pop(STORE_FD, "")
    bind = os.environ.pop(STORE_BIND, "") == "1"
    if not fd and not bind:
        return
    try:
        import torch.distributed as dist
    except ImportError:  # the script cannot use torch.distributed either: nothing to serve
        if fd:
            os.close(int(fd))
        return
    options = {"master_listen_fd": int(fd), "use_libuv": True} if fd else {}
    if fd:
        os.set_inheritable(int(fd), False)  # the store owns it; what the script starts does not inherit it
    _hosted.append(dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                 int(os.environ["WORLD_SIZE"]), True, wait_for_workers=False, **options))
