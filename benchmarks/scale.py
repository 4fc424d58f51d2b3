"""The control plane at N agents (issue 54), by simulation: a real ``convoy master`` in its own process, N simulated
agents (``scripts/sim_agents.py``: real HTTP with the job's token, a keep-alive connection each, the agent's
join, long-polled wait and long-polled heartbeats) on one event loop in this process.

    python benchmarks/scale.py [--nodes 64,256,1024,4096] [--steady-s 10] [--timeout-s 120]

For each N, with a fresh master (``--nnodes 1:N``, so the first round closes when the N-th node joins):
1. round: the last join to every agent holding round 1; then the dashboard's nodes page (the JSON its page loads);
2. heartbeats: from one poll after the round on (the burst of the round's replies is not steady load), for
   ``--steady-s`` seconds, each heartbeat's round trip beyond the poll the master asked for (p50, p99); the master's
   CPU seconds per heartbeat and its RSS; the state file's size;
3. a silent node: one agent stops heartbeating; from the master's heartbeat time-out to every other agent told of
   the next round (``told``), and to every other agent holding it.
Where an N does not get through a phase within ``--timeout-s``, that is said and the larger N are not run.
Targets (N = 4096): round <= 5 s, heartbeat p99 <= 100 ms, next round <= 5 s after the time-out, RSS <= 300 MB,
nodes page <= 2 s; round and master CPU per heartbeat growing no faster than linearly (a table and
``results/scale.png``); against torch's c10d rendezvous (``scripts/c10d_peer.py``) at the same N, in the same run,
as far as it gets: convoy's round <= 0.5x its. A job of roles: ``scale_roles.py``.
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
import tempfile
import time
from typing import Any
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))

from c10d_peer import measure_c10d  # noqa: E402
from sim_agents import SimulatedAgents  # noqa: E402

from convoy.config import STATE_FILE  # noqa: E402

HEARTBEAT_TIMEOUT_S = 30.0
"""The master's --heartbeat-timeout here: its default (a node is lost after 30 s without a heartbeat)."""
STARTED = re.compile(r"convoy: master of job (\w+) at ([\d.]+):(\d+); token file (\S+)")


