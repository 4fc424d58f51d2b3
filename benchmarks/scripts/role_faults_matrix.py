"""The role-fault matrix of ``benchmarks/ps.py --only role_faults`` (issue 47): each case of role_faults.py run N
times (5 by default, 1 with --quick), a line per run as it ends, then the table and one target line per case and
``role_faults_no_leftovers``. A run that went wrong keeps its run dir (logs, state.db) and says where.

    python benchmarks/scripts/role_faults_matrix.py [--quick] [--runs N] [--cases lost_node,...]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from role_faults import BATCHES, CASES, EXPECTED_RESTARTS, RUN_BOUND_S, RoleOutcome, run_case

GOAL = "all finished, all exactly once (0 lost, 0 applied twice), 0 restarts beyond the fault's own"


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def run_line(case: str, number: int, runs: int, o: RoleOutcome, took: float) -> str:
    return (f"  {case} {number}/{runs}: {o.result}, exit {o.code}, exactly once {o.exact} (lost {o.lost}, applied "
            f"twice {o.twice}, repaired {o.repaired}), restarts beyond the fault's {o.restarts}, recover "
            f"{fmt(o.recover_s)} s, AUC {o.auc}, {took:.0f} s; {o.detail}" + (f"; left: {o.left}" if o.left else ""))


def table(results: dict[str, list[RoleOutcome]], elapsed: float) -> list[str]:
    lines = [f"examples/train_ps.py as a job of roles, 2 parameter servers: {BATCHES} batches x 256 in shards of 10, "
             f"snapshots every 5 steps; one fault per run, a third of the way in; {elapsed:.0f} s in all",
             "exact: every batch applied once on every server; lost / twice: batches a server lacks / pushes applied "
             "beyond one per batch, summed; extra: role restarts beyond the fault's own (expected: "
             + ", ".join(f"{c} {n}" for c, n in EXPECTED_RESTARTS.items()) + "); repaired: batches the chief "
             "trained again after the epoch; recover: the fault -> the last process it ended running again", "",
             f"{'case':18} {'runs':>5} {'finished':>9} {'exact':>6} {'lost':>5} {'twice':>6} {'extra':>6} "
             f"{'repaired':>9} {'median rec s':>13} {'max rec s':>10} {'median AUC':>11}"]
    for case, outcomes in results.items():
        n = len(outcomes)
        times = [o.recover_s for o in outcomes]
        aucs = [o.auc for o in outcomes]
        lines.append(f"{case:18} {n:5} {sum(o.finished for o in outcomes):>5}/{n:<3} "
                     f"{sum(o.exact for o in outcomes):>4}/{n} {sum(o.lost or 0 for o in outcomes):5} "
                     f"{sum(o.twice or 0 for o in outcomes):6} {sum(o.restarts or 0 for o in outcomes):6} "
                     f"{sum(o.repaired for o in outcomes):9} {fmt(median(times)):>13} "
                     f"{fmt(max((t for t in times if t is not None), default=None)):>10} "
                     f"{'-' if median(aucs) is None else format(median(aucs), '.4f'):>11}")
    return lines


def targets(results: dict[str, list[RoleOutcome]], chosen: list[str]) -> list[str]:
    lines = []
    for case in CASES:
        outcomes = results.get(case, [])
        if not outcomes:
            lines.append(f"target role_faults_{case}: not run ({'not selected' if case not in chosen else 'none'}) "
                         f"(goal {GOAL}) missed")
            continue
        n = len(outcomes)
        finished, exact = sum(o.finished for o in outcomes), sum(o.exact for o in outcomes)
        hung = sum(o.code is None for o in outcomes)
        lost, twice = sum(o.lost or 0 for o in outcomes), sum(o.twice or 0 for o in outcomes)
        extra = sum(abs(o.restarts) if o.restarts is not None else 1 for o in outcomes)
        good = all(o.good for o in outcomes)
        lines.append(f"target role_faults_{case}: {finished}/{n} finished, {exact}/{n} exactly once ({lost} lost, "
                     f"{twice} applied twice), {extra} restarts beyond the fault's own, {hung} hung (bound "
                     f"{RUN_BOUND_S:.0f} s), median recover {fmt(median([o.recover_s for o in outcomes]))} s "
                     f"(goal {GOAL}) {'met' if good else 'missed'}")
    ran = [o for outcomes in results.values() for o in outcomes]
    left = [thing for o in ran for thing in o.left]
    lines.append(f"target role_faults_no_leftovers: {len(left)} processes or /dev/shm entries left after {len(ran)} "
                 f"runs (goal 0) {'met' if ran and not left else 'missed'}")
    return lines


def role_faults_section(quick: bool = False, runs: int | None = None, cases: list[str] | None = None) -> list[str]:
    """Run the chosen cases (every one by default), printing each run as it ends; the table and the targets."""
    chosen = cases or list(CASES)
    count = runs if runs is not None else (1 if quick else 5)
    results: dict[str, list[RoleOutcome]] = {}
    began = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="convoy-bench-role-faults-"))
    kept: list[Path] = []
    try:
        for case in chosen:
            results[case] = []
            for index in range(count):
                start = time.monotonic()
                outcome = run_case(case, index, tmp / f"{case}-{index}")
                results[case].append(outcome)
                print(run_line(case, index + 1, count, outcome, time.monotonic() - start), flush=True)
                if not outcome.good:
                    kept.append(tmp / f"{case}-{index}")
    finally:
        for path in sorted(set(tmp.iterdir()) - set(kept)) if tmp.is_dir() else []:
            shutil.rmtree(path, ignore_errors=True)
        if kept:
            print(f"kept the run dirs of {len(kept)} run(s) that went wrong: " + ", ".join(map(str, kept)), flush=True)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return table(results, time.monotonic() - began) + [""] + targets(results, chosen)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 run per case")
    parser.add_argument("--runs", type=int, default=None, help="runs per case (default 5; --quick 1)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    args = parser.parse_args()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown or (args.runs is not None and args.runs < 1):
        parser.error(f"unknown case(s) {unknown}; choose from {','.join(CASES)}" if unknown else "--runs must be >= 1")
    print("\n".join(role_faults_section(args.quick, args.runs, cases)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
