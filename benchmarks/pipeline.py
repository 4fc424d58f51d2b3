"""convoy's pipeline schedules against torch.distributed.pipelining, 4 gloo ranks, one model.

    python benchmarks/pipeline.py [--quick] [--reps N] [--png-dir DIR]

An 8-block MLP cut into 4 stages (8 for interleaved and two-group). Four jobs:
``emulated`` at 8 and at 4 micro-batches (each block sleeps 10 ms forward and 20 ms backward
on a tiny width, so the schedule, not the 2-core CPU, is measured), ``real`` (width 384, real
matmuls, 4 processes on however many cores there are) and ``overhead`` (width 16, nothing to
compute: what each runtime itself costs). Per configuration: median step time
(between barriers), convoy's measured bubble against the simulator's prediction, and peak
activation memory (saved-for-backward bytes, the busiest rank). The bubble is 1 - W / (ranks x
makespan), with W the compute one step needs (micro-batches x forward+backward of the model).
Measured: W and the makespan from the configuration's own timed steps. Predicted: the simulator
is given only the costs of the calibration run that precedes the timed steps (3 steps of 1F1B,
a ping-pong for the message time, split forwards for the fills), never the configuration's own
timings, so the prediction is checked against steps it has not seen.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks" / "scripts"))
from convoy.ports import free_port  # noqa: E402
from convoy.parallel.pipeline import schedule as plans  # noqa: E402
from convoy.parallel.pipeline.fill import plan_fills  # noqa: E402
from convoy.parallel.pipeline.schedule import Action, Kind  # noqa: E402
from convoy.parallel.pipeline.simulate import Costs, Span, simulate  # noqa: E402
from ranks import rank_env, run_ranks  # noqa: E402

WORKER = REPO / "benchmarks" / "scripts" / "pipeline_worker.py"
WORLD, BLOCKS = 4, 8
BUBBLE_TOLERANCE, FILL_FROM_BUBBLE = 0.10, 0.20


def run_job(mode: str, microbatches: int, reps: int, out: Path) -> dict:
    port = str(free_port())
    argv = [sys.executable, str(WORKER), "--mode", mode, "--microbatches", str(microbatches), "--reps", str(reps),
            "--out", str(out)]
    run_ranks([(argv, rank_env(rank, WORLD, port)) for rank in range(WORLD)], f"{mode} m={microbatches}")
    return json.loads(out.read_text())


def convoy_schedule(name: str, microbatches: int, found: dict) -> tuple[plans.Schedule, Costs]:
    """The schedule the worker ran (fills are planned the same way from the same costs)."""
    base = plans.build(name.removesuffix("+fill").replace("interleaved2", "interleaved"), WORLD, microbatches)
    costs = Costs(**planning(found), fill_rounds=BLOCKS // base.n_stages)
    return (plan_fills(base, costs)[0] if name.endswith("+fill") else base), costs


def planning(found: dict) -> dict:
    return {k: v for k, v in found.items() if k != "split_forward"}


def measured_costs(entry: dict, schedule: plans.Schedule, planned: Costs) -> Costs:
    """The compute this configuration's own steps show (for the measured bubble's W): median
    unsplit forward and backward of a stage, times the stage count."""
    fwd = statistics.median(end - start for _, kind, _, _, peer, start, end in entry["spans"]
                            if kind == "F" and peer is None)
    bwd = statistics.median(end - start for _, kind, _, _, _, start, end in entry["spans"] if kind == "B")
    return dataclasses.replace(planned, forward=fwd * schedule.n_stages, backward=bwd * schedule.n_stages)


def report(data: dict, png_dir: Path | None) -> dict[str, float]:
    """Print one job's table; return the numbers the targets need."""
    m, found = data["microbatches"], data["costs"]
    costs = Costs(**planning(found))
    contended = data["mode"] == "overhead" or (data["mode"] == "real" and (os.cpu_count() or 1) < WORLD)
    print(f"\n{data['mode']}, {WORLD} ranks, {m} micro-batches; calibration run: forward {costs.forward * 1e3:.1f} "
          f"ms and backward {costs.backward * 1e3:.1f} ms per micro-batch (whole model), message "
          f"{costs.comm * 1e3:.2f} ms, "
          f"split forward of a stage {found['split_forward'] * 1e3:.1f} ms (fill message "
          f"{costs.fill_comm * 1e3:.2f} ms, parameter shard {costs.fill_params * 1e3:.2f} ms)")
    if contended:
        why = ("nothing to compute" if data["mode"] == "overhead" else
               f"{WORLD} ranks share {os.cpu_count()} cores, so a rank's idle time is mostly another rank computing")
        print(f"(bubble not shown: {why}; the emulated jobs measure the schedule)")
    else:
        print("(bubble sim.: the simulator given the calibration run's costs above, not the timed steps')")
    print(f"{'configuration':<32}{'step ms':>9}{'bubble meas.':>14}{'bubble sim.':>13}{'rel. diff':>11}"
          f"{'peak act. KiB':>15}{'loss[0]':>10}")
    numbers: dict[str, float] = {}
    for name, entry in data["configs"].items():
        step = statistics.median(entry["times"])
        numbers[f"step {name}"] = step
        meas = sim = diff = None
        if "schedule" in entry and not contended:
            schedule, planned = convoy_schedule(entry["schedule"]["name"], m, found)
            sim = 1 - m * (planned.forward + planned.backward) / (WORLD * simulate(schedule, planned).makespan)
            actual = measured_costs(entry, schedule, planned)
            meas = 1 - m * (actual.forward + actual.backward) / (WORLD * statistics.median(entry["makespans"]))
            diff = abs(meas - sim) / sim
            numbers[f"bubble {name}"], numbers[f"diff {name}"] = meas, diff
            if png_dir is not None:
                draw_measured(entry, schedule, png_dir / f"pipeline-{data['mode']}-m{m}-{schedule.name}.png")
        cells = [f"{step * 1e3:>9.1f}", f"{meas:>14.1%}" if meas is not None else f"{'-':>14}",
                 f"{sim:>13.1%}" if sim is not None else f"{'-':>13}",
                 f"{diff:>11.1%}" if diff is not None else f"{'-':>11}"]
        loss = entry["losses"][0] if entry["losses"] else float("nan")
        print(f"{name:<32}" + "".join(cells) + f"{max(entry['peak_bytes']) / 1024:>15.0f}{loss:>10.5f}")
    return numbers


