"""Parameter-server training (issue 24): async PS against synchronous data parallelism, and worker memory
predicted from one measured iteration.

    python benchmarks/ps.py [--only async,predict,faults,role_faults,start] [--repeats 3] [--quick]
                            [--role-faults whole_job_restart,lost_node,...] [--fault-runs N]

async: examples/train_dlrm.py's click model and synthetic data, one epoch of the same batches and the same
held-out set for three systems, with one worker slowed 2x (after each step it sleeps as long as the step
took it): (a) convoy's async parameter servers (2 servers; the workers claim shards of batches as they go),
(b) convoy's DDP with row-sharded embedding tables (Adam on the MLPs, row-wise Adagrad on the tables, as
train_dlrm.py), (c) plain torch DDP over ``nn.EmbeddingBag(sparse=True)`` tables (Adam on the MLPs,
``torch.optim.Adagrad`` on the sparse tables). The processes are benchmarks/scripts/ps_worker.py. Samples/s
is the epoch's samples over the wall time from the first worker starting to the last one done (its pushes
applied); systems take turns repeat by repeat and the table shows medians.

predict: see benchmarks/scripts/ps_predict.py.

faults: see benchmarks/scripts/ps_faults.py (a worker killed mid-shard, a parameter server killed, each counted
for exactly-once training and AUC against fault-free runs).

role_faults: see benchmarks/scripts/role_faults.py (issue 47: a whole-job restart, a lost node of 8 workers, a
SIGKILLed and a SIGSTOPped fork server, a worker role scaled down and at once up again; 5 runs each, each counted for
exactly-once training, the role restarts spent and what was left running). Its own section, not part of faults:
it takes about 7-10 minutes at 5 runs a case (15-30 s a run), and ``--role-faults`` runs some of its cases alone.

start: see benchmarks/scripts/ps_start.py (from the job's start to every worker training, phase by phase).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks" / "scripts"))
from ranks import rank_env, run_ranks  # noqa: E402

from convoy.ports import free_port  # noqa: E402
from convoy.worker.role_env import SERVICE_SECRET_ENV  # noqa: E402

WORKER = REPO / "benchmarks" / "scripts" / "ps_worker.py"
SYSTEMS = ("convoy async PS", "convoy DDP + sharded tables", "torch DDP + EmbeddingBag(sparse)")
MODES = dict(zip(SYSTEMS, ("ps", "convoy-ddp", "torch-ddp"), strict=True))
SPEED_GOAL, AUC_TOL = 1.3, 0.005
SERVERS = 2


CRASHES: dict[str, list[str]] = {}
"""system -> the last lines of each run that crashed and was run again."""


def run_system(system: str, args: argparse.Namespace, out: Path, tries: int = 3) -> dict | None:
    """One run of ``system``; a run that crashes (torch's sparse DDP path sometimes aborts in malloc or
    segfaults) is counted and run again, up to ``tries`` in all; None if every try crashed."""
    for _ in range(tries):
        try:
            return run_once(system, args, out)
        except RuntimeError as exc:
            CRASHES.setdefault(system, []).append(str(exc).strip().splitlines()[-1][:160])
            print(f"  {system} crashed: {CRASHES[system][-1]}", flush=True)
    return None


def run_once(system: str, args: argparse.Namespace, out: Path) -> dict:
    mode = MODES[system]
    common = ["--batches", str(args.batches), "--batch", str(args.batch), "--rows", str(args.rows),
              "--held-out", str(args.held_out), "--world", str(args.workers)]
    servers, addresses = [], []
    job = {SERVICE_SECRET_ENV: secrets.token_hex(32)}  # what an agent hands servers and workers: one secret
    if mode == "ps":
        for _ in range(SERVERS):
            port = free_port()
            addresses.append(f"127.0.0.1:{port}")
            servers.append(subprocess.Popen([sys.executable, str(WORKER), "--mode", "server", "--port", str(port)],
                                            env=rank_env(0, 1, "0", **job)))
        common += ["--servers", ",".join(addresses), "--staleness", str(args.staleness), "--lr", str(args.ps_lr),
                   "--ps-optimizer", args.ps_optimizer]
        wait_listening(addresses)
    store = str(free_port())
    commands = [([sys.executable, str(WORKER), "--mode", mode, "--rank", str(rank), "--store-port", store,
                  "--out", str(out / f"{mode}-{rank}.json"), *common], rank_env(rank, args.workers, store, **job))
                for rank in range(args.workers)]
    try:
        run_ranks(commands, system, timeout=900)
    finally:
        for proc in servers:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    ranks = [json.loads((out / f"{mode}-{rank}.json").read_text()) for rank in range(args.workers)]
    wall = max(r["end"] for r in ranks) - min(r["start"] for r in ranks)
    samples = sum(r["batches"] for r in ranks) * args.batch
    return {"rate": samples / wall, "wall": wall, "samples": samples, "auc": ranks[0]["auc"],
            "teacher": ranks[0]["teacher_auc"], "batches": [r["batches"] for r in ranks]}


def wait_listening(addresses: list[str], timeout: float = 60.0) -> None:
    import socket

    deadline = time.monotonic() + timeout
    for address in addresses:
        host, port = address.rsplit(":", 1)
        while True:
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"parameter server {address} did not listen within {timeout} s") from None
                time.sleep(0.1)


def async_section(args: argparse.Namespace) -> list[str]:
    runs: dict[str, list[dict]] = {system: [] for system in SYSTEMS}
    chosen = [SYSTEMS[int(i)] for i in args.systems.split(",")]
    with tempfile.TemporaryDirectory(prefix="convoy-bench-ps-") as tmp:
        for repeat in range(args.repeats):
            for system in chosen:
                last = run_system(system, args, Path(tmp))
                if last is None:
                    continue
                runs[system].append(last)
                print(f"  repeat {repeat + 1} {system}: {last['rate']:.0f} samples/s, AUC {last['auc']:.4f}, "
                      f"batches per worker {last['batches']}, load average {os.getloadavg()[0]:.1f}", flush=True)
    if len(chosen) < len(SYSTEMS):
        return []
    lines = [f"{args.workers} workers (worker 1 slowed 2x), {SERVERS} parameter servers for the async PS; one epoch of "
             f"{args.batches} batches x {args.batch} samples (26 Criteo-shaped tables capped at {args.rows} rows, dim "
             f"16), held-out {args.held_out} samples; PS: {args.ps_optimizer} lr {args.ps_lr}, staleness "
             f"{args.staleness}; median of {args.repeats} repeats", "",
             f"{'system':36} {'samples/s':>10} {'wall s':>8} {'AUC':>8} {'x best sync':>12}"]
    done = [s for s in SYSTEMS if runs[s]]
    med = {s: {k: statistics.median(r[k] for r in runs[s]) for k in ("rate", "wall", "auc")} for s in done}
    best = max(done[1:], key=lambda s: med[s]["rate"])
    for system in SYSTEMS:
        if system not in done:
            lines.append(f"{system:36} no run finished")
            continue
        m = med[system]
        lines.append(f"{system:36} {m['rate']:10.0f} {m['wall']:8.1f} {m['auc']:8.4f} "
                     f"{m['rate'] / med[best]['rate']:11.2f}x")
        lines.append(f"{'':36} (runs: samples/s " + " ".join(f"{r['rate']:.0f}" for r in runs[system])
                     + "; AUC " + " ".join(f"{r['auc']:.4f}" for r in runs[system]) + ")")
    lines.append(f"{'teacher (the best any model can do)':36} {'':10} {'':8} {runs[SYSTEMS[0]][0]['teacher']:8.4f}")
    for system, crashes in CRASHES.items():
        lines.append(f"{system}: {len(crashes)} run(s) crashed (each run again, at most 3 tries a repeat; "
                     f"{args.repeats - len(runs[system])} repeat(s) without a result; last line: {crashes[-1]})")
    ratio = med[SYSTEMS[0]]["rate"] / med[best]["rate"]
    gap = med[SYSTEMS[0]]["auc"] - med[best]["auc"]
    lines += ["", f"target async_ps_speed: {ratio:.2f}x the better synchronous peer ({best}) "
                  f"(goal >= {SPEED_GOAL}x) {'met' if ratio >= SPEED_GOAL else 'missed'}",
              f"target async_ps_auc: {med[SYSTEMS[0]]['auc']:.4f} vs {med[best]['auc']:.4f}, {gap:+.4f} "
              f"(goal within {AUC_TOL}) {'met' if abs(gap) <= AUC_TOL else 'missed'}"]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="async,predict,faults,role_faults,start",
                        help="comma-separated sections: async, predict, faults, role_faults, start")
    parser.add_argument("--role-faults", default="", metavar="CASES",
                        help="role_faults: comma-separated cases to run (default all: whole_job_restart, lost_node, "
                             "forkserver_kill, forkserver_stop, scale_down_up)")
    parser.add_argument("--fault-runs", type=int, default=None, metavar="N",
                        help="role_faults: runs per case (default 5; --quick 1)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a short epoch, one repeat")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batches", type=int, default=600)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--held-out", type=int, default=16384)
    parser.add_argument("--staleness", type=int, default=4)
    parser.add_argument("--ps-optimizer", default="adagrad")
    parser.add_argument("--ps-lr", type=float, default=0.02)
    parser.add_argument("--systems", default="0,1,2", help="tuning: run only these systems (indices), no table")
    args = parser.parse_args()
    sections = set(args.only.split(","))
    if args.quick:
        args.batches, args.repeats = 80, 1
    if not sections <= {"async", "predict", "faults", "role_faults", "start"}:
        parser.error(f"--only takes async, predict, faults, role_faults and/or start (got {args.only!r})")
    from role_faults import CASES as ROLE_FAULT_CASES  # each section's module loads only when asked for, as below

    chosen = [c.strip() for c in args.role_faults.split(",") if c.strip()] or list(ROLE_FAULT_CASES)
    if not set(chosen) <= set(ROLE_FAULT_CASES) or (args.fault_runs is not None and args.fault_runs < 1):
        parser.error(f"--role-faults takes {','.join(ROLE_FAULT_CASES)} (got {args.role_faults!r}); --fault-runs "
                     ">= 1")
    lines: list[str] = []
    if "async" in sections:
        lines += async_section(args)
    if "predict" in sections:
        from ps_predict import predict_section

        lines += ([""] if lines else []) + predict_section(args.quick)
    if "faults" in sections:
        from ps_faults import faults_section

        lines += ([""] if lines else []) + faults_section(args.quick)
    if "role_faults" in sections:
        from role_faults_matrix import role_faults_section

        lines += ([""] if lines else []) + role_faults_section(args.quick, args.fault_runs, chosen)
    if "start" in sections:
        from ps_start import start_section

        lines += ([""] if lines else []) + start_section(args.quick)
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
