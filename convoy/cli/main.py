"""``convoy run | master | agent | status | scale | preempt | pool | pipeline plan | decode | gbdt | confidential``:
parse, then call."""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import os
import signal
import socket
import sys
from pathlib import Path
from typing import NoReturn, Sequence

from convoy import __version__, log
from convoy.cli.options import (RUN_DESCRIPTION, add_master_options, add_run_options, add_worker_options, job_config,
                                master_config, worker_config)
from convoy.cli.pool import add_pool_commands, preempt, show_pool
from convoy.cli.scale import scale_roles
from convoy.cli.torchrun import stop_signals
from convoy.cli.torchrun import translate as translate_torchrun
from convoy.config import STATE_FILE, JobConfig, MasterConfig, check_run_dir, parse_address, resolve_address
from convoy.errors import ConfigError, ConvoyError
from convoy.procs import Interrupted, ignore_interrupts, raise_interrupted, restore_handlers, stop_on
from convoy.sanitize import safe_host, safe_name

SIGNALS_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"
"""torchrun's variable in its workers' environment: the signals the launcher stops the job on."""
EXIT_USAGE = 2
"""The names in ``convoy.parallel.pipeline.schedule.GENERATORS`` (not imported here, to keep startup light)."""
EXTRAS = {"transformers": "llm", "gguf": "llm", "safetensors": "llm", "accelerate": "llm", "lightgbm": "gbdt",
          "sklearn": "gbdt", "xgboost": "gbdt", "cryptography": "confidential", "matplotlib": "plot"}
"""A module the optional extras bring -> the extra to install (``pip install 'convoy[EXTRA]'``)."""
NEEDS = {"decode": ("transformers", "gguf"), "gbdt": ("lightgbm", "sklearn"), "confidential": ("cryptography",)}
"""The modules a command cannot start without."""
WORKLOAD_COMMANDS = {
    "decode": ("convoy.workloads.lookahead.cli", "lossless lookahead LLM decoding: tokens/s, tokens per pass"),
    "gbdt": ("convoy.workloads.gbdt.cli", "gradient-boosted trees that keep learning online: train | update | predict"),
    "confidential": ("convoy.workloads.confidential.cli", "confidential shared learning in a (simulated) enclave"),
    "config": ("convoy.cli.live_config", "a running job's training config: set | show | history | proposals"),
    "pipeline": ("convoy.cli.pipeline", "plan pipeline-parallel schedules: build, check, time and draw them"),
    "manager": ("convoy.cli.manager", "watch several running jobs: their status, proposals, and one config for all"),
    "dashboard": ("convoy.cli.dashboard", "the dashboard's pages for several jobs' run dirs, running or finished"),
    "plan": ("convoy.strategy.cli", "pick the training strategy for a script: candidates, memory, measured search"),
}
"""Each workload's (and each such command's) ``cli`` module has ``add_arguments(parser)`` and ``run(args) -> int``;
it is imported only when its command runs, and then loads only the standard library until ``run``, so every other
command starts fast."""


