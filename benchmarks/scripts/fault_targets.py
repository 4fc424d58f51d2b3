"""The target lines of benchmarks/faults.py's fault cases (issue 22's and issue 47's fork-server faults), then
``no_leftovers`` over every run of every fault."""

from __future__ import annotations

import statistics

from fault_cases import PERSIST_EVERY
from fault_outcome import RUN_BOUND_S, CaseOutcome

CASE_GOALS = {
    "stale_agent": "all go on, fenced, readmitted, 0 lost",
    "full_run_dir": "all end within the bound: finished with 0 lost, or failed with one line",
    "full_dev_shm": "all say snapshots off and resume from the newest persistent save, 0 lost before it",
    "lost_join_reply": "all finish, 0 extra restarts, 0 lost",
    "flapping_node": "all exclude the node with a message and finish, 0 lost",
    "forkserver_kill": "all finish, 0 lost, 0 restarts spent, the fault named, the old server gone",
    "forkserver_stop": "all finish, 0 lost, 0 restarts spent beyond the killed worker's one, the fault named, "
                       "the old server gone",
}


def report_case_targets(cases: tuple[str, ...], results: dict[str, list], skipped: dict[str, str],
                        left: dict[str, list[str]]) -> None:
    """One target line per fault case, then ``no_leftovers`` over every run of every fault in ``results``."""
    for fault in cases:
        outcomes: list[CaseOutcome] = results.get(fault, [])
        if not outcomes:
            print(f"target {fault}: not run ({skipped.get(fault, 'not selected')}) (goal {CASE_GOALS[fault]}) missed")
            continue
        ok, hung = sum(o.recovered for o in outcomes), sum(not o.ended for o in outcomes)
        lost = sum(o.lost for o in outcomes)
        words = f"{lost} steps lost"
        if fault == "full_dev_shm":
            words += (f" before the newest persistent save, max {max(o.redone for o in outcomes)} redone after "
                      f"it (saves every {PERSIST_EVERY} steps)")
        if fault == "full_run_dir":
            finished = sum(o.result == "finished" for o in outcomes)
            words += f", {finished} finished, {sum(o.result.startswith('failed') for o in outcomes)} failed"
        if fault.startswith("forkserver_"):
            times = [o.recover_s for o in outcomes if o.recover_s is not None]
            words += (f", {sum(o.restarts for o in outcomes)} restarts spent beyond the fault's own, median recover "
                      + (f"{statistics.median(times):.2f} s" if times else "-"))
        good = ok == len(outcomes) and hung == 0
        print(f"target {fault}: {ok}/{len(outcomes)} as required, {hung} hung (bound {RUN_BOUND_S:.0f} s), "
              f"{words} (goal {CASE_GOALS[fault]}) {'met' if good else 'missed'}")
    ran = sum(len(o) for o in results.values())
    things = [thing for fault in results for thing in left.get(fault, [])]
    per_fault = ", ".join(f"{fault} {len(left[fault])}" for fault in results if left.get(fault))
    print(f"target no_leftovers: {len(things)} processes or /dev/shm entries left after {ran} runs"
          + (f" ({per_fault})" if per_fault else "") + f" (goal 0) {'met' if ran and not things else 'missed'}")
