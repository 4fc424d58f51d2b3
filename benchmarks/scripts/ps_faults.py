"""Faults in parameter-server training (issue 24): examples/train_ps.py as a convoy job of roles (2 parameter
servers, 2 async workers), run fault-free, with worker 1 SIGKILLed in the middle of a data shard, and with
parameter server 0 SIGKILLed mid-training (it holds pushes its newest snapshot lacks, so some must be resent).

Counted per run, from the job's own output and the master's record: the job succeeds; every batch of the epoch
is applied exactly once on every server (each push is tagged with its batch's index and each server counts the
tags it applied: ``PSClient.tally``, printed by the chief as ``exactly once: ...``); the held-out AUC lies within
0.005 of the median of the fault-free runs. For a worker kill, the master's ``shard_requeued`` event shows that
the worker held an unfinished shard (a kill between shards is run again); the recovery time is from the kill to the
replacement process's ``role_started`` event.
"""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from convoy.control.store import read_status  # noqa: E402
from convoy.control.token import TOKEN_FILE, read_token  # noqa: E402
from convoy.parallel.transport import Connection, ConnectionLost, Credentials, Identity, Message  # noqa: E402
from convoy.worker.role_env import service_secret  # noqa: E402

EXAMPLE = REPO / "examples" / "train_ps.py"
STEPS, SHARD = 300, 10
"""The epoch is 2 x STEPS batches, handed out in shards of SHARD batches."""
ARGS = ["--steps", str(STEPS), "--shard-batches", str(SHARD), "--batch", "256", "--rows", "20000",
        "--held-out", "16384", "--snapshot-every", "5"]
AUC_TOL = 0.005
EXACT = re.compile(r"\[worker0\]: exactly once: each of the (\d+) batches applied once on each of (\d+) servers "
                   r"\((\d+) repeated pushes skipped\)")
AUC = re.compile(r"\[worker0\]: held-out AUC ([\d.]+)")
REQUEUED = re.compile(r"shard (\d+) items \[(\d+), (\d+)\) back in the queue")


