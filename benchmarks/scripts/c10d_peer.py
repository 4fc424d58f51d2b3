"""The peer of ``benchmarks/scale.py``: torch's own elastic rendezvous as torchrun runs it with ``--rdzv-backend c10d``
(``DynamicRendezvousHandler`` on a ``C10dRendezvousBackend`` over one ``TCPStore``), with N participants.

The store's server runs in a process of its own, as on torchrun's rendezvous host; the N participants are threads of
this process, each with its own store connection and handler (as N agents' would be), all calling
``next_rendezvous()`` at once for a job of exactly N nodes (``--nnodes N:N``, so the round closes at the N-th join,
without the last-call wait). Measured: from the last participant's call to every participant holding the round,
and from the first call. A participant that has not joined within ``timeout_s`` (torchrun's join time-out) ends
the measure at that N.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any

SERVER = """
import sys, time
from datetime import timedelta
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=600))
print(store.port, flush=True)
sys.stdin.read()
"""


def measure_c10d(nodes: int, timeout_s: float) -> dict[str, Any]:
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout

    server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        called: list[float] = [0.0] * nodes
        held: list[float] = [0.0] * nodes
        errors: list[str] = []
        handlers: list[Any] = []
        timeout = RendezvousTimeout(join=timedelta(seconds=timeout_s))
        for _ in range(nodes):  # each its own connection and handler, made before the clock starts
            store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout_s))
            backend = C10dRendezvousBackend(store, "scale")
            handlers.append(DynamicRendezvousHandler.from_backend("scale", store, backend, nodes, nodes,
                                                                 local_addr="127.0.0.1", timeout=timeout))

        def participate(index: int) -> None:
            called[index] = time.monotonic()
            try:
                handlers[index].next_rendezvous()
                held[index] = time.monotonic()
            except Exception as exc:  # noqa: BLE001 (recorded: the measure says where the peer stops)
                errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")

        threads = [threading.Thread(target=participate, args=(index,), daemon=True) for index in range(nodes)]
        began = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(max(0.0, began + timeout_s + 30 - time.monotonic()))
        if errors or not all(held):
            missing = sum(1 for t in held if not t)
            return {"nodes": nodes, "stopped": f"{missing} of {nodes} participants without a round within "
                                              f"{timeout_s:.0f} s; {errors[:2]}"}
        for handler in handlers:
            handler.shutdown()
        return {"nodes": nodes, "round_s": max(held) - max(called), "from_start_s": max(held) - min(called)}
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    print(measure_c10d(int(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 120.0))
