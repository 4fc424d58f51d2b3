"""Which transport carries parameter-server traffic fastest: torch.distributed.rpc (TensorPipe), gloo
point-to-point (``dist.isend``/``dist.irecv`` with tags) or convoy's role-service transport
(convoy/parallel/transport/); and what that transport's authentication costs: per connection (the handshake) and
per message (against the same transport's raw framing).

    python benchmarks/ps_transport.py [--quick] [--runs 7] [--trips 15] [--connections 60]

Two processes on loopback: rank 0 holds one ``ParameterServer`` shard (two dense tensors and a 100k x 64
table, SGD) and serves it over every transport at once; rank 1 times round trips, each a pull (send a
batch's row ids, get the dense tensors and those rows) then a push (send dense gradients and row gradients,
get the new version). Every transport calls the same server methods, so only the carrying differs. Two
payloads: ``realistic`` (4 MiB dense, 4096 distinct rows) and ``small`` (64 KiB dense, 256 rows). The
transports take turns trip by trip, in a new shuffled order each trip (so load from other processes hits each
alike, and none always follows the same other); each run's median round trip is taken, and the table shows the
median of runs.

The authentication's cost, in the same run: ``socket (convoy)`` is the transport as a job uses it (a connection
proven by the HMAC handshake, each message's incarnation checked against a real addresses file, one thread per
connection) and ``socket raw framing`` the same wire functions on a bare socket served by a plain loop (the
before: no handshake, no fence; the wire's bounds are a few integer comparisons per message inside the framing
itself, so both have them). ``socket (convoy, TLS)`` is a TLS job's. Per connection: the time to an
authenticated connection (TCP connect, handshake, close), plain and with TLS, beside a bare TCP connect.
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PAYLOADS = {"realistic": ((1024, 512, 2), 4096), "small": ((128, 64, 2), 256)}
"""name -> ((rows, cols, tensors) of the dense part, distinct embedding rows per batch)."""
TABLE_ROWS, DIM = 100_000, 64
OP_PULL, OP_PUSH, OP_STOP = 1, 2, 0


SERVERS: dict = {}
"""payload -> rank 0's ParameterServer (rank 1 builds the same, for the shapes), reached by the RPC functions."""


def build(payload: str):  # noqa: ANN201 - torch is imported in the ranks only
    import torch

    from convoy.parallel.ps.optimizers import OptimizerSpec
    from convoy.parallel.ps.placement import DenseSpec, TableSpec, place
    from convoy.parallel.ps.server import ParameterServer

    (rows, cols, count), _ = PAYLOADS[payload]
    dense = {f"dense{i}": torch.randn(rows, cols) for i in range(count)}
    tables = [TableSpec("table", TABLE_ROWS, DIM)]
    placement = place([DenseSpec(n, tuple(t.shape)) for n, t in dense.items()], tables, 1)
    table = torch.randn(TABLE_ROWS, DIM)
    return placement, ParameterServer(0, placement, OptimizerSpec("sgd", 0.01), dense, {"table": table})


def rpc_pull(payload: str, ids):  # noqa: ANN001,ANN201
    return SERVERS[payload].pull({"table": ids})


def rpc_push(payload: str, dense, ids, grads):  # noqa: ANN001,ANN201
    return SERVERS[payload].push("w", dense, {"table": (ids, grads)})


def gloo_serve(names: dict[str, list[str]]) -> None:
    """Rank 0's loop: a header tensor [op, payload index, number of ids] tells what follows from rank 1."""
    import torch
    import torch.distributed as dist

    keys = list(PAYLOADS)
    while True:
        header = torch.zeros(3, dtype=torch.int64)
        dist.recv(header, src=1, tag=1)
        op, which, count = header.tolist()
        if op == OP_STOP:
            return
        server = SERVERS[keys[which]]
        ids = torch.empty(count, dtype=torch.int64)
        dist.recv(ids, src=1, tag=2)
        if op == OP_PULL:
            dense, rows = server.pull({"table": ids})
            works = [dist.isend(dense[name], dst=1, tag=10 + i) for i, name in enumerate(names[keys[which]])]
            works.append(dist.isend(rows["table"], dst=1, tag=3))
        else:
            grads = {name: torch.empty_like(server.dense[name]) for name in names[keys[which]]}
            works = [dist.irecv(grads[name], src=1, tag=10 + i) for i, name in enumerate(names[keys[which]])]
            row_grads = torch.empty(count, DIM)
            works.append(dist.irecv(row_grads, src=1, tag=3))
            for work in works:
                work.wait()
            version = server.push("w", grads, {"table": (ids, row_grads)})
            works = [dist.isend(torch.tensor([version]), dst=1, tag=4)]
        for work in works:
            work.wait()


