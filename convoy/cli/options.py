"""The options of ``convoy run | master | agent`` and the configs they make (``JobConfig`` from a command line,
over a job file's options)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Sequence

from convoy.cli.jobfile import JOB_FILE_SUFFIX, load_job_file
from convoy.config import (MAX_NPROC_PER_NODE, JobConfig, MasterConfig, RendezvousConfig, WorkerConfig, default_run_dir,
                           parse_nnodes)
from convoy.control.training.versions import parse_assignments
from convoy.log import LEVELS
from convoy.ray_config import SCHEDULERS, RayConfig, parse_resources, parse_size
from convoy.roles_config import apply_role_counts, role_counts_from_flags

_WORKERS, _MASTER, _RDZV, _RAY = WorkerConfig(), MasterConfig(run_dir=Path(".")), RendezvousConfig(), RayConfig()
LISTS = ("role", "set", "ray_resource")
"""The repeatable flags: a job file's list and the command line's add up."""
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
"""torchrun's default ``--signals-to-handle``."""

class ExplicitOnly:
    """Adds each option with no default, so that a parse holds only the options a command line names (what
    overrides a job file)."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser

    def add_argument(self, *names: str, **options: Any) -> argparse.Action:
        return self.parser.add_argument(*names, **{**options, "default": argparse.SUPPRESS})


Options = argparse.ArgumentParser | ExplicitOnly


def add_worker_options(parser: Options) -> None:
    parser.add_argument("--nproc-per-node", type=int, default=_WORKERS.nproc_per_node,
                        help=f"worker processes per node (1 to {MAX_NPROC_PER_NODE})")
    parser.add_argument("--stop-grace", type=float, default=_WORKERS.stop_grace_s,
                        help="seconds from SIGTERM to SIGKILL (default %(default)s)")
    parser.add_argument("--preload", default=",".join(_WORKERS.preload),
                        help="comma-separated modules the node's fork server imports before it forks the workers "
                             "('' for none: each worker then starts as a process of its own; default %(default)s)")
    parser.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module, like python -m")
    parser.add_argument("--no-python", action="store_true", help="run SCRIPT as an executable, not with python")
    parser.add_argument("--role-name", default=_WORKERS.role_name, help="the workers' ROLE_NAME (torchrun's --role)")
    parser.add_argument("--log-dir", default="", help="where the workers' logs go (default: RUN_DIR/logs)")
    parser.add_argument("--redirects", "-r", default="0", metavar="0|3|R:N,...",
                        help="3: a local rank's output goes to its log file only (torchrun's -r)")
    parser.add_argument("--tee", "-t", default="0", metavar="0|3|R:N,...",
                        help="3: a local rank's output goes to the console too (over --redirects)")
    parser.add_argument("--local-ranks-filter", default="", metavar="R,...",
                        help="show only these local ranks' output on the console")
    parser.add_argument("--master-port", type=int, default=0,
                        help="the first round's MASTER_PORT, if it is free (later rounds take fresh ones)")
    parser.add_argument("script", metavar="SCRIPT", nargs="?", default="",
                        help="training script (or module with -m); for `convoy run`, a path ending in .toml is a job "
                             "file of options and [roles.NAME] tables, and flags before or after it override it")
    parser.add_argument("args", metavar="ARGS", nargs=argparse.REMAINDER, help="arguments for the script")


def add_master_options(parser: Options, host: str) -> None:
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
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a value of the script's training config (convoy.train_config), over its default; "
                             "repeatable")
    parser.add_argument("--priority", type=int, default=_MASTER.priority, metavar="N",
                        help="the job's priority among the jobs on this machine: one of higher priority that asks for "
                             "more CPUs than are free gets them from the elastic roles of lower ones (default 0)")
    parser.add_argument("--preempt-grace", type=float, default=_MASTER.preempt_grace_s, metavar="S",
                        help="seconds a preempted process has to finish its unit of work before SIGTERM "
                             "(default %(default)s)")
    parser.add_argument("--auto-apply", default="", metavar="RULES",
                        help="status rules whose proposals the master applies by itself, e.g. nan,divergence "
                             "(default: none; a person applies them with convoy config proposals --apply)")
    parser.add_argument("--log-level", default=None, choices=LEVELS,
                        help="convoy's own messages from this level up: debug, info (default, or $CONVOY_LOG_LEVEL), "
                             "warning, error; the workers' output is always shown")


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


def add_run_options(parser: Options) -> None:
    add_master_options(parser, "127.0.0.1")
    parser.add_argument("--job-id", default="", help="the job's id (default: random; torchrun's --rdzv-id)")
    parser.add_argument("--relaunch", action="store_true", help="start an agent again when it dies")
    parser.add_argument("--endpoint", default="", metavar="HOST:PORT",
                        help="a job of several hosts, the same command on each (torchrun's --rdzv-endpoint): the "
                             "first to claim HOST:PORT serves the master there, the others join it; each runs one node")
    parser.add_argument("--token-file", type=Path, default=None, metavar="PATH",
                        help="with --endpoint: the job's token file, shared by the hosts (default RUN_DIR/token)")
    parser.add_argument("--node-rank", type=int, default=-1, metavar="K",
                        help="with --endpoint: this host's node rank in the first round (torchrun's --node-rank)")
    parser.add_argument("--join-token", default="", metavar="TOKEN",
                        help="with --endpoint: the job's token, the same on every host (torchrun's --rdzv-conf "
                             "token=...)")
    parser.add_argument("--ps", default=None, metavar="N|MIN:MAX",
                        help="parameter-server processes (the role 'ps'; default: no such role)")
    parser.add_argument("--workers", default=None, metavar="N|MIN:MAX|auto",
                        help="worker processes (the role 'worker'; auto: as many as fit the memory one measured "
                             "iteration needs)")
    parser.add_argument("--role", action="append", default=[], metavar="NAME=COUNT",
                        help="a role and its count (N, MIN:MAX or auto), e.g. --role actor=4; repeatable")
    parser.add_argument("--signals-to-handle", default=TORCHRUN_SIGNALS, metavar="SIG,...",
                        help="signals on which convoy run stops the job in order and exits 128+N, as torchrun does "
                             "(SIGINT and SIGTERM always; one it was started with ignored, as nohup does SIGHUP, "
                             "stays ignored); the workers see the list as TORCHELASTIC_SIGNALS_TO_HANDLE "
                             "(default %(default)s)")
    parser.add_argument("--local-addr", default="", metavar="HOST",
                        help="this host's address, the one its workers and the other hosts reach it at (MASTER_ADDR "
                             "where it runs rank 0; torchrun's --local-addr; default 127.0.0.1 on one host, else the "
                             "address towards the master)")
    parser.add_argument("--strategy", default="", metavar="auto|PATH",
                        help="auto: search SCRIPT's training strategy for this job's nodes and ranks first (convoy "
                             "plan), then run with it; PATH: a strategy file convoy plan wrote. The workers' "
                             "convoy.accelerate(strategy='auto') finds it through $CONVOY_STRATEGY_FILE")
    parser.add_argument("--strategy-memory", default="2GB", metavar="SIZE",
                        help="with --strategy auto: the memory a rank may use for training, e.g. 1.5GB (default "
                             "%(default)s)")
    add_ray_options(parser)
    add_worker_options(parser)


def add_ray_options(parser: Options) -> None:
    parser.add_argument("--scheduler", default="local", choices=SCHEDULERS,
                        help="local: the nodes are agents on this machine (default); ray: one agent per node of a Ray "
                             "cluster, placed as an actor there (pip install 'convoy[ray]')")
    parser.add_argument("--address", default=_RAY.address, metavar="auto|HOST:PORT",
                        help="with --scheduler ray: the cluster's head (default auto: the one this machine joined)")
    parser.add_argument("--placement-timeout", type=float, default=_RAY.placement_timeout_s, metavar="S",
                        help="with --scheduler ray: seconds MIN nodes may take to be placed before the job fails "
                             "naming what is missing (default %(default)s)")
    parser.add_argument("--ray-cpus", type=float, default=0.0, metavar="N",
                        help="CPUs each node's agent holds on Ray (default: one per worker, or the roles' CPUs per "
                             "node)")
    parser.add_argument("--ray-gpus", type=float, default=0.0, metavar="N",
                        help="GPUs each node's agent holds on Ray (default: the roles' GPUs per node, else none)")
    parser.add_argument("--ray-memory", default="", metavar="SIZE", help="memory each node's agent holds on Ray")
    parser.add_argument("--ray-resource", action="append", default=[], metavar="NAME=AMOUNT",
                        help="a custom Ray resource each node's agent holds (places the job on nodes that have it); "
                             "repeatable")
    parser.add_argument("--resume", type=Path, default=None, metavar="RUN_DIR",
                        help="take back a job on Ray whose driver was killed (on the same machine, within the agents' "
                             "30 s without a master): its command line is in RUN_DIR")


def ray_config(args: argparse.Namespace) -> RayConfig:
    return RayConfig(address=args.address, placement_timeout_s=args.placement_timeout, cpus=args.ray_cpus,
                     gpus=args.ray_gpus, memory_bytes=parse_size(args.ray_memory, "--ray-memory"),
                     resources=parse_resources(args.ray_resource))


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    return WorkerConfig(
        entrypoint=args.script, args=list(args.args), module=args.module, nproc_per_node=args.nproc_per_node,
        stop_grace_s=args.stop_grace, preload=tuple(filter(None, args.preload.split(","))),
        role_name=args.role_name, log_dir=args.log_dir, redirects=args.redirects, tee=args.tee,
        local_ranks_filter=args.local_ranks_filter, no_python=args.no_python, master_port=args.master_port,
    )


def master_config(args: argparse.Namespace) -> MasterConfig:
    min_nodes, max_nodes = parse_nnodes(args.nnodes)
    rendezvous = RendezvousConfig(min_nodes, max_nodes, args.rdzv_wait, args.join_timeout)
    return MasterConfig(
        host=args.host, port=args.port, max_restarts=args.max_restarts, heartbeat_timeout_s=args.heartbeat_timeout,
        run_dir=args.run_dir or default_run_dir(), rendezvous=rendezvous, max_regroups=args.max_regroups,
        regroup_window_s=args.regroup_window, train_overrides=parse_assignments(args.set),
        job_id=getattr(args, "job_id", "") if getattr(args, "command", "") == "run" else "",
        auto_apply=tuple(filter(None, (rule.strip() for rule in args.auto_apply.split(",")))),
        priority=args.priority, preempt_grace_s=args.preempt_grace, pool=getattr(args, "pool", "") or "",
        peer_loss_wait_s=getattr(args, "peer_loss_wait", _MASTER.peer_loss_wait_s),
    )


def job_config(args: argparse.Namespace, run_argv: Sequence[str]) -> tuple[JobConfig, argparse.Namespace]:
    """The job of ``convoy run``; with a job file, its options under those the command line gives."""
    roles: tuple = ()
    if args.script.endswith(JOB_FILE_SUFFIX) and not args.module:
        job_file = load_job_file(Path(args.script))
        before = _given(run_argv)  # the options before the job file; those after it come as its ARGS
        after = _given(before.pop("args"))
        before.pop("script")
        if "script" not in after:
            after.pop("args")
        reset = {"script": "", "args": [], "ps": None, "workers": None, "role": [], "set": [],  # file, then flags
                 "ray_resource": []}
        args = argparse.Namespace(**{**vars(args), **reset, **job_file.options})
        for given in (before, after):
            for dest, value in given.items():
                setattr(args, dest, [*getattr(args, dest), *value] if dest in LISTS else value)
        roles = job_file.roles
    counts = role_counts_from_flags({dest: getattr(args, dest) for dest in ("ps", "workers")}, args.role)
    roles = apply_role_counts(roles, counts, job_has_script=bool(args.script))
    return JobConfig(master=master_config(args), workers=worker_config(args), roles=roles, scheduler=args.scheduler,
                     ray=ray_config(args)), args


def _given(argv: Sequence[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="convoy run")
    add_run_options(ExplicitOnly(parser))
    return vars(parser.parse_args(argv))
