"""Live training config benchmark (issue 27): how fast a new config reaches every rank of a running job, that
every rank switches at the same step, that a live change equals one scheduled in advance bit for bit, and what
``convoy.report`` costs per step.

(1) hot_latency, restart_latency, same_step: one 2-node x 2-worker job of benchmarks/scripts/live_worker.py
    (the live-config example's DDP regression, a step of ~50 ms sleep); N ``PUT /v1/config`` of ``lr``, one at a
    time, each timed from just before the PUT to the moment the last rank started its first step with the new
    value (the ``started`` column of the rank logs); then M of the restart field ``batch_size``, timed to the
    last rank starting the version's step in the new round. Every rank's log is then checked against the
    versions: each switched at its ``at_step``, each rank ran steps 0..N-1 once.
(2) exactness: run A takes ``lr`` 0.01 -> 0.003 live (at step S, the master's choice), run B the same job
    with the change given at the start for ``at_step`` S; both end at S + K. Loss traces of every rank and
    rank 0's final parameters are compared bit for bit.
(3) report_overhead: 1-node, 1-worker jobs with a step of ~50 ms of matmuls, ``convoy.report`` each step on
    and off, interleaved; time inside ``convoy.report`` on the training thread, and CPU time of convoy's
    ``convoy-report`` sender thread per step.
(4) divergence_detect, divergence_rollback: scripts/live_divergence.py (an injected 100x lr, --auto-apply
    divergence, against a control run).
DLRover's ParalConfigTuner is run (scripts/live_dlrover.py) when an interpreter with ``dlrover`` is given or
this one imports it. Everything is written under one temp dir, removed at the end. Exits 0 whether targets
are met or missed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from convoy.control.store import read_status  # noqa: E402
import live_divergence  # noqa: E402
from live_jobs import Job, first_start, percentile, same_step, step_time  # noqa: E402
from live_worker import COMPUTE_N  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEP_SLEEP = 0.05
HOT_ROUND = "steps=100000"


def fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def met(ok: bool) -> str:
    return "met" if ok else "missed"


def header(argv: list[str]) -> None:
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"$ python benchmarks/live_config.py {' '.join(argv)}   ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
          f", {os.cpu_count()} shared cores, commit {commit}{' + uncommitted edits' if dirty else ''}, load average "
          f"{load} at the start)", flush=True)


def live_changes(tmp: Path, hot_n: int, restart_n: int) -> dict[str, Any]:
    """Section (1): the 2x2 job, its hot and restart changes, the versions, the logs."""
    job = Job(tmp / "changes", 2, 2, [HOT_ROUND], ["--step-time", str(STEP_SLEEP)])
    out: dict[str, Any] = {"hot": [], "restart": [], "breakdown": []}
    try:
        job.wait_step(0)
        job.ensure({"steps": 100000})
        out["unset"] = job.unset
        job.wait_step(10)
        for k in range(hot_n):
            lr = round(0.001 + 0.0001 * k, 6)
            began = time.time()
            answer = job.put({"lr": lr}, reason=f"hot {k}")
            at = answer["at_step"]
            done = job.wait(lambda: first_start(job.rows(), 4, lambda r, lr=lr, at=at: r.step >= at and r.lr == lr),
                            60, f"lr={lr} on every rank")
            out["hot"].append((done - began, at))
            print(f"  hot {k + 1}/{hot_n}: lr={lr} from step {at}, {done - began:.3f} s", flush=True)
            job.wait_active(answer["number"])
        for k in range(restart_n):
            batch = 40 + 8 * k
            seen = len(job.events())
            began = time.time()
            answer = job.put({"batch_size": batch}, reason=f"restart {k}")
            at = answer["at_step"]
            done = job.wait(lambda: first_start(job.rows(), 4, lambda r, b=batch, at=at: r.step == at and r.batch == b),
                            120, f"batch_size={batch} on every rank")
            out["restart"].append((done - began, at))
            events = [e for e in job.events()[seen:] if e["kind"] in
                      ("config_set", "reconfigure", "round_closed", "node_joined", "config_applied")]
            out["breakdown"].append(", ".join(f"{e['kind']} {e['ts'] - began:+.2f}" for e in events))
            print(f"  restart {k + 1}/{restart_n}: batch_size={batch} from step {at}, {done - began:.3f} s "
                  f"(events, s after the PUT: {out['breakdown'][-1]}; last rank's first step "
                  f"{done - began:+.2f})", flush=True)
            job.wait_active(answer["number"])
        stop = job.put({"steps": 1}, reason="end")
        out["stop_at"] = stop["at_step"]
        out["versions"] = job.api("GET", "/config")["versions"]
        out["exit"] = job.finish()
        out["rows"] = job.rows()
        out["step_time"] = step_time(out["rows"])
        out["restart_count"] = read_status(job.run_dir, recent=0)["job"]["restart_count"]
    finally:
        job.stop()
    return out


def exactness(tmp: Path, settle: int, tail: int) -> dict[str, Any]:
    """Section (2): run A (live) and run B (scheduled in advance at A's step)."""
    a = Job(tmp / "exact-a", 2, 2, [HOT_ROUND], ["--step-time", str(STEP_SLEEP), "--out", str(tmp / "a.pt")])
    try:
        a.wait_step(0)
        a.ensure({"steps": 100000})
        a.wait_step(settle)
        at = a.put({"lr": 0.003}, reason="live")["at_step"]
        end = at + tail
        a.put({"steps": end}, reason="end")
        code_a = a.finish()
    finally:
        a.stop()
    print(f"  run A: lr 0.01 -> 0.003 live, the master chose step {at}; ends at step {end}; exit {code_a}", flush=True)
    b = Job(tmp / "exact-b", 2, 2, [f"steps={end}"], ["--step-time", str(STEP_SLEEP), "--out", str(tmp / "b.pt")])
    try:
        b.wait_step(0)
        b.ensure({"steps": end})
        given_at = b.newest_step()
        b.put({"lr": 0.003}, at_step=at, reason="scheduled")
        code_b = b.finish()
    finally:
        b.stop()
    print(f"  run B: the same change given (at_step {at}) when every rank had run step {given_at}; "
          f"exit {code_b}", flush=True)
    ra, rb = a.rows(), b.rows()
    traces = sum(1 for rank in range(4) if [r.loss for r in ra.get(rank, [])] == [r.loss for r in rb.get(rank, [])]
                 and len(ra.get(rank, [])) == end)
    switched = all(r.lr == (0.003 if r.step >= at else 0.01) for rows in (*ra.values(), *rb.values()) for r in rows)
    pa, pb = torch.load(tmp / "a.pt"), torch.load(tmp / "b.pt")
    equal = sum(torch.equal(pa[name], pb[name]) for name in pa if name in pb)
    differs = [name for name in pa if name in pb and not torch.equal(pa[name], pb[name])]
    control = [float(r.loss) for r in ra[0]][at:at + 3]
    return {"at": at, "end": end, "traces": traces, "tensors": len(pa), "equal": equal, "differs": differs,
            "switched": switched, "exit": (code_a, code_b), "control": control}


def calibrate_reps(target_s: float) -> int:
    torch.set_num_threads(1)
    x = torch.randn(COMPUTE_N, COMPUTE_N) / COMPUTE_N
    y = torch.empty_like(x)
    for _ in range(20):
        torch.mm(x, x, out=y)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(50):
            torch.mm(x, x, out=y)
        times.append((time.perf_counter() - t) / 50)
    return max(1, round(target_s / statistics.median(times)))


def overhead(tmp: Path, pairs: int, steps: int, reps: int) -> dict[str, Any]:
    """Section (3): 1x1 jobs, report on and off in turn; stats of every 'on' run and each run's step time."""
    calls: list[float] = []
    calls_cpu: list[float] = []
    sender: list[tuple[float | None, float | None, int]] = []
    step_s: dict[str, list[float]] = {"on": [], "off": []}
    for pair in range(pairs):
        for mode in (("on", "off") if pair % 2 == 0 else ("off", "on")):
            stats = tmp / f"stats-{mode}-{pair}"
            stats.mkdir()
            job = Job(tmp / f"report-{mode}-{pair}", 1, 1, [f"steps={steps}"],
                      ["--compute-reps", str(reps), "--report", mode, "--stats", str(stats), "--max-steps", str(steps)])
            try:
                code = job.finish(300)
            finally:
                job.stop()
            data = json.loads((stats / "rank0.json").read_text())
            rows = job.rows()[0]
            per = statistics.median(b.started - a.started for a, b in zip(rows[5:], rows[6:]))
            step_s[mode].append(per)
            if mode == "on":
                calls += data["in_report_s"]
                calls_cpu += data.get("in_report_cpu_s", [])
                sender.append((data["sender"]["proc_s"], data["sender"]["clock_s"], data["steps"]))
            print(f"  report {mode:<3} run {pair + 1}/{pairs}: {data['steps']} steps, median step {per * 1e3:.2f} ms"
                  f", exit {code}", flush=True)
    return {"calls": calls, "calls_cpu": calls_cpu, "sender": sender, "step_s": step_s}


def dlrover_peer(site: str | None, tmp: Path, changes: int) -> str:
    """DLRover's tuner, run by scripts/live_dlrover.py (its own polling loop, a stub master) when dlrover imports
    (from this interpreter, or from ``site``, a site-packages dir appended to sys.path)."""
    interval = "its documented polling interval is 30 s (paral_config_tuner.py: time.sleep(30))"
    if not changes:
        return f"DLRover ParalConfigTuner not run (no changes asked for, --quick): {interval}"
    probe = subprocess.run([sys.executable, "-c", f"import sys; sys.path.append({site or ''!r}); "
                            "import dlrover.python.elastic_agent.config.paral_config_tuner"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        reason = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return f"DLRover ParalConfigTuner not run ({reason}; give --dlrover-site): {interval}"
    script = Path(__file__).resolve().parent / "scripts" / "live_dlrover.py"
    done = subprocess.run([sys.executable, str(script), "--changes", str(changes), "--dir", str(tmp / "dlrover"),
                           "--site", site or ""], capture_output=True, text=True, timeout=60 + 50 * changes)
    if done.returncode != 0:
        return f"DLRover run failed ({(done.stderr.strip().splitlines() or ['?'])[-1]}): {interval}"
    print(done.stdout.rstrip(), flush=True)
    return done.stdout.strip().splitlines()[-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke-test size")
    parser.add_argument("--hot", type=int, default=None, help="hot changes (default 20; quick 4)")
    parser.add_argument("--restarts", type=int, default=None, help="restart changes (default 3; quick 1)")
    parser.add_argument("--pairs", type=int, default=None, help="report on/off pairs (default 3; quick 1)")
    parser.add_argument("--report-steps", type=int, default=None, help="steps per report run (default 300; quick 40)")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (run dirs, logs) and print it")
    parser.add_argument("--dlrover-site", default=None, help="a site-packages dir holding dlrover (appended to "
                        "sys.path of the DLRover run; default: this interpreter's own)")
    parser.add_argument("--dlrover-changes", type=int, default=None, help="changes for DLRover (default 3; quick 0)")
    args = parser.parse_args()
    quick = args.quick
    hot_n = args.hot if args.hot is not None else (4 if quick else 20)
    restart_n = args.restarts if args.restarts is not None else (1 if quick else 3)
    pairs = args.pairs if args.pairs is not None else (1 if quick else 3)
    report_steps = args.report_steps if args.report_steps is not None else (40 if quick else 300)
    dl_changes = args.dlrover_changes if args.dlrover_changes is not None else (0 if quick else 3)
    header(sys.argv[1:])
    tmp = Path(tempfile.mkdtemp(prefix="convoy-bench-live-"))
    began = time.monotonic()
    try:
        print(f"(1) 2x2 job, {STEP_SLEEP * 1e3:.0f} ms sleep per step: {hot_n} hot changes of lr, {restart_n} restart "
              "changes of batch_size", flush=True)
        live = live_changes(tmp, hot_n, restart_n)
        print("(2) exactness: run A live, run B scheduled in advance", flush=True)
        exact = exactness(tmp, 15 if quick else 30, 15 if quick else 40)
        reps = calibrate_reps(0.05)
        print(f"(3) report overhead: 1x1 jobs, {reps} matmuls of {COMPUTE_N}^2 per step (~50 ms), {pairs} on/off "
              f"pair(s) of {report_steps} steps", flush=True)
        cost = overhead(tmp, pairs, report_steps, reps)
        peer = dlrover_peer(args.dlrover_site, tmp, dl_changes)
    finally:
        if args.keep:
            print(f"kept {tmp}", flush=True)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    elapsed = time.monotonic() - began

    step = live["step_time"]
    hot = [t for t, _ in live["hot"]]
    restart = [t for t, _ in live["restart"]]
    ok, total, problems, count = same_step(live["rows"], live["versions"])
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\nlive config benchmark, {elapsed:.0f} s in all; load average {load} at the end")
    print(f"(1) measured step time {step * 1e3:.1f} ms (median gap between a rank's step starts); job exit "
          f"{live['exit']}, ended at step {live['stop_at']}, restarts counted {live['restart_count']}")
    print(f"  hot lr, PUT -> last rank starts a step with it (s): {' '.join(fmt(t, 2) for t in hot)}")
    print(f"  restart batch_size, PUT -> last rank starts the version's step in the new round (s): "
          f"{' '.join(fmt(t, 2) for t in restart)}")
    if live.get("unset"):
        print("  note: `convoy run --set steps=100000` was not applied (version 1 kept the default steps=300); the "
              "benchmark set it by a PUT (see the report of this run)")
    for k, line in enumerate(live["breakdown"]):
        print(f"    restart {k + 1}: {line}")
    print(f"  {peer}")
    print(f"(2) exactness: change at step {exact['at']}, end {exact['end']}; loss traces equal on {exact['traces']}/4 "
          f"ranks; rank 0's parameters equal {exact['equal']}/{exact['tensors']} tensors"
          + (f" (differ: {exact['differs']})" if exact["differs"] else "") +
          f"; every step ran the planned lr in both: {exact['switched']}; exits {exact['exit']}")
    calls = cost["calls"]
    med_call = statistics.median(calls) if calls else None
    mean_call = statistics.mean(calls) if calls else None
    cpu_call = statistics.median(cost["calls_cpu"]) if cost["calls_cpu"] else None
    proc = [p / n for p, _, n in cost["sender"] if p is not None and n]
    clock = [c / n for _, c, n in cost["sender"] if c is not None and n]
    sender_step = statistics.median(clock) if clock else (statistics.median(proc) if proc else None)
    on, off = cost["step_s"]["on"], cost["step_s"]["off"]
    print(f"(3) convoy.report: {len(calls)} calls, median {fmt(med_call and med_call * 1e6, 1)} us, mean "
          f"{fmt(mean_call and mean_call * 1e6, 1)} us, max {fmt(max(calls) * 1e3 if calls else None, 2)} ms (the "
          f"training thread's CPU in it: median {fmt(cpu_call and cpu_call * 1e6, 1)} us); sender "
          f"thread CPU per step {fmt(sender_step and sender_step * 1e6, 1)} us (thread clock; /proc utime+stime "
          f"{fmt(statistics.median(proc) * 1e6 if proc else None, 1)} us)")
    print(f"  wall clock, median step: report on {' '.join(fmt(x * 1e3, 2) for x in on)} ms, off "
          f"{' '.join(fmt(x * 1e3, 2) for x in off)} ms (information: run-to-run noise on this machine is larger "
          "than the effect)")
    for line in problems[:10]:
        print(f"  same_step problem: {line}")
    print()

    p50, p95 = percentile(hot, 50), percentile(hot, 95)
    hot_goal = 1.0 + step
    print(f"target hot_latency: p50 {fmt(p50, 2)} s, p95 {fmt(p95, 2)} s over {len(hot)} changes, step {step:.3f} s "
          f"(goal p95 <= {hot_goal:.2f} s = 1 s + one step; DLRover: >= 30 s polling) "
          f"{met(p95 is not None and p95 <= hot_goal and len(hot) == hot_n)}")
    r50, r95 = percentile(restart, 50), percentile(restart, 95)
    restart_goal = 3.0 + step
    print(f"target restart_latency: p50 {fmt(r50, 2)} s, p95 {fmt(r95, 2)} s over {len(restart)} changes "
          f"(goal p95 <= {restart_goal:.2f} s = 3 s + one step) "
          f"{met(r95 is not None and r95 <= restart_goal and len(restart) == restart_n)}")
    lost = [p for p in problems if "lost" in p]
    rank_steps_ok = not lost and count == live["stop_at"]
    share = ok / total if total else 0.0
    print(f"target same_step: {ok}/{total} rank-versions switched at the version's step ({share:.0%}), "
          f"{'0' if rank_steps_ok else 'some'} steps lost or redone ({len(live['rows'])} ranks x {count} steps, "
          f"ended at {live['stop_at']}) (goal 100%, 0) {met(share == 1.0 and rank_steps_ok)}")
    bits = exact["traces"] == 4 and exact["equal"] == exact["tensors"] and exact["switched"]
    print(f"target exactness: loss traces {exact['traces']}/4 ranks equal, parameters {exact['equal']}/"
          f"{exact['tensors']} tensors equal (goal bit for bit) {met(bits)}")
    per_step = (mean_call or 0.0) + (sender_step or 0.0)
    share_step = per_step / 0.05
    print(f"target report_overhead: {per_step * 1e6:.1f} us per step = mean in convoy.report "
          f"{fmt(mean_call and mean_call * 1e6, 1)} us + sender thread CPU {fmt(sender_step and sender_step * 1e6, 1)}"
          f" us, {share_step:.3%} of a 50 ms step (goal < 1%) {met(bool(calls) and share_step < 0.01)}")
    print("(4) " + "\n".join(live_divergence.main(["--repeats", "1" if quick else "3"])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