def gloo_trip(payload: str, ids, names: list[str], shapes: dict) -> None:  # noqa: ANN001
    import torch
    import torch.distributed as dist

    which = list(PAYLOADS).index(payload)
    dist.send(torch.tensor([OP_PULL, which, len(ids)]), dst=0, tag=1)
    dist.send(ids, dst=0, tag=2)
    dense = {name: torch.empty(shapes[name]) for name in names}
    rows = torch.empty(len(ids), DIM)
    works = [dist.irecv(dense[name], src=0, tag=10 + i) for i, name in enumerate(names)]
    works.append(dist.irecv(rows, src=0, tag=3))
    for work in works:
        work.wait()
    dist.send(torch.tensor([OP_PUSH, which, len(ids)]), dst=0, tag=1)
    dist.send(ids, dst=0, tag=2)
    works = [dist.isend(dense[name], dst=0, tag=10 + i) for i, name in enumerate(names)]
    works.append(dist.isend(rows, dst=0, tag=3))
    for work in works:
        work.wait()
    version = torch.zeros(1, dtype=torch.int64)
    dist.recv(version, src=0, tag=4)


class RawLink:
    """The caller's end of the raw framing: the wire's functions on a bare socket (waiting for each reply as long
    as a ``Connection`` does: a socket with a timeout polls before each read)."""

    def __init__(self, address: str) -> None:
        from convoy.parallel.transport.connection import REQUEST_S, tune

        host, _, port = address.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=REQUEST_S)
        tune(self.sock)

    def request(self, message):  # noqa: ANN001,ANN201
        from convoy.parallel.transport.wire import Limits, recv_message, send_message

        send_message(self.sock, message)
        return recv_message(self.sock, Limits())


def raw_framing(handle) -> str:  # noqa: ANN001
    """Serve ``handle`` on a bare socket by a plain loop of the wire's functions (one connection): the transport
    without its handshake, fence and listener."""
    from convoy.parallel.transport import TransportError
    from convoy.parallel.transport.connection import tune
    from convoy.parallel.transport.wire import Limits, recv_message, send_message

    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        tune(conn)
        with conn:
            while True:
                try:
                    message = recv_message(conn, Limits())
                except (TransportError, OSError):
                    return
                send_message(conn, handle(message))

    threading.Thread(target=serve, name="raw-framing", daemon=True).start()
    return f"127.0.0.1:{listener.getsockname()[1]}"


def job_credentials(role: str, tls: bool):  # noqa: ANN201
    from convoy.parallel.transport import Credentials, Identity
    from convoy.worker.role_env import SERVICE_SECRET_ENV

    return Credentials(bytes.fromhex(os.environ[SERVICE_SECRET_ENV]), Identity(role, 0, 0), tls)


def serve_sockets(store) -> None:  # noqa: ANN001
    """Rank 0: each payload's shard behind the transport as a job uses it (plain and TLS, each message's caller
    checked against a real addresses file) and behind the raw framing."""
    from convoy.parallel.ps.service import ServerProcess
    from convoy.parallel.transport import IncarnationFence
    from convoy.worker.role_env import RoleInfo, write_addresses

    published = Path(tempfile.mkdtemp(prefix="ps-transport-")) / "addresses.json"
    write_addresses(published, 1, {"ps": [""], "worker": [""]}, {"ps": [0], "worker": [0]})
    fence = IncarnationFence(RoleInfo("ps", 0, 1, addresses_file=str(published)).refresh())
    for payload, server in SERVERS.items():
        for kind, tls in (("socket", False), ("tls", True)):
            service = ServerProcess(credentials=job_credentials("ps", tls), admit=fence.check)
            service.server = server
            store.set(f"{kind}/{payload}", service.address)
        store.set(f"raw/{payload}", raw_framing(service.handle))


