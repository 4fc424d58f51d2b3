"""Automatic strategy search (issue 29): the pick against an exhaustive measurement of the feasible grid.

    python benchmarks/strategy.py [--quick]

Four cases of examples/train_strategy.py's transformer: (a) ~20 M parameters on 4 ranks, 1.5 GB per rank;
(b) a model plain DDP does not fit (200 MB per rank, 4 ranks); (c) two hosts of 2 ranks joined by a
shaped link (network namespaces, ``tc``: 1 Gbit/s, 0.5 ms), where a hierarchical allreduce or local SGD
should win; (d) a long sequence (512 tokens) on 2 ranks whose whole batch does not fit without
checkpointing.
Each case runs the search as ``convoy plan`` does (profile, cost model, successive halving over the top 8,
1 timed step each in its first round) and then measures
every feasible candidate the way an exhaustive tuner would (ATorch dry-runs 10 warm-up and 15 profiled
steps a candidate): ``--grid-rounds`` rounds, each candidate built anew in every round with 1 warm-up
and ``--grid-steps`` timed steps, the rounds in rotated order so that a drift of this shared machine's
speed falls on all candidates alike; a candidate's time is the median of all its timed steps. The search's
time is its user's wait: from starting the ranks to their results, less the grid and what only the grid
needed (FSDP's calibration, where the search found no FSDP candidate among those it measures).

Sizing (2 CPU cores): steps of 0.1-2 s, about 8 feasible candidates a case, 3 rounds of 4 timed steps
in the grid; ``--quick`` shrinks the models.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from convoy.strategy.candidates import Hardware, plain_ddp  # noqa: E402
from convoy.strategy.dryrun import run_search  # noqa: E402
from convoy.strategy.memory import ModelFeatures  # noqa: E402
from convoy.strategy.plan import Strategy  # noqa: E402
from convoy.strategy.report import memory_errors, table  # noqa: E402
from convoy.testing.netns import HostNetwork, netns_problem  # noqa: E402

EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "train_strategy.py")
CASES = {
    "a 20M transformer, 1x4, 1.5GB": (Hardware(1, 4, 1.5e9, 2), ["--width", "384", "--layers", "8",
                                                                "--context", "32", "--batch", "8"]),
    "b plain DDP does not fit, 1x4, 200MB": (Hardware(1, 4, 200e6, 2), ["--width", "384", "--layers", "4",
                                                                       "--context", "32", "--batch", "8"]),
    "c two hosts on 1 Gbit/s, 2x2, 1GB": (Hardware(2, 2, 1e9, 2), ["--width", "256", "--heads", "4", "--layers",
                                                                  "4", "--vocab", "4096", "--context", "32", "--batch",
                                                                  "8"]),
    "d long sequence 512, 1x2, 150MB": (Hardware(1, 2, 150e6, 2), ["--width", "128", "--layers", "4", "--heads",
                                                                  "4", "--vocab", "2048", "--context", "512",
                                                                  "--batch", "8"]),
}
QUICK = {"--width": "64", "--layers": "3", "--heads": "2", "--vocab": "1024"}


def quick_args(args: list[str]) -> list[str]:
    out = list(args)
    for flag, value in QUICK.items():
        if flag in out:
            out[out.index(flag) + 1] = value
        else:
            out += [flag, value]
    return out


def key(strategy: dict) -> Strategy:
    return Strategy.from_dict(strategy)


def run_case(name: str, hardware: Hardware, args: list[str], grid_steps: int, grid_rounds: int) -> dict:
    place = None
    net = None
    if hardware.nodes > 1:
        problem = netns_problem()
        if problem:
            print(f"  {name}: no namespaces ({problem}); the ranks share loopback")
        else:
            net = HostNetwork(2, prefix="cvs", second_octet=83).__enter__()
            for host in range(2):
                net.shape(host, "1gbit", "0.5ms")

            def place(rank: int) -> tuple[list[str], dict[str, str]]:
                host = rank // hardware.nproc_per_node
                return net.exec_prefix(host), {"MASTER_ADDR": net.host_address(0),
                                               "GLOO_SOCKET_IFNAME": net.host_link(host)}
    try:
        result = run_search(EXAMPLE, args, hardware, exhaustive_steps=grid_steps, exhaustive_rounds=grid_rounds,
                            place=place)
    finally:
        if net is not None:
            net.__exit__(None, None, None)
    return result


def summarize(name: str, hardware: Hardware, result: dict) -> dict:
    features = ModelFeatures.from_dict(result["features"])
    grid = {key(g["strategy"]): g for g in result.get("exhaustive", [])}
    errors = memory_errors(result)
    runs = [(f"search {key(e['strategy']).name()}", run["peak"]) for e in result.get("measured", [])
            for run in e["runs"]]
    runs += [("FSDP calibration", peak) for peak in result.get("calibration_peaks", [])]
    runs += [(f"grid {name.name()}", peak) for name, g in grid.items() for peak in g.get("peaks", [g["peak"]])]
    over = [(where, peak) for where, peak in runs if peak > hardware.memory_limit]
    for where, peak in over:
        print(f"over the limit: {where} {peak / 1e6:.1f} MB")
    pick = key(result["winner"])
    best = min(grid.values(), key=lambda g: g["seconds"])
    plain = plain_ddp(features)
    feasible_order = [key(r["strategy"]) for r in result["rows"] if not r["dropped"]]
    baseline = plain if plain in grid else feasible_order[0]
    summary = {
        "name": name, "pick": pick.name(), "pick_s": grid[pick]["seconds"], "best": key(best["strategy"]).name(),
        "best_s": best["seconds"], "baseline": baseline.name(), "baseline_s": grid[baseline]["seconds"],
        "worst_mem_error": max(errors, key=lambda e: abs(e[1])), "ooms": len(over),
        "ran": len(errors), "grid_s": result["exhaustive_s"],
        # the search as its user waits for it: the ranks' start to the results, less what only the grid needed
        "search_s": result["wall_s"] - result["exhaustive_s"] - result.get("grid_calibration_s", 0.0),
        "plain_fits": plain in grid}
    summary["vs_best"] = summary["pick_s"] / summary["best_s"]
    summary["speedup"] = summary["baseline_s"] / summary["pick_s"]
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small models, for a smoke test")
    parser.add_argument("--grid-steps", type=int, default=4, help="timed steps per candidate and round in the grid")
    parser.add_argument("--grid-rounds", type=int, default=3, help="rounds of the grid (each candidate built anew)")
    parser.add_argument("--only", default="", help="run only the cases whose name starts with these letters")
    args = parser.parse_args()
    summaries = []
    for name, (hardware, case_args) in CASES.items():
        if args.only and name[0] not in args.only:
            continue
        case_args = quick_args(case_args) if args.quick else case_args
        print(f"\n== case {name} ({' '.join(case_args)})", flush=True)
        result = run_case(name, hardware, case_args, args.grid_steps, args.grid_rounds)
        for note in result["notes"]:
            print(f"note: {note}")
        print(table(result, show_dropped=False))
        dropped = [r for r in result["rows"] if r["dropped"]]
        reasons: dict[str, int] = {}
        for row in dropped:
            reasons[row["dropped"].split(":")[0]] = reasons.get(row["dropped"].split(":")[0], 0) + 1
        print(f"dropped without running: {len(dropped)} ({', '.join(f'{v} {k}' for k, v in reasons.items())})")
        summary = summarize(name, hardware, result)
        summaries.append(summary)
        print(f"pick {summary['pick']} {summary['pick_s']:.3f} s (grid) | best of grid {summary['best']} "
              f"{summary['best_s']:.3f} s | baseline {summary['baseline']} {summary['baseline_s']:.3f} s "
              f"({'plain DDP' if summary['plain_fits'] else 'plain DDP does not fit: first feasible'}) | "
              f"search {summary['search_s']:.1f} s, grid {summary['grid_s']:.1f} s | worst memory error "
              f"{summary['worst_mem_error'][1]:+.1%} ({summary['worst_mem_error'][0]})", flush=True)

    print("\ncase                                       pick/best  speedup  worst mem err  OOM  search/grid")
    for s in summaries:
        print(f"{s['name']:<42}{s['vs_best']:>9.3f}{s['speedup']:>8.2f}x{s['worst_mem_error'][1]:>+14.1%}"
              f"{s['ooms']:>5}{s['search_s'] / s['grid_s']:>12.2f}")
    worst_mem = max((abs(s["worst_mem_error"][1]) for s in summaries), default=0.0)
    ooms = sum(s["ooms"] for s in summaries)
    worst_pick = max((s["vs_best"] for s in summaries), default=0.0)
    fast = sum(s["speedup"] >= 1.2 for s in summaries)
    worst_ratio = max((s["search_s"] / s["grid_s"] for s in summaries), default=0.0)
    median_ratio = statistics.median([s["search_s"] / s["grid_s"] for s in summaries]) if summaries else 0.0

    def verdict(ok: bool) -> str:
        return "met" if ok else "missed"

    print(f"target predicted peak memory within 10% (every candidate that ran, {sum(s['ran'] for s in summaries)} "
          f"runs): worst {worst_mem:.1%} (goal <= 10%) {verdict(worst_mem <= 0.10)}")
    print(f"target OOM during the search: {ooms} (goal 0) {verdict(ooms == 0)}")
    print(f"target pick within 5% of the grid's best: worst {worst_pick:.3f}x (goal <= 1.05) "
          f"{verdict(worst_pick <= 1.05)}")
    print(f"target >= 1.2x faster than plain DDP (or the first feasible) in >= 3 cases: {fast} of {len(summaries)} "
          f"(goal >= 3) {verdict(fast >= 3)}")
    print(f"target search time <= 1/5 of the grid's: worst {worst_ratio:.2f}, median {median_ratio:.2f} "
          f"(goal <= 0.20) {verdict(worst_ratio <= 0.20)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