class _OneLine(argparse.ArgumentParser):
    """A bad command line is one line naming what is wrong (and ``--help`` for the rest), exit 2."""

    def error(self, message: str) -> NoReturn:
        where = self.prog.removeprefix("convoy").strip()
        self.exit(EXIT_USAGE, f"convoy: error: {where + ': ' if where else ''}{message} (see {self.prog} --help)\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; workload commands get their options only when ``command`` names them."""
    parser = _OneLine(prog="convoy", description="Elastic distributed training for PyTorch.")
    parser.add_argument("--version", action="version", version=f"convoy {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a job on this machine: a master and N local agents",
                              description=RUN_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(run)
    master = commands.add_parser("master", help="serve the control plane for agents on other hosts")
    add_master_options(master, "127.0.0.1")  # other hosts reach it only when --host says so
    master.add_argument("--tls-cert", default="", metavar="PEM",
                        help="serve the API over TLS with this certificate (chain); agents then give --tls-ca")
    master.add_argument("--tls-key", default="", metavar="PEM", help="the private key of --tls-cert")
    master.add_argument("--resume", type=Path, default=None, metavar="RUN_DIR",
                        help="continue the job in RUN_DIR after a master crash (its other settings are reused)")
    master.add_argument("--job-id", default="", help="the job's id (default: random)")
    master.add_argument("--token-file", type=Path, default=None, help="use or create the token here")
    master.add_argument("--under-run", action="store_true", help=argparse.SUPPRESS)
    master.add_argument("--listen-fd", type=int, default=None, help=argparse.SUPPRESS)  # the claimed endpoint
    master.add_argument("--pool", default="", help=argparse.SUPPRESS)  # convoy run's: the machine's CPU pool
    master.add_argument("--peer-loss-wait", type=float, default=MasterConfig().peer_loss_wait_s,
                        help=argparse.SUPPRESS)  # convoy run's: longer on Ray, where a lost node is heard of later
    agent = commands.add_parser("agent", help="join a master as one node and run its workers")
    agent.add_argument("--master", required=True, help="the master's HOST:PORT")
    agent.add_argument("--token-file", type=Path, required=True, help="the job's token file (from the master)")
    agent.add_argument("--node-id", default=None, help="a name unique in the job (default HOSTNAME-SLOT: the lowest "
                       "slot of this host no running agent of the run dir holds, so a relaunch keeps its id)")
    agent.add_argument("--host", default=None, help="address other nodes reach this one at (default: detected)")
    agent.add_argument("--run-dir", type=Path, default=None, help="where worker logs go (default: the token's dir)")
    agent.add_argument("--tls-ca", default="", metavar="PEM",
                       help="the master serves TLS: trust its certificate if this CA certificate signed it")
    agent.add_argument("--log-level", default=None, choices=log.LEVELS,
                       help="convoy's own messages from this level up (default info, or $CONVOY_LOG_LEVEL)")
    agent.add_argument("--node-rank", type=int, default=-1,
                       help="the node rank to ask for in the first round (torchrun's --node-rank; default: join order)")
    agent.add_argument("--job-id", default="", help="the job's id where it is known (a job of roles then starts "
                       "the fork server of its processes at once, before the first join)")
    agent.add_argument("--fork-server", default="", help=argparse.SUPPRESS)  # FD:PID, from the local launcher
    agent.add_argument("--cpus", type=int, default=0, metavar="N",
                       help="the CPUs this node offers the job's role processes (default: the agent's CPU affinity; "
                            "on Ray, the CPUs its actor holds)")
    add_worker_options(agent)
    status = commands.add_parser("status", help="show a job's nodes, round, restarts and recent events")
    status.add_argument("--run-dir", type=Path, required=True, help="the job's run directory")
    add_pool_commands(commands)
    scale = commands.add_parser("scale", help="change how many processes a role of a running job runs")
    scale.add_argument("--run-dir", type=Path, required=True, help="the job's run directory")
    scale.add_argument("counts", metavar="ROLE=COUNT", nargs="+", help="e.g. worker=4")
    scale.add_argument("--tls-ca", default=None, metavar="PEM",
                       help="verify a TLS master with this CA (default: the master's own certificate)")
    for name, (module, help_text) in WORKLOAD_COMMANDS.items():
        workload = commands.add_parser(name, help=help_text)
        if name == command:
            importlib.import_module(module).add_arguments(workload)
    return parser


def _run(args: argparse.Namespace, run_argv: Sequence[str]) -> int:
    from convoy.launch.run import run_local_job

    resume = None
    if args.resume is not None:  # the command line of the driver that was killed, in its directory
        from convoy.launch.ray_run import read_launch

        if len(run_argv) != 2:
            raise ConfigError("--resume RUN_DIR takes nothing else: the job's command line is in the run dir")
        resume = read_launch(args.resume)
        try:
            os.chdir(resume["cwd"])
        except OSError as exc:
            raise ConfigError(f"--resume: the job's directory {resume['cwd']!r} is gone ({exc.strerror})") from None
        run_argv = resume["argv"]
        args = build_parser("run").parse_args(["run", *run_argv])
    config, args = job_config(args, run_argv)
    if resume is not None and config.scheduler != "ray":
        raise ConfigError("--resume is for a job that Ray placed (--scheduler ray)")
    if config.scheduler == "ray" and (args.endpoint or args.relaunch or args.local_addr):
        raise ConfigError("--endpoint, --relaunch and --local-addr are for local nodes; with --scheduler ray Ray "
                          "places the nodes (a lost agent is placed again on its own)")
    stopping = [sig for sig in stop_signals(args.signals_to_handle) if sig not in (signal.SIGINT, signal.SIGTERM)]
    if args.local_addr:
        check_local_address(args.local_addr)
    if args.strategy:
        _prepare_strategy(args, config)
    if not args.endpoint and (args.join_token or args.token_file or args.node_rank != -1):
        raise ConfigError("--join-token, --token-file and --node-rank are for a job of several hosts: give --endpoint "
                          "HOST:PORT (torchrun's --rdzv-endpoint) too")
    os.environ[SIGNALS_ENV] = args.signals_to_handle  # as torchrun: its workers see the signals their launcher handles
    previous = stop_on(stopping)  # SIGINT and SIGTERM: each launcher's own, whatever this process inherited
    try:
        if config.scheduler == "ray":
            from convoy.launch.ray_run import run_ray_job

            return run_ray_job(config, console=_console, argv=run_argv, resume=resume)
        if args.endpoint:
            from convoy.launch.endpoint import run_endpoint_job

            host, port = parse_address(args.endpoint, "--endpoint")
            return run_endpoint_job(config, (host, port), token=args.join_token, token_file=args.token_file,
                                    relaunch=args.relaunch, console=_console, node_rank=args.node_rank,
                                    agent_host=args.local_addr or None)
        return run_local_job(config, relaunch=args.relaunch, console=_console,
                             agent_host=args.local_addr or "127.0.0.1")
    except Interrupted as exc:  # a stop signal before the launcher had its own handlers: nothing had started
        return exc.exit_code
    finally:
        restore_handlers(previous)


def check_local_address(host: str) -> None:
    """``--local-addr``: an address of this host (one its workers and the other hosts can reach it at)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.bind((host.strip("[]"), 0))
    except OSError as exc:
        raise ConfigError(f"--local-addr {host}: not an address of this host ({exc.strerror}); give one of its "
                          "addresses or names, or leave it out") from None


def _prepare_strategy(args: argparse.Namespace, config: JobConfig) -> None:
    """``--strategy``: plan first (auto) or check the file; the workers find it through the environment."""
    from convoy.strategy.apply import STRATEGY_ENV

    config.validate()  # a job that cannot start is said before any planning
    rendezvous = config.master.rendezvous
    if args.strategy != "auto":
        from convoy.strategy.plan import StrategyFile

        planned = StrategyFile.load(args.strategy)  # a missing or mangled file is said now, before anything starts
        world = rendezvous.max_nodes * args.nproc_per_node
        if planned.world_size != world and rendezvous.min_nodes == rendezvous.max_nodes:
            raise ConfigError(f"--strategy {args.strategy} was planned for {planned.world_size} ranks; this job has "
                              f"{world}: plan again with convoy plan --nodes and --nproc-per-node as this job has")
        os.environ[STRATEGY_ENV] = str(Path(args.strategy).resolve())
        return
    why = ("the job runs on several hosts (--endpoint): plan once with convoy plan and give each host --strategy PATH"
           if args.endpoint else "the job has roles; it plans one training script" if config.roles else
           f"--nnodes {args.nnodes} is elastic; it plans for one world size (give --nnodes N)"
           if rendezvous.min_nodes != rendezvous.max_nodes else
           "the script is not a python file (-m or --no-python)" if args.module or args.no_python else "")
    if why:
        raise ConfigError(f"--strategy auto cannot plan this job: {why}")
    from convoy.strategy.candidates import Hardware
    from convoy.strategy.cli import plan_file
    from convoy.strategy.report import parse_bytes

    check_run_dir(config.master.run_dir)
    memory = parse_bytes(args.strategy_memory, "--strategy-memory")
    hardware = Hardware(rendezvous.max_nodes, args.nproc_per_node, memory, os.cpu_count() or 1).validate()
    out = config.master.run_dir / "convoy-strategy.json"
    plan_file(args.script, list(args.args), hardware, out)
    os.environ[STRATEGY_ENV] = str(out)


def _master(args: argparse.Namespace) -> int:
    from convoy.control.master import JobMaster
    from convoy.control.polls import MASTER_GC_THRESHOLDS
    from convoy.control.token import TOKEN_FILE

    gc.set_threshold(*MASTER_GC_THRESHOLDS)  # this process is the master's alone
    listener = None
    if args.listen_fd is not None:  # bound by the launcher that claimed the job's endpoint
        listener = socket.socket(fileno=args.listen_fd)
    if args.resume is not None:
        if not (args.resume / STATE_FILE).is_file():
            raise ConfigError(f"--resume {str(args.resume)!r}: no job state there (expected {STATE_FILE})")
        master = JobMaster(MasterConfig(run_dir=args.resume), console=_console, resume=True, token_file=args.token_file,
                           listener=listener)
    else:
        config = master_config(args)
        config.job_id, config.tls_cert, config.tls_key = args.job_id, args.tls_cert, args.tls_key
        config.validate()
        master = JobMaster(config, console=_console, token_file=args.token_file, listener=listener)
    master.start()
    if not args.under_run:
        token_file = args.token_file or master.config.run_dir / TOKEN_FILE
        _console(f"convoy: master of job {master.job.job_id} at {master.url}; token file {token_file}")
        _console(f"convoy: on each node: convoy agent --master HOST:{master.api.address[1]} --token-file "
                 f"{token_file} --nproc-per-node K SCRIPT")
    previous = {s: signal.signal(s, raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        master.wait_ended()
        ignore_interrupts()  # the job has ended: the launcher's SIGTERM, sent as it stops, must not break the stop
        code = 0 if master.job.status == "succeeded" else 1
    except Interrupted as exc:
        master.abort(f"master interrupted by {exc}")
        code = exc.exit_code
    finally:
        ignore_interrupts()
        master.wait_acknowledged(2 * master.config.heartbeat_s + 1.0)  # every agent should hear the outcome
        master.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code


def _agent(args: argparse.Namespace) -> int:
    from convoy.control.roles.roles_file import ROLES_FILE, load_roles

    workers = worker_config(args)
    run_dir = args.run_dir or args.token_file.parent
    roles = (run_dir / ROLES_FILE).is_file()
    workers.role_groups = roles and any(role.group for role in load_roles(run_dir))
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
    from convoy.agent.workers import WorkerGroup
    from convoy.ports import local_address_towards

    address = args.host or local_address_towards(host, port)
    forks = None
    if roles and args.job_id and args.node_id:  # its import of torch starts before anything else
        from convoy.agent.forked import ForkServer, start_fork_server

        forks = ForkServer.adopt(args.fork_server, args.job_id) if args.fork_server else \
            start_fork_server(workers, address, args.job_id, args.node_id)
    group = WorkerGroup(workers, run_dir, host=address)
    if not roles:
        if args.fork_server:  # the launcher's: its import of torch began before this agent started
            from convoy.agent.forked import ForkServer

            group.adopt(ForkServer.adopt(args.fork_server, args.job_id or ""))
        group.fill_standbys()  # start importing torch before anything else (a job of roles forks its processes)
    from convoy.agent.agent import Agent, AgentConfig
    from convoy.agent.agent_config import default_node_id

    config = AgentConfig(
        master_host=host, master_port=port, token=token, node_id=args.node_id or default_node_id(run_dir),
        host=address, run_dir=run_dir, workers=workers, tls_ca=args.tls_ca, roles=roles, node_rank=args.node_rank,
        cpus=args.cpus,
    )
    return Agent(config, group, forks).run()


def _status(args: argparse.Namespace) -> int:
    import json

    from convoy.control.roles.views import format_roles, read_role_views
    from convoy.control.status import format_status, format_training, read_memory
    from convoy.control.store import read_part, read_status
    from convoy.control.training.master import STATE_PART
    from convoy.control.training.status_store import latest_by_task

    state = read_status(args.run_dir)
    versions = json.loads(read_part(args.run_dir, STATE_PART) or "{}").get("versions") or []
    training = format_training(latest_by_task(args.run_dir), versions)
    print(format_status(state, read_memory(args.run_dir), format_roles(read_role_views(args.run_dir)) + training))
    return 0


def _console(line: str) -> None:
    log.info(line)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    if command == "run":  # torchrun's flags, in either spelling, as convoy's
        at = argv.index(command)
        try:
            argv = argv[: at + 1] + translate_torchrun(argv[at + 1:])
        except ConvoyError as exc:
            log.error(f"convoy: error: {exc}")
            return EXIT_USAGE
    args = build_parser(command).parse_args(argv)
    log.setup(getattr(args, "log_level", None))
    run_argv = argv[argv.index(command) + 1:] if command == "run" else []
    handlers = {"run": lambda args: _run(args, run_argv), "master": _master, "agent": _agent, "status": _status,
                "scale": scale_roles, "preempt": preempt, "pool": show_pool}
    try:
        if args.command in WORKLOAD_COMMANDS:
            for name in NEEDS.get(args.command, ()):  # before any work: the extra it needs is there
                if importlib.util.find_spec(name) is None:
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return importlib.import_module(WORKLOAD_COMMANDS[args.command][0]).run(args)
        return handlers[args.command](args)
    except ModuleNotFoundError as exc:  # a command whose optional dependency is not installed: say which extra
        extra = EXTRAS.get((exc.name or "").partition(".")[0])
        if extra is None:
            raise
        log.error(f"convoy: error: convoy {args.command} needs {exc.name}, which is not installed: pip install "
                  f"'convoy[{extra}]'")
        return EXIT_USAGE
    except ConvoyError as exc:
        log.error(f"convoy: error: {exc}")
        return EXIT_USAGE
    except BrokenPipeError:  # the reader of our output went away (`convoy status | head -1`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