def connect_times(args: argparse.Namespace, plain: str, tls: str) -> dict[str, list[float]]:
    """Seconds to a usable connection, each kind in turn: a bare TCP connect, an authenticated one, one over TLS."""
    from convoy.parallel.transport import Connection

    host, _, port = plain.rpartition(":")
    makers = {"bare TCP connect": lambda: socket.create_connection((host, int(port))),
              "handshake": lambda: Connection(plain, credentials=job_credentials("worker", False)),
              "handshake with TLS": lambda: Connection(tls, credentials=job_credentials("worker", True))}
    times: dict[str, list[float]] = {kind: [] for kind in makers}
    for index in range(args.connections + 3):
        for kind, make in makers.items():
            start = time.perf_counter()
            made = make()
            seconds = time.perf_counter() - start
            made.close()
            if index >= 3:  # the first few warm up the paths
                times[kind].append(seconds)
    return times


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.rpc as rpc

    from convoy.parallel.transport import Connection, Message
    from convoy.procs import exit_without_teardown

    rank = int(os.environ["RANK"])
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), 2, rank == 0, timedelta(seconds=120))
    dist.init_process_group("gloo", store=dist.PrefixStore("gloo", store), rank=rank, world_size=2)
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{os.environ['RPC_PORT']}")
    rpc.init_rpc(f"rank{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    places = {}
    for payload in PAYLOADS:
        places[payload], SERVERS[payload] = build(payload)
    names = {payload: sorted(place.dense) for payload, place in places.items()}
    if rank == 0:
        serve_sockets(store)
        gloo_serve(names)
        store.wait(["done"], timedelta(seconds=600))
    else:
        gen = torch.Generator().manual_seed(0)
        links = {(kind, p): Connection(store.get(f"{kind}/{p}").decode(), credentials=job_credentials("worker", tls))
                 for kind, tls in (("socket", False), ("tls", True)) for p in PAYLOADS}
        links.update({("raw", p): RawLink(store.get(f"raw/{p}").decode()) for p in PAYLOADS})

        def socket_trip(kind: str, payload: str, ids: torch.Tensor, grads: dict, row_grads: torch.Tensor) -> None:
            links[(kind, payload)].request(Message("pull", {"worker": "w", "at_least": 0}, {"ids/table": ids}))
            tensors = {f"dense/{n}": g for n, g in grads.items()} | {"ids/table": ids, "grads/table": row_grads}
            links[(kind, payload)].request(Message("push", {"worker": "w"}, tensors))

        def rpc_trip(payload: str, ids: torch.Tensor, grads: dict, row_grads: torch.Tensor) -> None:
            rpc.rpc_sync("rank0", rpc_pull, args=(payload, ids))
            rpc.rpc_sync("rank0", rpc_push, args=(payload, grads, ids, row_grads))

        shapes = {p: {n: tuple(SERVERS[p].dense[n].shape) for n in names[p]} for p in PAYLOADS}
        trips = {CONVOY: lambda *a: socket_trip("socket", *a), RAW: lambda *a: socket_trip("raw", *a),
                 TLS: lambda *a: socket_trip("tls", *a), "torch rpc (TensorPipe)": rpc_trip,
                 "gloo isend/irecv": lambda p, ids, g, r: gloo_trip(p, ids, names[p], shapes[p])}
        medians: dict = {(p, t): [] for p in PAYLOADS for t in trips}
        order, shuffle = list(trips), random.Random(0).shuffle
        for _ in range(args.runs):
            for payload, (_, count) in PAYLOADS.items():
                grads = {n: torch.randn(shapes[payload][n], generator=gen) * 1e-3 for n in names[payload]}
                times: dict[str, list[float]] = {transport: [] for transport in trips}
                for index in range(args.trips + 2):  # trip by trip, in turn: a load spike hits every transport
                    ids = torch.randperm(TABLE_ROWS, generator=gen)[:count]
                    row_grads = torch.randn(count, DIM, generator=gen) * 1e-3
                    shuffle(order)  # no transport always runs right after the same other one
                    for transport in order:
                        start = time.perf_counter()
                        trips[transport](payload, ids, grads, row_grads)
                        if index >= 2:
                            times[transport].append(time.perf_counter() - start)
                for transport, seen in times.items():
                    medians[(payload, transport)].append(statistics.median(seen))
        connects = connect_times(args, store.get("socket/small").decode(), store.get("tls/small").decode())
        dist.send(torch.tensor([OP_STOP, 0, 0]), dst=0, tag=1)
        report(medians, connects, args)
        store.set("done", "1")
    rpc.shutdown()
    exit_without_teardown(0)


CONVOY, RAW, TLS = "socket (convoy)", "socket raw framing", "socket (convoy, TLS)"
PEERS = (CONVOY, "torch rpc (TensorPipe)", "gloo isend/irecv")
"""The transports the fastest is chosen among; the raw framing and TLS lines are the authentication's cost."""
HANDSHAKE_GOAL_MS, CHECKS_GOAL = 1.0, 1.05


def report(medians: dict, connects: dict[str, list[float]], args: argparse.Namespace) -> None:
    lines = [f"{args.runs} runs x {args.trips} round trips (pull + push) per transport and payload, taking turns "
             f"trip by trip; median over runs of each run's median", "",
             f"{'payload':<10} {'transport':<24} {'round trip ms':>14} {'MB/s':>8} {'x fastest':>10}"]
    winners, per_payload = {}, {}
    for payload, ((rows, cols, count), ids) in PAYLOADS.items():
        moved = 2 * (rows * cols * count * 4 + ids * DIM * 4 + ids * 8)
        results = per_payload[payload] = {t: statistics.median(v) for (p, t), v in medians.items() if p == payload}
        peers = {t: results[t] for t in PEERS}
        best = min(peers.values())
        winners[payload] = min(peers, key=peers.get)
        for transport, seconds in sorted(peers.items(), key=lambda item: item[1]):
            lines.append(f"{payload:<10} {transport:<24} {seconds * 1e3:>14.2f} {moved / seconds / 1e6:>8.0f} "
                         f"{seconds / best:>10.2f}")
        lines.append(f"{'':<10} (runs, ms: " + "; ".join(
            f"{t.split()[0]} " + " ".join(f"{s * 1e3:.1f}" for s in v)
            for (p, t), v in medians.items() if p == payload and t in PEERS) + ")")
    lines += ["", "the authentication's cost per message: the transport as a job uses it against its raw framing "
                  "(same run, in turn)", f"{'payload':<10} {'convoy ms':>10} {'raw ms':>8} {'ratio':>6} {'TLS ms':>8}"
                  f"   (runs: convoy / raw, ms)"]
    for payload, results in per_payload.items():
        runs = " ".join(f"{a * 1e3:.2f}/{b * 1e3:.2f}" for a, b in zip(medians[(payload, CONVOY)],
                                                                      medians[(payload, RAW)], strict=True))
        lines.append(f"{payload:<10} {results[CONVOY] * 1e3:>10.2f} {results[RAW] * 1e3:>8.2f} "
                     f"{results[CONVOY] / results[RAW]:>6.3f} {results[TLS] * 1e3:>8.2f}   ({runs})")
    handshake = {kind: statistics.median(seconds) * 1e3 for kind, seconds in connects.items()}
    lines += ["", f"per connection, median of {args.connections} in turn (ms): " + ", ".join(
        f"{kind} {ms:.3f} (p90 {sorted(connects[kind])[int(0.9 * len(connects[kind]))] * 1e3:.3f})"
        for kind, ms in handshake.items()), ""]
    for payload, winner in winners.items():
        results = per_payload[payload]
        runner_up = sorted(results[t] for t in PEERS)[1]
        verdict = "met" if winner == CONVOY else "missed"
        lines.append(f"target the socket protocol convoy uses is the fastest ({payload}): fastest {winner} "
                     f"{results[winner] * 1e3:.2f} ms, next {runner_up * 1e3:.2f} ms (goal socket fastest) {verdict}")
    for kind in ("handshake", "handshake with TLS"):
        verdict = "met" if handshake[kind] <= HANDSHAKE_GOAL_MS else "missed"
        lines.append(f"target {kind} per connection on loopback: {handshake[kind]:.3f} ms (goal <= "
                     f"{HANDSHAKE_GOAL_MS:g} ms) {verdict}")
    for payload, results in per_payload.items():
        ratio = results[CONVOY] / results[RAW]
        lines.append(f"target per-message cost of authentication and checks ({payload}): {ratio:.3f}x the raw "
                     f"framing (goal <= {CHECKS_GOAL}x) {'met' if ratio <= CHECKS_GOAL else 'missed'}")
    text = "\n".join(lines)
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 runs x 5 trips, 20 connections (CI smoke)")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--trips", type=int, default=15)
    parser.add_argument("--connections", type=int, default=60, help="connections timed per kind")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "ps_transport.txt"))
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.runs, args.trips, args.connections, args.out = 3, 5, 20, ""
    if args.rank:
        rank_main(args)
        return 0
    from convoy.ports import free_port
    from convoy.worker.role_env import SERVICE_SECRET_ENV

    env = {**os.environ, "MASTER_PORT": str(free_port()), "RPC_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO), SERVICE_SECRET_ENV: secrets.token_hex(32)}  # one job's secret, as an agent's
    argv = [sys.executable, __file__, "--rank", "--runs", str(args.runs), "--trips", str(args.trips),
            "--connections", str(args.connections), "--out", args.out]
    ranks = [subprocess.Popen(argv, env={**env, "RANK": str(rank)}) for rank in range(2)]
    codes = [rank.wait(timeout=1800) for rank in ranks]
    return 0 if codes == [0, 0] else 1


if __name__ == "__main__":
    sys.exit(main())
