"""``convoy pipeline plan``: build, check, time and draw pipeline-parallel schedules (loaded only when it runs)."""

from __future__ import annotations

import argparse
from pathlib import Path

from convoy.errors import ConfigError

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "two-group")


def add_arguments(pipeline: argparse.ArgumentParser) -> None:
    commands = pipeline.add_subparsers(dest="pipeline_command", required=True)
    plan = commands.add_parser("plan", help="build, check, time and draw a pipeline schedule")
    plan.add_argument("--schedule", choices=(*PIPELINE_SCHEDULES, "all"), default="1f1b",
                      help="which schedule, or all to compare them (default %(default)s)")
    plan.add_argument("--ranks", type=int, default=4, metavar="P", help="pipeline ranks (default %(default)s)")
    plan.add_argument("--microbatches", type=int, default=8, metavar="M",
                      help="micro-batches per step (default %(default)s)")
    plan.add_argument("--forward", type=float, default=1.0, metavar="F",
                      help="forward time of one micro-batch through the whole model (default %(default)s)")
    plan.add_argument("--backward", type=float, default=2.0, metavar="B",
                      help="backward time of one micro-batch through the whole model (default %(default)s)")
    plan.add_argument("--comm", type=float, default=0.0, metavar="C",
                      help="time of one message between ranks (default %(default)s)")
    plan.add_argument("--png", type=Path, default=None, metavar="PATH",
                      help="timeline image (default pipeline-SCHEDULE.png; with all, one per schedule, "
                           "PATH's name suffixed with -SCHEDULE)")
    plan.add_argument("--comms", action="store_true", help="show sends and receives in the grid")
    plan.add_argument("--fill", action="store_true",
                      help="split forwards with idle ranks (tensor parallel) where the simulator says it pays")
    plan.add_argument("--fill-params", type=float, default=0.0, metavar="T",
                      help="time to send a stage's parameter shard to a helper, once per step (default %(default)s)")


def run(args: argparse.Namespace) -> int:
    from convoy.parallel.pipeline.fill import plan_fills
    from convoy.parallel.pipeline.schedule import GENERATORS
    from convoy.parallel.pipeline.simulate import Costs, compare, simulate
    from convoy.parallel.pipeline.timeline import draw_schedule
    from convoy.parallel.pipeline.validate import validate

    if args.forward <= 0 or args.backward <= 0 or args.comm < 0 or args.fill_params < 0:
        raise ConfigError(f"--forward and --backward must be > 0, --comm and --fill-params >= 0; got {args.forward}, "
                          f"{args.backward}, {args.comm} and {args.fill_params}")
    costs = Costs(forward=args.forward, backward=args.backward, comm=args.comm, fill_params=args.fill_params)
    names = PIPELINE_SCHEDULES if args.schedule == "all" else (args.schedule,)
    schedules = []
    for name in names:  # build and check every schedule before printing or writing anything
        if name == "two-group":  # its lags depend on the relative costs
            schedule = GENERATORS[name](args.ranks, args.microbatches, args.forward, args.backward, args.comm)
        else:
            schedule = GENERATORS[name](args.ranks, args.microbatches)
        if args.fill:
            schedule = plan_fills(schedule, costs)[0]
        schedules.append((name, validate(schedule)))
    for index, (_, schedule) in enumerate(schedules):
        result = simulate(schedule, costs, check=False)
        peaks = " ".join(f"{result.peak_activations[rank]:.2f}" for rank in sorted(result.peak_activations))
        print(("\n" if index else "") + schedule.grid(comms=args.comms))
        print(f"{result.summary()}  (per rank: {peaks})")
    if len(schedules) > 1:
        print("\n" + compare([schedule for _, schedule in schedules], costs))
    for name, schedule in schedules:
        print(f"wrote {draw_schedule(schedule, _png_path(args.png, name, len(schedules) > 1), costs)}")
    return 0


def _png_path(png: Path | None, name: str, several: bool) -> Path:
    if png is None:
        return Path(f"pipeline-{name}.png")
    return png.with_name(f"{png.stem}-{name}{png.suffix or '.png'}") if several else png
