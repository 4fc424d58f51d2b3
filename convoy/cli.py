"""``convoy run | master | agent | status | scale | pipeline plan | decode | gbdt | confidential``: parse, then
call."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any, Sequence

from convoy.config import (
    MAX_NPROC_PER_NODE, STATE_FILE, JobConfig, MasterConfig, RendezvousConfig, WorkerConfig, check_run_dir,
    default_run_dir, parse_address, parse_nnodes, resolve_address,
)
from convoy.control.sanitize import safe_host, safe_name
from convoy.errors import ConfigError, ConvoyError
from convoy.cli_scale import scale_roles
from convoy.jobfile import JOB_FILE_SUFFIX, load_job_file
from convoy.roles_config import apply_role_counts, role_counts_from_flags
from convoy.procs import Interrupted, raise_interrupted

EXIT_USAGE = 2
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "two-group")
"""The names in ``convoy.parallel.pipeline.schedule.GENERATORS`` (not imported here, to keep startup light)."""
_WORKERS, _MASTER, _RDZV = WorkerConfig(), MasterConfig(run_dir=Path(".")), RendezvousConfig()
WORKLOAD_COMMANDS = {
    "decode": ("convoy.workloads.lookahead.cli", "lossless lookahead LLM decoding: tokens/s, tokens per pass"),
    "gbdt": ("convoy.workloads.gbdt.cli", "gradient-boosted trees that keep learning online: train | update | predict"),
    "confidential": ("convoy.workloads.confidential.cli", "confidential shared learning in a (simulated) enclave"),
}
"""Each workload's ``cli`` module has ``add_arguments(parser)`` and ``run(args) -> int``; it is imported only when its
command runs, and then loads only the standard library until ``run``, so every other command starts fast."""


class _ExplicitOnly:
    """Adds each option with no default, so that a parse holds only the options a command line names (what
    overrides a job file)."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser

    def add_argument(self, *names: str, **options: Any) -> argparse.Action:
        return self.parser.add_argument(*names, **{**options, "default": argparse.SUPPRESS})


Options = argparse.ArgumentParser | _ExplicitOnly


def _add_worker_options(parser: Options) -> None:
    parser.add_argument("--nproc-per-node", type=int, default=_WORKERS.nproc_per_node,
                        help=f"worker processes per node (1 to {MAX_NPROC_PER_NODE})")
    parser.add_argument("--stop-grace", type=float, default=_WORKERS.stop_grace_s,
                        help="seconds from SIGTERM to SIGKILL (default %(default)s)")
    parser.add_argument("--preload", default=",".join(_WORKERS.preload),
                        help="comma-separated modules standby workers import ahead of time ('' for none; "
                             "default %(default)s)")
    parser.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module, like python -m")
    parser.add_argument("script", metavar="SCRIPT", nargs="?", default="",
                        help="training script (or module with -m); for `convoy run`, a path ending in .toml is a job "
                             "file of options and [roles.NAME] tables, and flags before or after it override it")
    parser.add_argument("args", metavar="ARGS", nargs=argparse.REMAINDER, help="arguments for the script")


