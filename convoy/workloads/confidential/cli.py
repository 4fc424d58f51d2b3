"""``convoy confidential demo``: parse, then call the library (standard library only at import)."""

from __future__ import annotations

import argparse
import sys

TASKS = ("linear", "logistic", "mlp")
MODES = ("data", "model")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Sub-commands of ``convoy confidential``."""
    commands = parser.add_subparsers(dest="confidential_command", required=True)
    demo = commands.add_parser("demo", help="three providers train one model in a (simulated) enclave, end to end")
    demo.add_argument("--task", choices=TASKS, default="logistic", help="model to train (default %(default)s)")
    demo.add_argument("--mode", choices=MODES, default="data",
                      help="data: providers send encrypted rows; model: encrypted local models, averaged "
                           "(default %(default)s)")
    demo.add_argument("--rows", type=int, default=1000, help="rows per provider (default %(default)s)")
    demo.add_argument("--features", type=int, default=8, help="columns (default %(default)s)")
    demo.add_argument("--rounds", type=int, default=None,
                      help="averaging rounds in model mode (default 1; 5 for --task mlp)")
    demo.add_argument("--epochs", type=int, default=30, help="MLP epochs per training (default %(default)s)")
    demo.add_argument("--seed", type=int, default=0, help="data and MLP seed (default %(default)s)")
    demo.add_argument("--no-attacks", action="store_true", help="skip the scripted attacks")
    demo.add_argument("--backend", choices=("simulated", "hardware"), default="simulated",
                      help="simulated: a local key stands in for the hardware root of trust (no hardware "
                           "protection); hardware: refuses, saying why, on a machine without a TEE "
                           "(default %(default)s)")


def run(args: argparse.Namespace) -> int:
    from convoy.errors import ConfigError
    from convoy.workloads.confidential.demo import run_demo

    if args.confidential_command != "demo":  # argparse allows only the choices above
        raise ConfigError(f"unknown confidential command {args.confidential_command!r}")
    for name in ("rows", "features", "epochs"):
        if getattr(args, name) < (2 if name != "epochs" else 1):
            raise ConfigError(f"--{name} {getattr(args, name)} is too small (rows and features >= 2, epochs >= 1)")
    rounds = args.rounds if args.rounds is not None else (5 if args.mode == "model" and args.task == "mlp" else 1)
    if args.mode == "data" and rounds != 1:
        raise ConfigError(f"--rounds {rounds}: data mode trains once on the pooled rows; use --mode model for rounds")
    try:
        return run_demo(task=args.task, mode=args.mode, rows=args.rows, features=args.features, rounds=rounds,
                        epochs=args.epochs, seed=args.seed, attacks=not args.no_attacks, backend=args.backend)
    except KeyboardInterrupt:  # the enclave was stopped on the way out (EnclaveHost is a context manager)
        print("convoy: confidential demo interrupted; the enclave was stopped", file=sys.stderr, flush=True)
        return 130
