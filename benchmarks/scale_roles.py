"""The control plane of a job of roles at N agents (issue 54), by simulation: a real ``convoy master`` of a job with
one role of N processes (``actor``, one a node: placement spreads a role that declares nothing over the nodes
running the fewest; a failed one restarts alone, as an RL job's actors are run), N simulated agents
(``scripts/sim_roles.py``) that report each process started at once.

    python benchmarks/scale_roles.py [--nodes 64,256,1024,4096] [--steady-s 10] [--timeout-s 120]

For each N, with a fresh master:
1. started: from the last join to every process reported started (the orders out, the reports in);
   addresses: to every agent holding every process's address (what a process finds its peers by);
2. heartbeats: as ``scale.py``, from one poll after every agent held every address, those sent in ``--steady-s``
   seconds (counted one poll later, once all are answered);
3. a silent node: from the master's heartbeat time-out to its process started on another node (``moved``), and to
   every other agent holding its new address (``known``).
Where an N does not get through a phase within ``--timeout-s``, that is said and the larger N are not run. The
targets are those of ``scale.py`` where they apply: at N = 4096 every process started <= 5 s after the last join
and moved <= 5 s after the time-out, heartbeat p99 <= 100 ms, master RSS <= 300 MB, CPU per heartbeat growing
no faster than linearly.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))

from scale import HEARTBEAT_TIMEOUT_S, cell, percentile, print_targets, start_master, stop_master  # noqa: E402
from sim_agents import SimulatedAgents  # noqa: E402
from sim_roles import RoleSimAgent  # noqa: E402

from convoy.control.roles.roles_file import save_roles  # noqa: E402
from convoy.roles_config import RESTART_ONE, RoleCount, RoleSpec  # noqa: E402

ROLE = "actor"


def measure(nodes: int, steady_s: float, timeout_s: float, heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S
            ) -> dict[str, float | str]:
    run_dir = Path(tempfile.mkdtemp(prefix=f"convoy-scale-roles-{nodes}-"))
    save_roles(run_dir, (RoleSpec(name=ROLE, entrypoint="actor.py", count=RoleCount(nodes, nodes),
                                  failure_policy=RESTART_ONE),))
    master, _, address, token = start_master(run_dir, nodes, heartbeat_timeout_s)
    host, port = address.split(":")[0], int(address.split(":")[1])
    watched = psutil.Process(master.pid)
    sim = SimulatedAgents(host, port, token, nodes, kind=RoleSimAgent)
    agents: list[RoleSimAgent] = sim.agents  # type: ignore[assignment]
    result: dict[str, float | str] = {"nodes": nodes}
    try:
        sim.start()
        sim.wait_for(lambda: all(a.joined_at for a in agents), timeout_s, f"{nodes} joins")
        last_join = max(a.joined_at for a in agents)
        sim.wait_for(lambda: sum(len(a.started) for a in agents) >= nodes, timeout_s, "every process started")
        result["started_s"] = max(t for a in agents for t in a.started.values()) - last_join
        sim.wait_for(lambda: all(a.complete for a in agents), timeout_s, "every agent holding every address")
        result["addresses_s"] = max(min(a.complete.values()) for a in agents) - last_join
        poll = max(a.poll_s or a.heartbeat_s for a in agents)
        time.sleep(poll)
        began = time.monotonic()
        cpu_before = sum(watched.cpu_times()[:2])
        time.sleep(steady_s)
        cpu = sum(watched.cpu_times()[:2]) - cpu_before
        time.sleep(poll)  # the heartbeats sent in the window are answered by the end of their poll
        late = [x for a in agents for sent, x in a.late if began <= sent < began + steady_s]
        result.update(beats=len(late), p50_ms=1000 * percentile(late, 0.5), p99_ms=1000 * percentile(late, 0.99),
                      cpu_ms_per_beat=1000 * cpu / max(1, len(late)), rss_mb=watched.memory_info().rss / 2**20,
                      retries=sum(a.link.retries + a.beats.retries for a in agents))
        silent, others = agents[-1], agents[:-1]
        lost = set(silent.started)
        before = max(a.addresses_version for a in others)
        silent.silent = True
        sim.wait_for(lambda: any(key[:2] == gone[:2] and key[2] > gone[2] for a in others for key in a.started
                                 for gone in lost), timeout_s + heartbeat_timeout_s, "the silent node's process moved")
        timed_out = silent.last_beat + heartbeat_timeout_s
        result["moved_s"] = max(t for a in others for key, t in a.started.items()
                                if any(key[:2] == gone[:2] and key[2] > gone[2] for gone in lost)) - timed_out
        sim.wait_for(lambda: all(any(v > before for v in a.complete) for a in others), timeout_s,
                     "every other agent holding the moved process's address")
        result["known_s"] = max(min(t for v, t in a.complete.items() if v > before) for a in others) - timed_out
    except TimeoutError as exc:
        result["stopped"] = f"{exc} ({sum(len(a.started) for a in agents)} of {nodes} processes started)"
    finally:
        sim.stop()
        stop_master(master)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="64,256,1024,4096")
    parser.add_argument("--steady-s", type=float, default=10.0)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    args = parser.parse_args()
    rows = []
    for nodes in [int(n) for n in args.nodes.split(",")]:
        print(f"N = {nodes} ...", flush=True)
        row = measure(nodes, args.steady_s, args.timeout_s)
        rows.append(row)
        print(f"  {row}", flush=True)
        if "stopped" in row:
            print(f"  stopped at N = {nodes}: {row['stopped']}; larger N not run", flush=True)
            break
    print("\n     N  started s  addresses s  beats  hb p50 ms  hb p99 ms  CPU ms/beat  RSS MB  moved s  known s "
          "(started, addresses: after the last join; moved, known: after the time-out)")
    for row in rows:
        print(f"{row['nodes']:>6} {cell(row, 'started_s', 10)} {cell(row, 'addresses_s', 12)} "
              f"{row.get('beats', '-'):>6} {cell(row, 'p50_ms', 10, 1)} {cell(row, 'p99_ms', 10, 1)} "
              f"{cell(row, 'cpu_ms_per_beat', 12, 3)} {cell(row, 'rss_mb', 7, 0)} {cell(row, 'moved_s', 8)} "
              f"{cell(row, 'known_s', 8)}")
    print_targets(rows, [("every process started <= 5 s after the last join", "started_s", 5.0),
                         ("heartbeat p99 <= 100 ms", "p99_ms", 100.0),
                         ("a lost node's process started elsewhere <= 5 s after the time-out", "moved_s", 5.0),
                         ("master RSS <= 300 MB", "rss_mb", 300.0)])
    done = [row for row in rows if isinstance(row.get("cpu_ms_per_beat"), float)]
    for before, after in zip(done, done[1:], strict=False):
        exponent = math.log(float(after["cpu_ms_per_beat"]) / float(before["cpu_ms_per_beat"])) / math.log(
            int(after["nodes"]) / int(before["nodes"]))
        print(f"  N {before['nodes']} -> {after['nodes']}: CPU per heartbeat exponent {exponent:.2f} "
              f"({'met' if exponent <= 1.0 else 'missed'}: no faster than linear)")


if __name__ == "__main__":
    main()
