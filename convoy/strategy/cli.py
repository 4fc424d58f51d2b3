"""``convoy plan SCRIPT``: search the training strategy for a script's model, print the table, write the file.

Loads only the standard library until ``run``."""

from __future__ import annotations

import argparse
import os
import sys

KEEP, FIRST_STEPS = 8, 1
"""``search.KEEP`` and ``search.FIRST_STEPS``, written again so that the CLI starts without importing the search."""
OWN_FLAGS = ("--nodes", "--nproc-per-node", "--memory", "--cores", "--out", "--keep", "--first-steps")
"""``convoy plan``'s flags: after the script they would go to the script, whose ``parse_known_args`` drops them."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("script", help="a training script defining workload() -> convoy.strategy.Workload")
    parser.add_argument("script_args", nargs=argparse.REMAINDER,
                        help="arguments workload() parses (none named as one of convoy plan's own flags)")
    parser.add_argument("--nodes", type=int, default=1, help="nodes of the job to plan for (default %(default)s)")
    parser.add_argument("--nproc-per-node", type=int, default=2, help="ranks per node (default %(default)s)")
    parser.add_argument("--memory", default="2GB", help="memory a rank may use for training, e.g. 1.5GB "
                                                         "(default %(default)s)")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                        help="CPU cores one node's ranks share (default: this machine's, %(default)s)")
    parser.add_argument("--out", default="convoy-strategy.json", help="the strategy file (default %(default)s)")
    parser.add_argument("--keep", type=int, default=KEEP, help="candidates measured first (default %(default)s)")
    parser.add_argument("--first-steps", type=int, default=FIRST_STEPS,
                        help="timed steps each gets in the first round (default %(default)s)")


def run(args: argparse.Namespace) -> int:
    from convoy.errors import ConfigError
    from convoy.strategy.candidates import Hardware
    from convoy.strategy.report import parse_bytes

    args.script_args = script_arguments(args.script, list(args.script_args))
    if args.keep < 1 or args.first_steps < 1:
        raise ConfigError(f"--keep and --first-steps must be >= 1 (got {args.keep} and {args.first_steps})")
    hardware = Hardware(args.nodes, args.nproc_per_node, parse_bytes(args.memory), args.cores).validate()
    plan_file(args.script, args.script_args, hardware, args.out, keep=args.keep, first_steps=args.first_steps)
    return 0


def script_arguments(script: str, given: list[str]) -> list[str]:
    """The script's arguments; one of ``convoy plan``'s own flags among them is refused, saying where it goes (the
    script would drop it and the plan would be for other ranks or memory than asked). A script of ``convoy plan``
    cannot take a flag of the same name as one of these."""
    from convoy.errors import ConfigError

    misplaced = []
    for at, arg in enumerate(given):
        if arg.split("=", 1)[0] in OWN_FLAGS:
            takes_next = "=" not in arg and at + 1 < len(given) and not given[at + 1].startswith("--")
            misplaced += [arg, given[at + 1]] if takes_next else [arg]
    if misplaced:
        raise ConfigError(f"convoy plan: {' '.join(misplaced)} came after the script, where it goes to {script}, "
                          f"not to convoy plan; put convoy plan's flags before the script: convoy plan "
                          f"{' '.join(misplaced)} ... {script} [SCRIPT ARGS]")
    return given


def plan_file(script: str, script_args: list[str], hardware: object, out: str | os.PathLike, *, keep: int = KEEP,
              first_steps: int = FIRST_STEPS) -> object:
    """Search ``script``'s strategy on ``hardware`` (a ``Hardware``), print the table, write the strategy file
    ``out``; the winning ``Strategy``. A limit nothing fits raises a ``ConfigError`` naming the smallest need."""
    from convoy.strategy.candidates import Candidate, require_feasible
    from convoy.strategy.dryrun import run_search
    from convoy.strategy.memory import MemoryEstimate, ModelFeatures
    from convoy.strategy.plan import Strategy, StrategyFile
    from convoy.strategy.report import table

    print(f"planning {script} for {hardware.nodes} node(s) x {hardware.nproc_per_node} rank(s), "
          f"{hardware.memory_limit / 1e6:.0f} MB per rank", flush=True)
    result = run_search(script, script_args, hardware, keep=keep, first_steps=first_steps)
    features = ModelFeatures.from_dict(result["features"])
    for note in result["notes"]:
        print(f"note: {note}")
    print(table(result))
    rows = [Candidate(Strategy.from_dict(r["strategy"]), MemoryEstimate(r["memory"], 0, 0), r["dropped"])
            for r in result["rows"]]
    require_feasible(rows, features, hardware)  # raises, naming the smallest need
    winner = Strategy.from_dict(result["winner"])
    StrategyFile(winner, features.fingerprint, features.summary, hardware.world_size, features.batch).save(out)
    print(f"picked {winner.name()} (search {result['search_s']:.1f} s); wrote {out}")
    sys.stdout.flush()
    return winner
