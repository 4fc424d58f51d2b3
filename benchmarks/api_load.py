"""The master under load and attack (issue 25): while a 2-node x 2-worker job trains, one storm of
1,000 concurrent unauthenticated connections, 200 slow-body clients and 10,000 malformed requests.

    python benchmarks/api_load.py [--storm-s S]

Prints the job's steps lost, the master's RSS growth over the storm, the heartbeat round trip during it
(p50/p99), keep-alive request latency after it, then one ``target ...: ... met|missed`` line per target.
Exits 0 whether targets are met or missed; non-zero only if the benchmark itself breaks.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import selectors
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from fault_job import Job, wait_for
from steplog import steps_lost

from convoy.control.protocol import messages as p
from convoy.control.protocol.client import MasterClient

UNAUTHENTICATED, SLOW_BODIES, MALFORMED = 1000, 200, 10_000
MALFORMED_THREADS = 4
PROBE_EVERY_S = 0.02


class ApiJob(Job):
    """``convoy run`` of 2 nodes x 2 workers (4 ranks) training fault_train.py."""

    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp, nodes=4)
        argv = [sys.executable, "-m", "convoy", "run", "--nnodes", "2", "--nproc-per-node", "2", "--stop-grace", "2",
                "--max-restarts", "5", "--run-dir", str(self.run_dir), *self.train_args(0.05, 1234)]
        self.main = self.spawn(argv)

    def master(self) -> psutil.Process | None:
        launcher = self.known[self.main.pid]  # type: ignore[union-attr]
        return next((c for c in launcher.children() if "master" in c.cmdline()), None)


def _address(url: str) -> tuple[str, int]:
    host, _, port = url.rpartition(":")
    return host, int(port)


def hold_unauthenticated(address: tuple[str, int], count: int, until: float) -> int:
    """Keep ``count`` connections open that send half a header block and stall; reopen those the master
    closes. Returns how many connections were opened in all."""
    selector, opened = selectors.DefaultSelector(), 0

    def open_one() -> None:
        nonlocal opened
        try:
            sock = socket.create_connection(address, timeout=2)
            sock.sendall(b"POST /v1/join HTTP/1.1\r\nHost: x\r\n")
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ)
            opened += 1
        except OSError:
            pass

    for _ in range(count):
        open_one()
    while time.monotonic() < until:
        for key, _ in selector.select(0.1):
            selector.unregister(key.fileobj)
            key.fileobj.close()  # type: ignore[union-attr]
            open_one()
    for key in list(selector.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]
    return opened


def slow_bodies(address: tuple[str, int], count: int, until: float) -> int:
    """``count`` clients that announce 1 MB - 1 of body without a token and send it 1 KB at a time."""
    socks: list[socket.socket | None] = [None] * count
    sent = 0
    while time.monotonic() < until:
        for index in range(count):
            sock = socks[index]
            try:
                if sock is None:
                    sock = socket.create_connection(address, timeout=2)
                    sock.sendall(f"POST /v1/join HTTP/1.1\r\nHost: x\r\nContent-Length: {(1 << 20) - 1}\r\n\r\n"
                                 .encode())
                    sock.setblocking(False)
                    socks[index] = sock
                    sent += 1
                sock.send(b"x" * 1024)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                if sock is not None:
                    sock.close()
                socks[index] = None
        time.sleep(0.1)
    for sock in socks:
        if sock is not None:
            sock.close()
    return sent


def malformed(address: tuple[str, int], token: str, count: int, seed: int) -> int:
    """Requests that are each wrong in one way; returns how many got an answer."""
    rng = random.Random(seed)
    kinds = [
        lambda: bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 200))) + b"\r\n\r\n",
        lambda: b"GARBAGE\r\n\r\n",
        lambda: b"POST /v1/join HTTP/1.1\r\nContent-Length: 12\r\n\r\n{not json!!}",
        lambda: b"POST /v1/join HTTP/1.1\r\nAuthorization: Bearer wrong\r\nContent-Length: 2\r\n\r\n{}",
        lambda: b"POST /v1/join HTTP/1.1\r\n" + b"X-Pad: " + b"a" * 20000 + b"\r\n\r\n",
        lambda: (f"POST /v1/join HTTP/1.1\r\nAuthorization: Bearer {token}\r\nContent-Length: 9\r\n\r\n"
                 '{"nproc":').encode(),
    ]
    answered = 0
    for _ in range(count):
        try:
            with socket.create_connection(address, timeout=5) as sock:
                sock.sendall(rng.choice(kinds)())
                if sock.recv(64).startswith(b"HTTP/1.1 4"):
                    answered += 1
        except OSError:
            pass
    return answered


def probe_heartbeats(address: tuple[str, int], token: str, until: float, rtts: list[float]) -> None:
    client = MasterClient(*address, token, give_up_after_s=10.0)
    request = p.HeartbeatRequest(node_id="load-probe", round_id=0)
    while time.monotonic() < until:
        started = time.perf_counter()
        client.call("/heartbeat", request, p.HeartbeatResponse)
        rtts.append(time.perf_counter() - started)
        time.sleep(PROBE_EVERY_S)
    client.close()


def keep_alive_latency(address: tuple[str, int], token: str, calls: int = 300) -> list[float]:
    client = MasterClient(*address, token, give_up_after_s=10.0)
    request = p.HeartbeatRequest(node_id="load-probe", round_id=0)
    client.call("/heartbeat", request, p.HeartbeatResponse)
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        client.call("/heartbeat", request, p.HeartbeatResponse)
        times.append(time.perf_counter() - started)
    client.close()
    return times


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storm-s", type=float, default=12.0, help="how long the unauthenticated clients hold on")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    tmp = Path(tempfile.mkdtemp(prefix="convoy-api-load-"))
    job = ApiJob(tmp)
    try:
        if wait_for(job, lambda: job.ready(3.0, warm=False) or None, 180) is None:
            print(f"the job did not train: {job.last_error()}")
            return 1
        address, token = _address(job.master_url() or ""), job.token()
        master = job.master()
        assert master is not None, "no master process under the launcher"
        rss_before = master.memory_info().rss
        peak = rss_before
        until = time.monotonic() + args.storm_s
        rtts: list[float] = []
        results: dict[str, int] = {}
        threads = [threading.Thread(target=probe_heartbeats, args=(address, token, until, rtts)),
                   threading.Thread(target=lambda: results.__setitem__(
                       "unauth", hold_unauthenticated(address, UNAUTHENTICATED, until))),
                   threading.Thread(target=lambda: results.__setitem__(
                       "slow", slow_bodies(address, SLOW_BODIES, until)))]
        for index in range(MALFORMED_THREADS):
            threads.append(threading.Thread(target=lambda i=index: results.__setitem__(
                f"bad{i}", malformed(address, token, MALFORMED // MALFORMED_THREADS, i))))
        started = time.monotonic()
        for thread in threads:
            thread.start()
        while any(thread.is_alive() for thread in threads):
            peak = max(peak, master.memory_info().rss)
            time.sleep(0.2)
        storm_s = time.monotonic() - started
        rss_growth = (peak - rss_before) / 2**20
        after = keep_alive_latency(address, token)
        job.request_stop()
        wait_for(job, lambda: None, 120)  # until the job exits
        job.steps.poll()
        code = job.exit_code()
        rows = job.state_rows("SELECT restart_count FROM job")
        restarts = int(rows[0][0]) if rows else -1  # type: ignore[call-overload]
        lost = steps_lost(job.steps.steps)
        answered = sum(v for k, v in results.items() if k.startswith("bad"))
        print(f"storm {storm_s:.1f} s: {results.get('unauth', 0)} unauthenticated connections opened "
              f"({UNAUTHENTICATED} held at once), {results.get('slow', 0)} slow-body clients ({SLOW_BODIES} at once), "
              f"{MALFORMED} malformed requests ({answered} answered 4xx)")
        print(f"job: exit {code}, restarts {restarts}, steps lost {lost}, last step {job.steps.last_step()}")
        print(f"master RSS {rss_before / 2**20:.1f} MB before, peak {peak / 2**20:.1f} MB during "
              f"(+{rss_growth:.1f} MB)")
        print(f"heartbeat round trip during the storm ({len(rtts)} calls): p50 {percentile(rtts, 0.5) * 1e3:.2f} ms, "
              f"p99 {percentile(rtts, 0.99) * 1e3:.2f} ms, max {max(rtts) * 1e3:.2f} ms")
        print(f"keep-alive request after the storm ({len(after)} calls): p50 {statistics.median(after) * 1e3:.3f} ms, "
              f"p99 {percentile(after, 0.99) * 1e3:.3f} ms")
        targets = [
            ("the job finishes with 0 steps lost", f"exit {code}, {lost} lost, {restarts} restarts",
             code == 0 and lost == 0 and restarts == 0),
            ("master RSS grows <= 20 MB", f"+{rss_growth:.1f} MB", rss_growth <= 20),
            ("heartbeat p99 <= 50 ms during the storm", f"{percentile(rtts, 0.99) * 1e3:.1f} ms",
             percentile(rtts, 0.99) <= 0.050),
            ("keep-alive p50 <= 1 ms after the storm", f"{statistics.median(after) * 1e3:.3f} ms",
             statistics.median(after) <= 0.001),
        ]
        for name, value, met in targets:
            print(f"target {name}: {value} {'met' if met else 'missed'}")
        return 0
    finally:
        job.stop()
        print(f"({os.cpu_count()} CPUs; run dir {job.run_dir})")


if __name__ == "__main__":
    sys.exit(main())