def _add_master_options(parser: Options, host: str) -> None:
    parser.add_argument("--nnodes", default="1", help="N or MIN:MAX nodes (default 1)")
    parser.add_argument("--max-restarts", type=int, default=_MASTER.max_restarts,
                        help="worker failures to survive (default %(default)s)")
    parser.add_argument("--run-dir", type=Path, default=None, help="state, token and logs (default ./convoy-runs/...)")
    parser.add_argument("--host", default=host, help=f"address the master listens on (default {host})")
    parser.add_argument("--port", type=int, default=0, help="port of the master's API (default: any free one)")
    parser.add_argument("--rdzv-wait", type=float, default=_RDZV.wait_s, help="seconds to wait for more than MIN nodes")
    parser.add_argument("--join-timeout", type=float, default=_RDZV.join_timeout_s,
                        help="seconds a round may lack MIN nodes before the job fails")
    parser.add_argument("--heartbeat-timeout", type=float, default=_MASTER.heartbeat_timeout_s,
                        help="seconds before a silent node counts as lost")
    parser.add_argument("--max-regroups", type=int, default=_MASTER.max_regroups, metavar="N",
                        help="regroups one node may cause per --regroup-window before it is excluded "
                             "(default %(default)s)")
    parser.add_argument("--regroup-window", type=float, default=_MASTER.regroup_window_s, metavar="S",
                        help="seconds over which a node's regroups are counted (default %(default)s)")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; workload commands get their options only when ``command`` names them."""
    parser = argparse.ArgumentParser(prog="convoy", description="Elastic distributed training for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a job on this machine: a master and N local agents",
                              description=RUN_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_run_options(run)
    master = commands.add_parser("master", help="serve the control plane for agents on other hosts")
    _add_master_options(master, "127.0.0.1")  # other hosts reach it only when --host says so
    master.add_argument("--tls-cert", default="", metavar="PEM",
                        help="serve the API over TLS with this certificate (chain); agents then give --tls-ca")
    master.add_argument("--tls-key", default="", metavar="PEM", help="the private key of --tls-cert")
    master.add_argument("--resume", type=Path, default=None, metavar="RUN_DIR",
                        help="continue the job in RUN_DIR after a master crash (its other settings are reused)")
    master.add_argument("--job-id", default="", help="the job's id (default: random)")
    master.add_argument("--token-file", type=Path, default=None, help="use or create the token here")
    master.add_argument("--under-run", action="store_true", help=argparse.SUPPRESS)
    agent = commands.add_parser("agent", help="join a master as one node and run its workers")
    agent.add_argument("--master", required=True, help="the master's HOST:PORT")
    agent.add_argument("--token-file", type=Path, required=True, help="the job's token file (from the master)")
    agent.add_argument("--node-id", default=None, help="a name unique in the job (default HOSTNAME-PID)")
    agent.add_argument("--host", default=None, help="address other nodes reach this one at (default: detected)")
    agent.add_argument("--run-dir", type=Path, default=None, help="where worker logs go (default: the token's dir)")
    agent.add_argument("--tls-ca", default="", metavar="PEM",
                       help="the master serves TLS: trust its certificate if this CA certificate signed it")
    agent.add_argument("--job-id", default="", help="the job's id where it is known (a job of roles then starts "
                       "the fork server of its processes at once, before the first join)")
    agent.add_argument("--fork-server", default="", help=argparse.SUPPRESS)  # FD:PID, from the local launcher
    _add_worker_options(agent)
    status = commands.add_parser("status", help="show a job's nodes, round, restarts and recent events")
    status.add_argument("--run-dir", type=Path, required=True, help="the job's run directory")
    scale = commands.add_parser("scale", help="change how many processes a role of a running job runs")
    scale.add_argument("--run-dir", type=Path, required=True, help="the job's run directory")
    scale.add_argument("counts", metavar="ROLE=COUNT", nargs="+", help="e.g. worker=4")
    scale.add_argument("--tls-ca", default=None, metavar="PEM",
                       help="verify a TLS master with this CA (default: the master's own certificate)")
    _add_pipeline_commands(commands.add_parser("pipeline", help="plan pipeline-parallel schedules"))
    for name, (module, help_text) in WORKLOAD_COMMANDS.items():
        workload = commands.add_parser(name, help=help_text)
        if name == command:
            importlib.import_module(module).add_arguments(workload)
    return parser


RUN_DESCRIPTION = """\
Run a job on this machine: a master and N local agents.

  convoy run [OPTIONS] SCRIPT [ARGS...]
  convoy run [OPTIONS] JOB.toml [OPTIONS] [SCRIPT [ARGS...]]