class Job:
    """One ``convoy run`` of the example (by default with 2 servers and 2 workers; ``command``: what follows
    ``convoy run --run-dir D`` instead); its output is collected on a thread."""

    def __init__(self, run_dir: Path, command: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        self.run_dir = run_dir
        env = {**(env or os.environ), "PYTHONPATH": str(REPO)}
        command = command or ["--ps", "2", "--workers", "2", "--stop-grace", "1", str(EXAMPLE), *ARGS]
        self.proc = subprocess.Popen([sys.executable, "-m", "convoy", "run", "--run-dir", str(run_dir), *command],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait(self, timeout: float = 300.0) -> tuple[int, str]:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGINT)
            code = self.proc.wait(60)
            self.lines.append(f"benchmark: the job ran past {timeout:.0f} s and was interrupted\n")
        self.reader.join(10)
        return code, "".join(self.lines)


def wait_for(predicate, timeout: float, what: str, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def ps_status(run_dir: Path, rank: int, workers: tuple[int, ...] = (0, 1)) -> dict | None:
    """PS ``rank``'s status (version, pid, the first worker's applied and kept pushes, and by worker rank the pushes
    of each of ``workers`` it applied), None while it cannot be asked."""
    log = run_dir / "logs" / "roles" / f"ps{rank}.log"
    ports = re.findall(rf"parameter server {rank} serving on port (\d+)", log.read_text()) if log.exists() else []
    if not ports:
        return None
    owner = Credentials(bytes.fromhex(service_secret(read_token(run_dir / TOKEN_FILE))), Identity("bench", 0, 0))
    try:  # the job's owner asks, as its token lets it: the PS serves only callers that prove the job's secret
        connection = Connection(f"127.0.0.1:{ports[-1]}", timeout=5, credentials=owner)
    except ConnectionLost:
        return None
    try:
        metas = [connection.request(Message("status", {"worker": f"worker{w}"})).meta for w in workers]
    except ConnectionLost:
        return None
    finally:
        connection.close()
    return {**metas[0], "unkept": any(m["applied"] > m["kept"] for m in metas),
            "by_worker": {w: m["applied"] for w, m in zip(workers, metas, strict=True)}}


def role_pid(run_dir: Path, role: str, rank: int) -> int | None:
    """The pid of the newest process of ``role`` ``rank``, from the master's role_started events (a process forked
    from its node's fork server keeps the server's command line and environment in /proc)."""
    try:
        events = read_status(run_dir, recent=100_000)["events"]
    except (OSError, KeyError, ValueError, sqlite3.Error):  # not there yet, or being created
        return None
    pids = [int(m[1]) for e in events if e["kind"] == "role_started"
            and (m := re.match(rf"{role} {rank} is running.* pid (\d+)\)", e["message"]))]
    return pids[-1] if pids else None


def inject(job: Job, fault: str) -> float:
    """Wait until a third of the epoch's pushes are in, then SIGKILL the fault's process; returns the kill time
    (wall clock, as the master's events)."""
    pushes = 2 * STEPS // 3
    if fault == "worker_kill":
        wait_for(lambda: (ps_status(job.run_dir, 0) or {}).get("version", 0) >= pushes, 120, f"{pushes} pushes")
        pid = wait_for(lambda: role_pid(job.run_dir, "worker", 1), 10, "worker 1's process")
    else:  # ps_kill: with a push the newest snapshot lacks, so the workers must resend it
        status = wait_for(lambda: (s := ps_status(job.run_dir, 0)) and s["version"] >= pushes and s["unkept"] and s,
                          120, f"ps 0 at {pushes} pushes with an unkept one")
        pid = status["pid"]
    os.kill(pid, signal.SIGKILL)
    return time.time()


def one_run(fault: str, run_dir: Path) -> dict:
    job = Job(run_dir)
    killed_at = inject(job, fault) if fault != "none" else None
    code, out = job.wait()
    exact, auc = EXACT.search(out), AUC.search(out)
    events = read_status(run_dir, recent=2000)["events"] if (run_dir / "state.db").exists() else []
    result = {"fault": fault, "code": code, "succeeded": code == 0 and "job succeeded" in out,
              "exact": bool(exact) and int(exact.group(1)) == 2 * STEPS and "NOT trained exactly once" not in out,
              "repeats": int(exact.group(3)) if exact else None, "auc": float(auc.group(1)) if auc else None,
              "tail": out.strip().splitlines()[-3:] if out.strip() else [], "mid_shard": None, "recover_s": None}
    if killed_at is not None:
        role = "worker 1" if fault == "worker_kill" else "ps 0"
        started = [e["ts"] for e in events if e["kind"] == "role_started" and e["ts"] > killed_at
                   and role in e["message"]]
        result["recover_s"] = min(started) - killed_at if started else None
    if fault == "worker_kill":
        back = [REQUEUED.search(e["message"]) for e in events if e["kind"] == "shard_requeued"]
        back = [m for m in back if m]
        # mid-shard: the worker held a shard it had not finished (a kill between shards gives nothing back); a
        # part given back that starts off a shard boundary is what was left after the progress it had reported
        result["mid_shard"] = bool(back)
        result["given_back"] = [f"[{m.group(2)}, {m.group(3)})" for m in back]
    return result


def faults_section(quick: bool = False) -> list[str]:
    runs = {"none": 1 if quick else 3, "worker_kill": 1 if quick else 5, "ps_kill": 1 if quick else 5}
    results: dict[str, list[dict]] = {fault: [] for fault in runs}
    with tempfile.TemporaryDirectory(prefix="convoy-bench-ps-faults-") as tmp:
        order = [fault for i in range(max(runs.values())) for fault in runs if i < runs[fault]]
        for index, fault in enumerate(order):
            for attempt in range(3):
                result = one_run(fault, Path(tmp) / f"run{index}-{attempt}")
                if fault != "worker_kill" or result["mid_shard"] or not result["succeeded"]:
                    break
                print(f"  {fault}: the kill came between shards ({result['given_back']}); run again", flush=True)
            results[fault].append(result)
            print(f"  {fault} run {len(results[fault])}: exit {result['code']}, exactly once {result['exact']}, "
                  f"repeated pushes skipped {result['repeats']}, AUC {result['auc']}, given back "
                  f"{result.get('given_back', '-')}, recovered in "
                  f"{'-' if result['recover_s'] is None else format(result['recover_s'], '.2f')} s"
                  + ("" if result["succeeded"] else f"; last lines: {result['tail']}"), flush=True)
    clean = [r["auc"] for r in results["none"] if r["auc"] is not None]
    reference = statistics.median(clean) if clean else float("nan")
    lines = [f"examples/train_ps.py, 2 parameter servers, 2 workers: {2 * STEPS} batches x 256 in shards of {SHARD}, "
             f"snapshots every 5 steps; a kill comes once a third of the pushes are in",
             f"fault-free AUC: {' '.join(f'{a:.4f}' for a in clean)} (median {reference:.4f})", "",
             f"{'fault':12} {'runs':>5} {'finished':>9} {'exactly once':>13} {'mid-shard':>10} {'repeats':>8} "
             f"{'median AUC':>11} {'worst gap':>10} {'recover s':>10}"]
    verdicts = []
    for fault in ("worker_kill", "ps_kill"):
        rs = results[fault]
        aucs = [r["auc"] for r in rs if r["auc"] is not None]
        gap = max((abs(a - reference) for a in aucs), default=float("inf"))
        finished, exact = sum(r["succeeded"] for r in rs), sum(r["exact"] for r in rs)
        mid = sum(bool(r["mid_shard"]) for r in rs) if fault == "worker_kill" else None
        recover = [r["recover_s"] for r in rs if r["recover_s"] is not None]
        lines.append(f"{fault:12} {len(rs):5} {finished:>5}/{len(rs)} {exact:>9}/{len(rs)} "
                     f"{'-' if mid is None else f'{mid}/{len(rs)}':>10} "
                     f"{sum(r['repeats'] or 0 for r in rs):8} "
                     f"{statistics.median(aucs) if aucs else float('nan'):11.4f} {gap:10.4f} "
                     f"{statistics.median(recover) if recover else float('nan'):10.2f}")
        good = finished == exact == len(rs) and gap <= AUC_TOL and (mid is None or mid == len(rs))
        verdicts.append(f"target ps_faults_{fault}: {finished}/{len(rs)} finished, {exact}/{len(rs)} exactly once"
                        + (f", {mid}/{len(rs)} mid-shard" if mid is not None else "")
                        + f", worst AUC gap {gap:.4f} (goal all, all, <= {AUC_TOL}) {'met' if good else 'missed'}")
    lines.append("(repeats: pushes the servers skipped as already applied, summed over the runs; recover: kill to "
                 "the replacement's start, median)")
    return lines + [""] + verdicts


if __name__ == "__main__":
    print("\n".join(faults_section("--quick" in sys.argv)))
