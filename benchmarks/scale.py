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
nodes page <= 2 s. Not measured yet: a job of roles, and the c10d peer.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))

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
            return master, found.group(1), f"{found.group(2)}:{found.group(3)}", Path(found.group(4)).read_text().strip()
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
        sim.start()
        sim.wait_for(lambda: all(a.joined_at for a in sim.agents), timeout_s, f"{nodes} joins")
        last_join = max(a.joined_at for a in sim.agents)
        sim.wait_for(lambda: len(sim.holding(1)) == nodes, timeout_s, "every agent holding round 1")
        result["round_s"] = max(a.rounds[1] for a in sim.agents) - last_join
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
        master.terminate()
        try:
            master.wait(30)
        except subprocess.TimeoutExpired:
            master.kill()
            master.wait()
    return result


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
    args = parser.parse_args()
    rows = []
    for nodes in [int(n) for n in args.nodes.split(",")]:
        print(f"N = {nodes} ...", flush=True)
        row = measure(nodes, args.steady_s, args.timeout_s, keep_alive=not args.no_keep_alive)
        rows.append(row)
        print(f"  {row}", flush=True)
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
    largest = rows[-1]
    ok = "stopped" not in largest and largest["nodes"] >= 4096
    checks = [("round <= 5 s after the last join", "round_s", 5.0), ("heartbeat p99 <= 100 ms", "p99_ms", 100.0),
              ("next round <= 5 s after the time-out", "next_round_s", 5.0), ("master RSS <= 300 MB", "rss_mb", 300.0),
              ("nodes page <= 2 s", "nodes_page_s", 2.0)]
    for what, key, goal in checks:
        value = largest.get(key)
        met = ok and isinstance(value, float) and value <= goal
        print(f"target N=4096 {what}: {value if value is not None else 'not reached'} at N = {largest['nodes']} "
              f"{'met' if met else 'missed'}")


if __name__ == "__main__":
    main()