A SCRIPT whose name ends in .toml (without -m) is a job file: the options below by their names with
'_' for '-' (nproc_per_node = 2, nnodes = "1:2", ps = 2, workers = "auto"), the script as
entrypoint = "train.py" with args = [...], and the roles as [roles.NAME] tables (entrypoint, args,
module, count, memory, cpus, failure_policy). Flags before or after the file override it, and a
SCRIPT after it replaces its entrypoint and args. Paths in the file are relative to the file.
--ps, --workers and --role set a role's count (N, MIN:MAX or auto), over the file's.
"""


def _add_run_options(parser: Options) -> None:
    _add_master_options(parser, "127.0.0.1")
    parser.add_argument("--relaunch", action="store_true", help="start an agent again when it dies")
    parser.add_argument("--ps", default=None, metavar="N|MIN:MAX",
                        help="parameter-server processes (the role 'ps'; default: no such role)")
    parser.add_argument("--workers", default=None, metavar="N|MIN:MAX|auto",
                        help="worker processes (the role 'worker'; auto: as many as fit the memory one measured "
                             "iteration needs)")
    parser.add_argument("--role", action="append", default=[], metavar="NAME=COUNT",
                        help="a role and its count (N, MIN:MAX or auto), e.g. --role actor=4; repeatable")
    _add_worker_options(parser)


def _add_pipeline_commands(pipeline: argparse.ArgumentParser) -> None:
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


def _worker_config(args: argparse.Namespace) -> WorkerConfig:
    return WorkerConfig(
        entrypoint=args.script, args=list(args.args), module=args.module, nproc_per_node=args.nproc_per_node,
        stop_grace_s=args.stop_grace, preload=tuple(filter(None, args.preload.split(","))),
    )


def _master_config(args: argparse.Namespace) -> MasterConfig:
    min_nodes, max_nodes = parse_nnodes(args.nnodes)
    rendezvous = RendezvousConfig(min_nodes, max_nodes, args.rdzv_wait, args.join_timeout)
    return MasterConfig(
        host=args.host, port=args.port, max_restarts=args.max_restarts, heartbeat_timeout_s=args.heartbeat_timeout,
        run_dir=args.run_dir or default_run_dir(), rendezvous=rendezvous, max_regroups=args.max_regroups,
        regroup_window_s=args.regroup_window,
    )


def _job_config(args: argparse.Namespace, run_argv: Sequence[str]) -> tuple[JobConfig, argparse.Namespace]:
    """The job of ``convoy run``; with a job file, its options under those the command line gives."""
    roles: tuple = ()
    if args.script.endswith(JOB_FILE_SUFFIX) and not args.module:
        job_file = load_job_file(Path(args.script))
        before = _given(run_argv)  # the options before the job file; those after it come as its ARGS
        after = _given(before.pop("args"))
        before.pop("script")
        if "script" not in after:
            after.pop("args")
        reset = {"script": "", "args": [], "ps": None, "workers": None, "role": []}  # the file's, then the flags'
        args = argparse.Namespace(**{**vars(args), **reset, **job_file.options})
        for given in (before, after):
            for dest, value in given.items():
                setattr(args, dest, [*args.role, *value] if dest == "role" else value)
        roles = job_file.roles
    counts = role_counts_from_flags({dest: getattr(args, dest) for dest in ("ps", "workers")}, args.role)
    roles = apply_role_counts(roles, counts, job_has_script=bool(args.script))
    return JobConfig(master=_master_config(args), workers=_worker_config(args), roles=roles), args


def _given(argv: Sequence[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="convoy run")
    _add_run_options(_ExplicitOnly(parser))
    return vars(parser.parse_args(argv))


def _run(args: argparse.Namespace, run_argv: Sequence[str]) -> int:
    from convoy.control.launcher import run_local_job

    config, args = _job_config(args, run_argv)
    return run_local_job(config, relaunch=args.relaunch, console=_console)


def _master(args: argparse.Namespace) -> int:
    from convoy.control.master import JobMaster
    from convoy.control.token import TOKEN_FILE

    if args.resume is not None:
        if not (args.resume / STATE_FILE).is_file():
            raise ConfigError(f"--resume {str(args.resume)!r}: no job state there (expected {STATE_FILE})")
        master = JobMaster(MasterConfig(run_dir=args.resume), console=_console, resume=True, token_file=args.token_file)
    else:
        config = _master_config(args)
        config.job_id, config.tls_cert, config.tls_key = args.job_id, args.tls_cert, args.tls_key
        config.validate()
        master = JobMaster(config, console=_console, token_file=args.token_file)
    master.start()
    if not args.under_run:
        token_file = args.token_file or master.config.run_dir / TOKEN_FILE
        _console(f"convoy: master of job {master.job.job_id} at {master.url}; token file {token_file}")
        _console(f"convoy: on each node: convoy agent --master HOST:{master.api.address[1]} --token-file "
                 f"{token_file} --nproc-per-node K SCRIPT")
    previous = {s: signal.signal(s, raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        master.wait_ended()
        code = 0 if master.job.status == "succeeded" else 1
    except Interrupted as exc:
        master.abort(f"master interrupted by {exc}")
        code = exc.exit_code
    finally:
        master.wait_acknowledged(2 * master.config.heartbeat_s + 1.0)  # every agent should hear the outcome
        master.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code


def _agent(args: argparse.Namespace) -> int:
    from convoy.control.role_master import ROLES_FILE

    workers = _worker_config(args)
    run_dir = args.run_dir or args.token_file.parent
    roles = (run_dir / ROLES_FILE).is_file()
    workers.validate(need_entrypoint=not roles)  # roles may each name their script
    host, port = parse_address(args.master)
    resolve_address(host, port)
    if args.node_id is not None and not safe_name(args.node_id):
        raise ConfigError(f"--node-id {args.node_id!r}: use letters, digits and . _ @ + - (starting with a letter "
                          "or digit)")
    if args.host is not None and not safe_host(args.host):
        raise ConfigError(f"--host {args.host!r}: give a host name or an IP address")
    try:
        token = args.token_file.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"--token-file {str(args.token_file)!r} cannot be read: {exc.strerror}") from exc
    check_run_dir(run_dir)
    from convoy.ports import local_address_towards
    from convoy.agent.workers import WorkerGroup

    address = args.host or local_address_towards(host, port)
    forks = None
    if roles and args.job_id and args.node_id:  # its import of torch starts before anything else
        from convoy.agent.forked import ForkServer, start_fork_server

        forks = ForkServer.adopt(args.fork_server, args.job_id) if args.fork_server else \
            start_fork_server(workers, address, args.job_id, args.node_id)
    group = WorkerGroup(workers, run_dir, host=address)
    if not roles:
        group.fill_standbys()  # start importing torch before anything else (a job of roles forks its processes)
    from convoy.agent.agent import Agent, AgentConfig

    config = AgentConfig(
        master_host=host, master_port=port, token=token,
        node_id=args.node_id or f"{socket.gethostname()}-{os.getpid()}", host=address, run_dir=run_dir, workers=workers,
        tls_ca=args.tls_ca, roles=roles,
    )
    return Agent(config, group, forks).run()


def _status(args: argparse.Namespace) -> int:
    from convoy.control.status import format_status, read_memory
    from convoy.control.store import read_status

    print(format_status(read_status(args.run_dir), read_memory(args.run_dir)))
    return 0


def _pipeline(args: argparse.Namespace) -> int:
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


def _console(line: str) -> None:
    print(line, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    run_argv = argv[argv.index(command) + 1:] if command == "run" else []
    handlers = {"run": lambda args: _run(args, run_argv), "master": _master, "agent": _agent, "status": _status,
                "scale": scale_roles, "pipeline": _pipeline}
    try:
        if args.command in WORKLOAD_COMMANDS:
            return importlib.import_module(WORKLOAD_COMMANDS[args.command][0]).run(args)
        return handlers[args.command](args)
    except ConvoyError as exc:
        print(f"convoy: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except BrokenPipeError:  # the reader of our output went away (`convoy status | head -1`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
