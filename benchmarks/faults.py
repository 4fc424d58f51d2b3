"""Fault matrix: a seeded 2-node DDP job, run N times per fault with one injected fault each.

    python benchmarks/faults.py [--quick] [--runs N] [--faults worker_kill,agent_kill,...]

The original five faults run 10 times each, the five of issue 22 (``scripts/fault_cases.py``:
``stale_agent``, ``full_run_dir``, ``full_dev_shm``, ``lost_join_reply``, ``flapping_node``, each
with its defined outcome and a time bound per run) and the two of issue 47
(``scripts/forkserver_cases.py``: ``forkserver_kill``, ``forkserver_stop``: a node's fork server
SIGKILLed, or SIGSTOPped and its worker SIGKILLed; exit 0, 0 steps lost, no restart spent beyond
the injected kill's) 5 times each; ``--runs`` sets both, ``--quick`` 1.

Faults (run i hits rank, or node rank, i % 2): ``worker_kill`` (SIGKILL a worker of a 2-node
job), ``agent_kill`` (SIGKILL an agent of an elastic ``--nnodes 1:2 --relaunch`` job: it
shrinks at once, then grows back when the relaunched agent is warm), ``master_kill`` (SIGKILL
the master; ``convoy run`` restarts it from the run dir while the workers train on),
``link_cut`` (master and agents in network namespaces, each agent with its own /dev/shm as on
its own host; a node's link is down until the shrunk job trains, then restored and the job
grows back; skipped where ``ip netns add`` fails), ``corrupt_request`` (garbage, wrong
tokens, malformed, oversize and half-open requests to the master's API while the job trains).

Per fault it prints runs, recovered (the job exits 0 and trains after the fault), finished
steps lost (a restart that resumes at step S while step >= S had finished on every rank of its
round: the steps redone; a step a killed rank had not finished yet is redone exactly, not lost),
and the time to recover: fault -> the first step finished by the restarted workers; for a
master kill (workers train through it) fault -> the restarted master answers again; 0 for
corrupt requests that leave the job untouched. For the faults of issue 22, recovered means the
outcome the fault must have, and recover the time to it. Then one ``target ...`` line per target,
``no_leftovers`` over every run. Exits 0 whether targets are met or missed; non-zero only if the benchmark
itself breaks.
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from fault_cases import CASES as ISSUE22_CASES, RUN as RUN_ISSUE22, CaseOutcome, case_problem
from fault_job import LEFTOVERS, Job, LocalJob, master_serving, wait_for
from fault_targets import report_case_targets
from forkserver_cases import FORKSERVER_CASES, RUN_FORKSERVER
from steplog import Step, first, steps_lost
from fault_net import NetJob, netns_problem
from fault_requests import barrage

ORIGINAL = ("worker_kill", "agent_kill", "master_kill", "link_cut", "corrupt_request")
CASES = ISSUE22_CASES + FORKSERVER_CASES
RUN_CASE = {**RUN_ISSUE22, **RUN_FORKSERVER}
FAULTS = ORIGINAL + CASES
RUNS = {"original": 10, "case": 5}
GOAL_S = {"worker_kill": 3.0, "agent_kill": 3.0, "master_kill": 5.0}
SEED = 1234
STEP_SLEEP_S = 0.05
WARM_SETTLE_S = 6.0  # with standbys of their own (no fork server), agents refill them 5 s into a round
SETTLE_S = 2.0
LINK_HEARTBEAT_TIMEOUT_S = 3.0
MIN_CUT_S = 4.0
GARBAGE_S = 3.0
TIMEOUT_S = {"ready": 120.0, "recover": 60.0, "grow": 90.0, "exit": 60.0}


@dataclass
class Injected:
    at: float
    """Wall time of the fault."""
    ended: float
    """Wall time the fault was over (link restored, last bad request answered)."""
    served_at: float | None = None
    detail: str = ""
    answers: Counter[str] = field(default_factory=Counter)


@dataclass
class Outcome:
    recovered: bool
    lost: int
    recover_s: float | None
    pause_s: float | None
    """Longest time without a finished step, from the fault until 1 s after the recovery."""
    regrown_s: float | None = None
    restarted: bool = False
    detail: str = ""
    answers: Counter[str] = field(default_factory=Counter)


def longest_pause(steps: list[Step], start: float, end: float) -> float | None:
    """The longest gap between finished steps (or from ``start``) within [start, end]."""
    times = [start] + [s.t for s in steps if start < s.t <= end]
    return max((b - a for a, b in itertools.pairwise(times)), default=None)


def kill(proc: psutil.Process | None, what: str) -> float:
    """SIGKILL a process; the wall time it was sent."""
    if proc is None:
        raise RuntimeError(f"no {what} to kill")
    at = time.time()
    proc.send_signal(signal.SIGKILL)
    return at


def inject_worker_kill(job: Job, index: int) -> Injected:
    rank = index % 2
    victim = job.steps.current()[rank].pid
    at = kill(psutil.Process(victim), "worker")
    return Injected(at, at, detail=f"rank {rank}")


def inject_agent_kill(job: Job, index: int) -> Injected:
    assert isinstance(job, LocalJob)
    node_rank = index % 2
    node_id = job.node_holding(node_rank)
    at = kill(job.child("agent", node_id or "?"), f"agent of node rank {node_rank}")
    return Injected(at, at, detail=f"node rank {node_rank} ({node_id})")


def inject_master_kill(job: Job, index: int) -> Injected:
    assert isinstance(job, LocalJob)
    url, token = job.master_url(), job.token()
    master = job.child("master")
    at = kill(master, "master")
    assert master is not None and url is not None
    try:
        master.wait(10)  # not serving from the old process: wait until it is gone
    except (psutil.TimeoutExpired, psutil.Error):
        pass
    served = wait_for(job, lambda: time.time() if master_serving(url, token) else None, TIMEOUT_S["recover"])
    return Injected(at, at, served_at=served)


def inject_link_cut(job: Job, index: int) -> Injected:
    assert isinstance(job, NetJob)
    node_rank = index % 2
    node_id = job.node_holding(node_rank)
    if node_id is None:
        raise RuntimeError(f"no node holds node rank {node_rank}")
    agent = int(node_id.removeprefix("ns"))
    fault_round = max(s.round_id for s in job.steps.steps)
    at = time.time()
    job.net.set_link(agent, up=False)
    wait_for(job, lambda: first(job.steps.steps, lambda s: s.t > at and s.round_id > fault_round), TIMEOUT_S["recover"])
    time.sleep(max(0.0, at + MIN_CUT_S - time.time()))
    job.net.set_link(agent, up=True)
    return Injected(at, time.time(), detail=f"node rank {node_rank} ({node_id})")


def inject_corrupt_request(job: Job, index: int) -> Injected:
    url, token = job.master_url(), job.token()
    assert url is not None
    host, port = url.rsplit(":", 1)
    at = time.time()
    answers = barrage(host, int(port), token, GARBAGE_S, SEED + index, during=job.steps.poll)
    served = time.time() if master_serving(url, token, timeout_s=5.0) else None
    return Injected(at, time.time(), served_at=served, answers=answers)


INJECT: dict[str, Callable[[Job, int], Injected]] = {
    "worker_kill": inject_worker_kill, "agent_kill": inject_agent_kill, "master_kill": inject_master_kill,
    "link_cut": inject_link_cut, "corrupt_request": inject_corrupt_request,
}


def start_job(fault: str, tmp: Path) -> Job:
    if fault == "link_cut":
        return NetJob(tmp, STEP_SLEEP_S, SEED, LINK_HEARTBEAT_TIMEOUT_S)
    return LocalJob(tmp, elastic=fault == "agent_kill", sleep_s=STEP_SLEEP_S, seed=SEED)


def run_once(fault: str, index: int, tmp: Path) -> Outcome:
    """Start the job, wait until it trains, inject the fault, let it recover and finish, measure."""
    job = start_job(fault, tmp)
    try:
        warm = fault in ("worker_kill", "agent_kill", "link_cut")
        if not wait_for(job, lambda: job.ready(WARM_SETTLE_S if warm else SETTLE_S, warm) or None, TIMEOUT_S["ready"]):
            return Outcome(False, 0, None, None, detail=f"never trained: {job.last_error()}")
        fault_round = max(s.round_id for s in job.steps.steps)
        try:
            injected = INJECT[fault](job, index)
        except (RuntimeError, psutil.Error) as exc:
            return Outcome(False, 0, None, None, detail=f"could not inject: {exc}")
        if fault in ("worker_kill", "agent_kill", "link_cut"):  # restarted workers train
            wait_for(job, lambda: first(job.steps.steps, lambda s: s.t > injected.at and s.round_id > fault_round),
                     TIMEOUT_S["recover"])
        regrown = None
        if fault in ("agent_kill", "link_cut"):  # the lost node comes back: rank 1 trains again
            regrown = wait_for(job, lambda: first(job.steps.steps, lambda s: s.t > injected.ended and s.rank == 1
                                                  and s.round_id > fault_round + 1), TIMEOUT_S["grow"])
        settled = time.time() + 1.0  # a second more of training, then end the job
        wait_for(job, lambda: first(job.steps.steps, lambda s: s.t > settled), 30.0)
        job.request_stop()
        code = wait_for(job, job.exit_code, TIMEOUT_S["exit"])
        job.steps.poll()
        return measure(fault, job, injected, fault_round, code, regrown)
    finally:
        job.stop()


def measure(fault: str, job: Job, injected: Injected, fault_round: int, code: int | None,
            regrown: Step | None) -> Outcome:
    steps = job.steps.steps
    restarted = first(steps, lambda s: s.t > injected.at and s.round_id > fault_round)
    trained_after = first(steps, lambda s: s.t > injected.ended) is not None
    recovered = code == 0 and trained_after
    if fault == "master_kill":
        recover_at = injected.served_at
        recovered = recovered and recover_at is not None
    elif fault == "corrupt_request":
        master_restarted = "restarting it" in job.console.read_text(errors="replace")
        untouched = restarted is None and not master_restarted and injected.served_at is not None
        recover_at = injected.at if untouched else None
        recovered = recovered and untouched
    else:
        recover_at = restarted.t if restarted is not None else None
        recovered = recovered and recover_at is not None
    recover_s = None if recover_at is None else recover_at - injected.at
    end = max(injected.ended, recover_at or injected.ended) + 1.0
    detail = injected.detail if code == 0 else f"{injected.detail}; exit {code}: {job.last_error()}"
    return Outcome(recovered, steps_lost(steps), recover_s, longest_pause(steps, injected.at, end),
                   regrown.t - injected.at if regrown else None, restarted is not None, detail, injected.answers)


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def report(results: dict[str, list[Outcome]], skipped: dict[str, str], runs: dict[str, int], elapsed: float,
           left: dict[str, list[str]]) -> None:
    print(f"\nfault matrix: 2 nodes x 1 worker, gloo DDP (fault_train.py, seed {SEED}, {STEP_SLEEP_S} s sleep per "
          f"step), {runs['original']} run(s) per original fault, {runs['case']} per fault case (issues 22 and 47); "
          f"{elapsed:.0f} s in all")
    print("recovered: exit 0 and trained after the fault; lost: finished steps redone after a restart;")
    print("recover: fault -> first step of the restarted workers (master_kill: -> master answers again;")
    print("corrupt_request: 0 when the job was untouched); pause: longest time without a finished step")
    if any(f in results for f in CASES):
        print("fault cases (issues 22 and 47): recovered = the outcome the fault must have (below), recover: "
              "fault -> it")
    print(f"{'fault':<17}{'runs':>5}{'recovered':>11}{'lost total':>11}{'lost max':>9}{'median recover (s)':>20}"
          f"{'max recover (s)':>17}{'median pause (s)':>18}")
    for fault, outcomes in results.items():
        ok = sum(o.recovered for o in outcomes)
        lost = [o.lost for o in outcomes]
        times = [o.recover_s for o in outcomes]
        print(f"{fault:<17}{len(outcomes):>5}{f'{ok}/{len(outcomes)}':>11}{sum(lost):>11}{max(lost, default=0):>9}"
              f"{fmt(median(times)):>20}{fmt(max((t for t in times if t is not None), default=None)):>17}"
              f"{fmt(median([o.pause_s for o in outcomes])):>18}")
    for fault, why in skipped.items():
        print(f"{fault:<17}  skipped: {why}")
    print("per run: time to recover (s) / steps lost")
    for fault, outcomes in results.items():
        print(f"  {fault:<16}" + " ".join(f"{fmt(o.recover_s)}/{o.lost}" for o in outcomes))
    for fault, outcomes in results.items():
        if fault in ("agent_kill", "link_cut"):
            grown = [o.regrown_s for o in outcomes]
            print(f"  {fault}: grew back to 2 nodes in {sum(g is not None for g in grown)}/{len(outcomes)} runs, "
                  f"median {fmt(median(grown))} s after the fault")
        if fault == "master_kill":
            print(f"  master_kill: workers restarted in {sum(o.restarted for o in outcomes)}/{len(outcomes)} runs; "
                  f"longest pause in training {fmt(max((o.pause_s or 0.0) for o in outcomes))} s")
        if fault == "corrupt_request":
            answers = sum((o.answers for o in outcomes), Counter())
            print(f"  corrupt_request: {sum(answers.values())} bad requests, answered "
                  + ", ".join(f"{k} x{v}" for k, v in sorted(answers.items())))
    for fault, outcomes in results.items():
        if fault in CASES:
            print(f"  {fault}: " + "; ".join(f"{count} x {what}" for what, count in
                                             Counter(o.result for o in outcomes).most_common()))  # type: ignore[attr-defined]
    print("left behind by the jobs (processes, /dev/shm segments): " + (", ".join(LEFTOVERS) or "nothing"))
    print()
    for fault, goal in GOAL_S.items():
        outcomes = results.get(fault, [])
        ok, lost, med = sum(o.recovered for o in outcomes), sum(o.lost for o in outcomes), \
            median([o.recover_s for o in outcomes])
        good = bool(outcomes) and ok == len(outcomes) and lost == 0 and med is not None and med <= goal
        measured = (f"{ok}/{len(outcomes)} recovered, {lost} steps lost, median {fmt(med)} s" if outcomes
                    else f"not run ({skipped.get(fault, 'not selected')})")
        print(f"target {fault}: {measured} (goal all, 0, <= {goal:.0f} s) {'met' if good else 'missed'}")
    every = [o for fault in ORIGINAL for o in results.get(fault, [])]
    ok, lost = sum(o.recovered for o in every), sum(o.lost for o in every)
    missing = [f for f in ORIGINAL if f not in results]
    note = f"; not run: {', '.join(missing)}" if missing else ""
    good = bool(every) and ok == len(every) and lost == 0 and not missing
    print(f"target all_faults: {ok}/{len(every)} runs recovered, {lost} steps lost{note} (goal all {len(ORIGINAL)} "
          f"faults, all recovered, 0) {'met' if good else 'missed'}")
    report_case_targets(CASES, results, skipped, left)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke-test size: 1 run per fault")
    parser.add_argument("--runs", type=int, default=None,
                        help="runs per fault (default 10 for the original five, 5 for issue 22's; quick 1)")
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated subset of {','.join(FAULTS)}")
    args = parser.parse_args()
    runs = {group: args.runs if args.runs is not None else (1 if args.quick else default)
            for group, default in RUNS.items()}
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown or min(runs.values()) < 1:
        parser.error(f"unknown fault(s) {unknown}; choose from {','.join(FAULTS)}" if unknown
                     else "--runs must be >= 1")
    skipped: dict[str, str] = {}
    if "link_cut" in faults:
        problem = netns_problem()
        if problem:
            print(f"skipping link_cut: {problem}", flush=True)
            skipped["link_cut"] = problem
            faults.remove("link_cut")
    for fault in [f for f in faults if f in CASES]:
        why = case_problem(fault)
        if why:
            print(f"skipping {fault}: {why}", flush=True)
            skipped[fault] = why
            faults.remove(fault)
    tmp = Path(tempfile.mkdtemp(prefix="convoy-bench-faults-"))
    began = time.monotonic()
    results: dict[str, list[Outcome]] = {}
    left: dict[str, list[str]] = {}
    kept: list[Path] = []
    try:
        for fault in faults:
            results[fault] = []
            count = runs["case" if fault in CASES else "original"]
            for index in range(count):
                before = len(LEFTOVERS)
                outcome: Outcome | CaseOutcome
                if fault in CASES:
                    outcome = RUN_CASE[fault](tmp / f"{fault}-{index}", index, STEP_SLEEP_S, SEED)
                else:
                    outcome = run_once(fault, index, tmp / f"{fault}-{index}")
                results[fault].append(outcome)  # type: ignore[arg-type]
                left.setdefault(fault, []).extend(LEFTOVERS[before:])
                state = "recovered" if outcome.recovered else "NOT recovered"
                what = f", {outcome.result}" if isinstance(outcome, CaseOutcome) else ""
                print(f"  {fault} {index + 1}/{count}: {state}{what}, {outcome.lost} steps lost, recover "
                      f"{fmt(outcome.recover_s)} s, pause {fmt(outcome.pause_s)} s"
                      + (f" ({outcome.detail})" if outcome.detail else ""), flush=True)
                if not outcome.recovered:
                    kept.append(tmp / f"{fault}-{index}")
    finally:
        for path in sorted(set(tmp.iterdir()) - set(kept)) if tmp.is_dir() else []:
            shutil.rmtree(path, ignore_errors=True)
        if kept:  # a run that went wrong keeps its run dir (logs, state.db, step files) for a look
            print(f"kept the run dirs of {len(kept)} run(s) that went wrong: " + ", ".join(map(str, kept)), flush=True)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    report(results, skipped, runs, time.monotonic() - began, left)
    return 0


if __name__ == "__main__":
    sys.exit(main())