def start_master(run_dir: Path, nodes: int, heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S
                 ) -> tuple[subprocess.Popen[str], str, str, str]:
    """A master whose output goes to ``run_dir/master.log`` (a pipe nobody reads would fill with its N join lines
    and stop it mid-print); its job id, where it listens (host:port) and its token."""
    log = run_dir / "master.log"
    with log.open("w") as out:
        master = subprocess.Popen([sys.executable, "-m", "convoy", "master", "--host", "127.0.0.1", "--port", "0",
                                   "--nnodes", f"1:{nodes}", "--rdzv-wait", "60", "--heartbeat-timeout",
                                   str(heartbeat_timeout_s), "--run-dir", str(run_dir)],
                                  stdout=out, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and master.poll() is None:
        found = STARTED.search(log.read_text())
        if found:
            token = Path(found.group(4)).read_text().strip()
            return master, found.group(1), f"{found.group(2)}:{found.group(3)}", token
        time.sleep(0.05)
    master.kill()
    raise RuntimeError(f"the master did not say where it listens within 60 s: {log.read_text()[-2000:]}")


def nodes_page_s(address: str, job_id: str, token: str, tries: int = 3) -> float:
    """The dashboard's nodes page: the median time of the JSON its page loads (its first page of nodes, with their
    ranks and log tails), asked with the job's token as a script would."""
    import http.client

    times = []
    for _ in range(tries):
        began = time.monotonic()
        conn = http.client.HTTPConnection(address, timeout=60)
        conn.request("GET", f"/ui/api/jobs/{job_id}/nodes", headers={"Authorization": f"Bearer {token}"})
        reply = conn.getresponse()
        body = reply.read()
        conn.close()
        if reply.status != 200:
            raise RuntimeError(f"the nodes page answered {reply.status}: {body[:300]!r}")
        times.append(time.monotonic() - began)
    return sorted(times)[len(times) // 2]


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else float("nan")


def measure(nodes: int, steady_s: float, timeout_s: float, keep_alive: bool = True,
            heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S) -> dict[str, float | str]:
    run_dir = Path(tempfile.mkdtemp(prefix=f"convoy-scale-{nodes}-"))
    master, job_id, address, token = start_master(run_dir, nodes, heartbeat_timeout_s)
    host, port = address.split(":")[0], int(address.split(":")[1])
    watched = psutil.Process(master.pid)
    sim = SimulatedAgents(host, port, token, nodes, keep_alive=keep_alive)
    result: dict[str, float | str] = {"nodes": nodes}
    try:
        started = time.monotonic()
        sim.start()
        sim.wait_for(lambda: all(a.joined_at for a in sim.agents), timeout_s, f"{nodes} joins")
        last_join = max(a.joined_at for a in sim.agents)
        sim.wait_for(lambda: len(sim.holding(1)) == nodes, timeout_s, "every agent holding round 1")
        result["round_s"] = max(a.rounds[1] for a in sim.agents) - last_join
        result["from_start_s"] = max(a.rounds[1] for a in sim.agents) - started
        result["nodes_page_s"] = nodes_page_s(address, job_id, token)
        # steady load: the heartbeats sent from one poll after the round on (those in flight while the round's
        # replies went out measure that burst, not the steady state)
        time.sleep(max(a.poll_s or a.heartbeat_s for a in sim.agents))
        began = time.monotonic()
        cpu_before = sum(watched.cpu_times()[:2])
        time.sleep(steady_s)
        cpu = sum(watched.cpu_times()[:2]) - cpu_before
        late = [x for a in sim.agents for sent, x in a.late if began <= sent]
        result.update(beats=len(late), p50_ms=1000 * percentile(late, 0.5), p99_ms=1000 * percentile(late, 0.99),
                      cpu_ms_per_beat=1000 * cpu / max(1, len(late)), rss_mb=watched.memory_info().rss / 2**20,
                      state_mb=sum(path.stat().st_size for path in run_dir.glob(f"{STATE_FILE}*")) / 2**20,
                      retries=sum(a.link.retries + a.beats.retries for a in sim.agents))
        silent = sim.agents[-1]
        silent.silent = True
        others = sim.agents[:-1]
        sim.wait_for(lambda: all(any(r > 1 for r in a.rounds) for a in others), timeout_s + heartbeat_timeout_s,
                     "every other agent holding the next round")
        # the master's time-out runs from the last heartbeat it heard from the silent agent
        timed_out = silent.last_beat + heartbeat_timeout_s
        result["next_round_s"] = max(min(t for r, t in a.rounds.items() if r > 1) for a in others) - timed_out
        result["told_s"] = max(min(t for r, t in a.told.items() if r > 1) for a in others) - timed_out
    except TimeoutError as exc:
        held = len(sim.holding(1))
        result["stopped"] = f"{exc} ({held} of {nodes} held round 1; the master's threads: {watched.num_threads()})"
    finally:
        sim.stop()
        stop_master(master)
    return result


def stop_master(master: subprocess.Popen[str]) -> None:
    """SIGTERM, and SIGKILL where the master has not ended 30 s later."""
    master.terminate()
    try:
        master.wait(30)
    except subprocess.TimeoutExpired:
        master.kill()
        master.wait()


def cell(row: dict[str, float | str], key: str, width: int, digits: int = 2) -> str:
    value = row.get(key)
    return f"{value:>{width}.{digits}f}" if isinstance(value, float) else f"{'-':>{width}}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="64,256,1024,4096")
    parser.add_argument("--steady-s", type=float, default=10.0)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--no-keep-alive", action="store_true", help="a connection per request (what the agents do "
                        "not do: it tells the master's cost of held connections from the rest)")
    parser.add_argument("--no-peer", action="store_true", help="skip torch's c10d rendezvous")
    parser.add_argument("--plot", default=str(Path(__file__).parent / "results" / "scale.png"))
    args = parser.parse_args()
    rows, peers = [], []
    for nodes in [int(n) for n in args.nodes.split(",")]:
        print(f"N = {nodes} ...", flush=True)
        row = measure(nodes, args.steady_s, args.timeout_s, keep_alive=not args.no_keep_alive)
        rows.append(row)
        print(f"  {row}", flush=True)
        if not args.no_peer and (not peers or "stopped" not in peers[-1]):
            print(f"  torch c10d rendezvous, N = {nodes} ...", flush=True)
            peers.append(measure_c10d(nodes, args.timeout_s))
            print(f"  {peers[-1]}", flush=True)
        if "stopped" in row:
            print(f"  stopped at N = {nodes}: {row['stopped']}; larger N not run", flush=True)
            break
    print("\n     N  round s  beats  hb p50 ms  hb p99 ms  CPU ms/beat  RSS MB  state MB  nodes page s  told s  "
          "next round s (both after the time-out)")
    for row in rows:
        beats = row.get("beats")
        print(f"{row['nodes']:>6} {cell(row, 'round_s', 8)} {beats if beats is not None else '-':>6} "
              f"{cell(row, 'p50_ms', 10, 1)} {cell(row, 'p99_ms', 10, 1)} {cell(row, 'cpu_ms_per_beat', 12, 3)} "
              f"{cell(row, 'rss_mb', 7, 0)} {cell(row, 'state_mb', 9, 2)} {cell(row, 'nodes_page_s', 13, 3)} "
              f"{cell(row, 'told_s', 7)} {cell(row, 'next_round_s', 12)}")
    print_targets(rows, [("round <= 5 s after the last join", "round_s", 5.0),
                         ("heartbeat p99 <= 100 ms", "p99_ms", 100.0),
                         ("next round <= 5 s after the time-out", "next_round_s", 5.0),
                         ("master RSS <= 300 MB", "rss_mb", 300.0), ("nodes page <= 2 s", "nodes_page_s", 2.0)])
    growth(rows, args.plot)
    if peers:
        compare(rows, peers)


def print_targets(rows: list[dict[str, float | str]], checks: list[tuple[str, str, float]]) -> None:
    """Each (what, key, goal) at N = 4096: met where the largest N run reached 4096 and its value is within."""
    largest = rows[-1]
    reached = "stopped" not in largest and largest["nodes"] >= 4096
    for what, key, goal in checks:
        value = largest.get(key)
        met = reached and isinstance(value, float) and value <= goal
        print(f"target N=4096 {what}: {value if value is not None else 'not reached'} at N = {largest['nodes']} "
              f"{'met' if met else 'missed'}")


def growth(rows: list[dict[str, float | str]], plot: str) -> None:
    """Each step's growth exponent (log ratio of the value over log ratio of N; 1 is linear), and the plot."""
    done = [row for row in rows if isinstance(row.get("round_s"), float) and isinstance(row.get("cpu_ms_per_beat"),
                                                                                       float)]
    print("\ngrowth from one N to the next (exponent: 1 = linear)")
    worst = {"round_s": -math.inf, "cpu_ms_per_beat": -math.inf}
    for before, after in zip(done, done[1:], strict=False):
        steps = []
        for key in worst:
            exponent = math.log(float(after[key]) / float(before[key])) / math.log(int(after["nodes"]) /
                                                                                int(before["nodes"]))
            worst[key] = max(worst[key], exponent)
            steps.append(f"{key} x{float(after[key]) / float(before[key]):.2f} (exponent {exponent:.2f})")
        print(f"  N {before['nodes']} -> {after['nodes']}: " + ", ".join(steps))
    for key, exponent in worst.items():
        print(f"target {key} grows no faster than linearly: largest exponent {exponent:.2f} "
              f"{'met' if len(done) > 1 and exponent <= 1.0 else 'missed'}")
    if len(done) < 2:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    ns = [int(row["nodes"]) for row in done]
    for axis, key, label in ((axes[0], "round_s", "round closed after the last join (s)"),
                             (axes[1], "cpu_ms_per_beat", "master CPU per heartbeat (ms)")):
        values = [float(row[key]) for row in done]
        axis.loglog(ns, values, "o-", label="convoy")
        axis.loglog(ns, [values[0] * n / ns[0] for n in ns], ":", color="grey", label="linear in N")
        axis.set_xlabel("nodes (simulated agents)")
        axis.set_title(label, fontsize=9)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(plot, dpi=110)
    print(f"plot: {plot}")


def compare(rows: list[dict[str, float | str]], peers: list[dict[str, Any]]) -> None:
    """convoy's round against torch's c10d rendezvous at the largest N both reached."""
    print("\n     N  convoy round s  c10d round s  ratio   (both from the last join; from the first: convoy, c10d)")
    both = []
    for peer in peers:
        mine = next((row for row in rows if row["nodes"] == peer["nodes"]), {})
        if "round_s" not in peer or not isinstance(mine.get("round_s"), float):
            print(f"{peer['nodes']:>6}  c10d: {peer.get('stopped', 'no round')}")
            continue
        ratio = float(mine["round_s"]) / peer["round_s"]
        both.append((peer["nodes"], ratio))
        print(f"{peer['nodes']:>6} {float(mine['round_s']):>15.3f} {peer['round_s']:>13.3f} {ratio:>6.3f}   "
              f"({float(mine['from_start_s']):.3f} s, {peer['from_start_s']:.3f} s)")
    if both:
        nodes, ratio = both[-1]
        print(f"target convoy round <= 0.5x c10d's at the largest N it reaches (N = {nodes}): {ratio:.3f}x "
              f"{'met' if ratio <= 0.5 else 'missed'}")


if __name__ == "__main__":
    main()