def draw_measured(entry: dict, schedule: plans.Schedule, path: Path) -> None:
    from convoy.parallel.pipeline.timeline import draw

    spans = [Span(rank, Action(Kind(kind), stage, mb, peer), start, end)
             for rank, kind, stage, mb, peer, start, end in entry["spans"]]
    draw(spans, path, f"measured: {schedule.name}, {schedule.n_microbatches} micro-batches", n_ranks=WORLD)


def target(name: str, measured: str, goal: str, met: bool) -> None:
    print(f"target {name}: {measured} (goal {goal}) {'met' if met else 'missed'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 reps, emulated m=8 only (under a minute)")
    parser.add_argument("--reps", type=int, default=None, help="timed steps per configuration (default 25)")
    parser.add_argument("--png-dir", type=Path, default=None, help="write measured timelines here")
    args = parser.parse_args()
    reps = args.reps or (3 if args.quick else 25)
    jobs = [("emulated", 8)] if args.quick else [("emulated", 8), ("emulated", 4), ("real", 8), ("overhead", 8)]
    if args.png_dir:
        args.png_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="convoy-bench-pipeline-") as tmp:
        for mode, m in jobs:
            data = run_job(mode, m, reps, Path(tmp) / f"{mode}-{m}.json")
            results[mode, m] = report(data, args.png_dir)
    print()
    for (mode, m), numbers in results.items():
        ratio = numbers["step convoy 1f1b"] / numbers["step torch Schedule1F1B"]
        target(f"1f1b_vs_torch_{mode}_m{m}", f"convoy / torch step time {ratio:.3f}", "<= 1.000", ratio <= 1.0)
    for (mode, m), numbers in results.items():
        if mode != "emulated":
            continue
        diffs = {k.removeprefix("diff convoy "): v for k, v in numbers.items() if k.startswith("diff ")}
        worst = max(diffs, key=diffs.get)
        target(f"bubble_vs_simulator_m{m}", f"worst relative difference {diffs[worst]:.1%} ({worst})",
               f"<= {BUBBLE_TOLERANCE:.0%}", diffs[worst] <= BUBBLE_TOLERANCE)
    for (mode, m), numbers in results.items():
        if mode != "emulated":  # only there is the bubble the schedule's (see the tables)
            continue
        for key, bubble in numbers.items():
            name = key.removeprefix("bubble convoy ")
            filled = f"step convoy {name}+fill"
            if not key.startswith("bubble ") or name.endswith("+fill") or bubble <= FILL_FROM_BUBBLE:
                continue
            if filled not in numbers:
                target(f"fill_{mode}_m{m}_{name}", f"bubble {bubble:.1%}, no fill pays in the simulator",
                       "lower step time", False)
                continue
            ratio = numbers[filled] / numbers[f"step convoy {name}"]
            target(f"fill_{mode}_m{m}_{name}", f"bubble {bubble:.1%}, step time with / without fill {ratio:.3f}",
                   "< 1.000", ratio < 1.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
