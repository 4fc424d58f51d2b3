"""Typed job configuration: dataclasses with one validate() that names the bad field."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import secrets
import shutil
import socket
import stat
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from convoy.errors import ConfigError
from convoy.ray_config import RayConfig, check_scheduler
from convoy.roles_config import RoleSpec, check_roles
from convoy.sanitize import safe_host

STATE_FILE = "state.db"
"""The master's SQLite state inside the run dir."""
RUN_DIR_PROBE_BYTES = 64 << 10
"""What a run dir must take before a job starts: room for the token, the first state and logs."""
MAX_NPROC_PER_NODE = 1024
"""Worker processes one agent may start: past it an agent would fork standbys until fork fails."""
STATUS_RULES = ("nan", "divergence", "plateau", "throughput", "memory")
"""The status rules a job's master judges its ranks by (``control/training/rules.py``), by the names
``--auto-apply`` takes."""


def check_seconds(flag: str, value: float, allow_zero: bool = True) -> None:
    """A timeout flag is a finite number of seconds: nan or inf would make it never fire."""
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        need = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{flag} {value}: need a finite number of seconds {need}")


def parse_nnodes(spec: str) -> tuple[int, int]:
    """Parse ``--nnodes`` as ``N`` or ``MIN:MAX`` into ``(min_nodes, max_nodes)``."""
    parts = str(spec).split(":")
    if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
        raise ConfigError(f"--nnodes {spec!r} is not N or MIN:MAX with whole numbers, e.g. 2 or 1:4")
    low, high = int(parts[0]), int(parts[-1])
    if low < 1 or high < low:
        raise ConfigError(f"--nnodes {spec!r}: need 1 <= MIN <= MAX")
    return low, high


def parse_address(spec: str, flag: str = "--master") -> tuple[str, int]:
    """Parse ``HOST:PORT`` (the master's address as an agent gives it); a URL or a name with other characters
    is refused here, not retried as if the master were down."""
    host, sep, port = spec.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or not safe_host(host):
        raise ConfigError(f"{flag} {spec!r} is not HOST:PORT (no scheme, no path), e.g. 10.0.0.5:29400")
    return host.strip("[]"), int(port)


def resolve_address(host: str, port: int) -> None:
    """A name that does not resolve is a usage error, not a master that is down for a while."""
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(f"--master {host}:{port}: cannot resolve {host!r} ({exc}): check the name") from None


def default_run_dir() -> Path:
    """A fresh run directory under ./convoy-runs named by time and a random suffix."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("convoy-runs") / f"{stamp}-{secrets.token_hex(3)}"


@dataclass
class RendezvousConfig:
    min_nodes: int = 1
    """Fewest nodes a round may start with."""
    max_nodes: int = 1
    """Most nodes a round admits; a round closes at once when this many have joined."""
    wait_s: float = 3.0
    """Once MIN nodes have joined, how long to wait for more before closing the round."""
    join_timeout_s: float = 600.0
    """How long a round may wait for MIN nodes before the job fails."""

    def validate(self) -> None:
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ConfigError(f"nnodes {self.min_nodes}:{self.max_nodes}: need 1 <= MIN <= MAX")
        check_seconds("--rdzv-wait", self.wait_s)
        check_seconds("--join-timeout", self.join_timeout_s, allow_zero=False)


DEFAULT_PRELOAD = ("torch", "torch._dynamo")
ROLE_PRELOAD = ("torch", "convoy.worker.shards", "convoy.parallel.ps.client", "convoy.parallel.ps.service")
"""The fork server's default: torch and convoy's side of roles (the data shards' client, whose pydantic models
take about 0.2 s to build, and the parameter-server client and server), imported once rather than by every
role process as it starts (none reads its environment at import time)."""

GROUP_PRELOAD = ("torch._dynamo", "convoy.runtime.init", "convoy.runtime.checkpoint")
"""Added where a role forms a group: DDP's imports and convoy's torch side (the Checkpointer's alone takes 0.14 s),
paid once per node instead of by every member each time its group forms."""


def _per_rank(value: str, local_rank: int) -> str:
    """A torchrun stream setting (``3``, or ``0:3,1:0``) for one local rank."""
    if ":" not in value:
        return value
    given = dict(item.split(":", 1) for item in value.split(",") if ":" in item)
    return given.get(str(local_rank), "0")


@dataclass
class WorkerConfig:
    entrypoint: str = ""
    """The training script's path, or a module name when ``module`` is set."""
    args: list[str] = field(default_factory=list)
    """Arguments passed to the script unchanged."""
    module: bool = False
    """Run ``entrypoint`` as ``python -m entrypoint``."""
    nproc_per_node: int = 1
    """Worker processes per node (per agent)."""
    stop_grace_s: float = 5.0
    """After SIGTERM, how long a worker may take to exit before it gets SIGKILL."""
    role_name: str = "default"
    """ROLE_NAME of the workers (torchrun's ``--role``)."""
    log_dir: str = ""
    """Where the workers' logs go (``DIR/roundN/rankR.log``; default: the run dir's ``logs``)."""
    redirects: str = "0"
    """torchrun's ``-r``: 3 keeps a local rank's output off the console (log file only); ``0:3,1:0`` per rank."""
    tee: str = "0"
    """torchrun's ``-t``: 3 shows a local rank's output on the console as well as in its file (over ``-r``)."""
    local_ranks_filter: str = ""
    """The local ranks whose output the console shows (``0,1``; empty: all)."""
    no_python: bool = False
    """Run the entrypoint as an executable, not as a Python script (torchrun's ``--no-python``)."""
    master_port: int = 0
    """MASTER_PORT of the first round, if free then (0: a free one; every later round takes a fresh one)."""
    preload: tuple[str, ...] = DEFAULT_PRELOAD
    """Modules the node's fork server imports before it forks the workers (empty: none; each worker is then a
    standby of its own, a fresh interpreter).

    torch._dynamo is in the default because DistributedDataParallel imports it on construction, and that
    import is one of the slowest parts of a worker's start.
    """
    role_groups: bool = False
    """Some role of the job forms a process group (``group = true``): its processes build DDP, so the fork server
    of a job of roles preloads torch._dynamo too (it would cost each group member about 1 s as the group forms)."""

    def shows_console(self, local_rank: int) -> bool:
        """Whether a local rank's output goes to the console (``-r``, ``-t`` and ``--local-ranks-filter``)."""
        if self.local_ranks_filter and str(local_rank) not in self.local_ranks_filter.split(","):
            return False
        return _per_rank(self.tee, local_rank) == "3" or _per_rank(self.redirects, local_rank) != "3"

    def role_preload(self) -> tuple[str, ...]:
        """What the fork server of a job of roles preloads: the list given, but in place of the default list
        ``ROLE_PRELOAD``, with torch._dynamo where a role forms a group. Other role processes (servers, the workers
        of a PS) seldom build DDP, and the import of torch._dynamo (about 2 s of CPU) would stand between the job's
        start and its first process."""
        if self.preload != DEFAULT_PRELOAD:
            return self.preload
        return (*ROLE_PRELOAD, *GROUP_PRELOAD) if self.role_groups else ROLE_PRELOAD

    def validate(self, need_entrypoint: bool = True) -> None:
        """``need_entrypoint`` False: every role of the job has its own script, so the job's may be empty."""
        if not 1 <= self.nproc_per_node <= MAX_NPROC_PER_NODE:
            raise ConfigError(f"--nproc-per-node {self.nproc_per_node}: need 1 to {MAX_NPROC_PER_NODE} workers per "
                              "node")
        check_seconds("--stop-grace", self.stop_grace_s)
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.role_name):
            raise ConfigError(f"--role {self.role_name!r}: a worker role's name is 1 to 64 letters, digits, _ - .")
        for flag, value in (("--redirects", self.redirects), ("--tee", self.tee)):
            if not re.fullmatch(r"[03]|\d+:[03](,\d+:[03])*", value):
                raise ConfigError(f"{flag} {value}: give 0 or 3, or per local rank as 0:3,1:0 (convoy captures stdout "
                                  "and stderr together)")
        if self.local_ranks_filter and not re.fullmatch(r"\d+(,\d+)*", self.local_ranks_filter):
            raise ConfigError(f"--local-ranks-filter {self.local_ranks_filter}: give local ranks, e.g. 0 or 0,2")
        if not 0 <= self.master_port < 65536:
            raise ConfigError(f"--master-port {self.master_port}: give a port 1..65535 (0: a free one)")
        if self.no_python:
            if self.module:
                raise ConfigError("--no-python and -m together: -m runs a Python module; give one of them")
            if not (shutil.which(self.entrypoint) or os.access(self.entrypoint, os.X_OK)):
                raise ConfigError(f"--no-python {self.entrypoint!r}: not an executable found on PATH or here")
            return
        if self.entrypoint or need_entrypoint:
            check_entrypoint(self.entrypoint, self.module)


def check_entrypoint(entrypoint: str, module: bool) -> None:
    """The script (a file, or a directory with __main__.py) or module exists, before any process starts."""
    if not entrypoint:
        raise ConfigError("no training script given: convoy run [options] SCRIPT [ARGS...]")
    if module:
        sys.path.insert(0, os.getcwd())  # where `python -m` looks first, whatever started convoy
        try:
            found = importlib.util.find_spec(entrypoint) is not None
        except (ImportError, ValueError):
            found = False
        finally:
            sys.path.remove(os.getcwd())
        if not found:
            raise ConfigError(f"module {entrypoint!r} not found: check the name and PYTHONPATH")
        return
    path = Path(entrypoint)
    if not path.exists():
        raise ConfigError(f"script {entrypoint!r} not found: give the path of a Python file")
    if path.is_dir() and not (path / "__main__.py").is_file():
        raise ConfigError(f"script {entrypoint!r} is a directory without __main__.py")
    if path.is_file() and not os.access(path, os.R_OK):
        raise ConfigError(f"script {entrypoint!r} is not readable")


@dataclass
class MasterConfig:
    host: str = "127.0.0.1"
    """Address the master's HTTP API listens on."""
    port: int = 0
    """Port of the HTTP API; 0 picks a free one."""
    max_restarts: int = 3
    """Worker failures the job survives; the next one fails the job."""
    heartbeat_s: float = 1.0
    """How often agents check in (a long poll, so changes still arrive at once)."""
    heartbeat_timeout_s: float = 30.0
    """An agent silent for this long is considered lost."""
    run_dir: Path = field(default_factory=default_run_dir)
    """Where the state database, token, and logs go."""
    rendezvous: RendezvousConfig = field(default_factory=RendezvousConfig)
    job_id: str = ""
    """The job's id; empty picks a random one."""
    max_regroups: int = 10
    """Regroups one node may cause (lost, or joining a running job) per ``regroup_window_s``; one more
    excludes it, so a flapping node cannot restart the job forever."""
    regroup_window_s: float = 600.0
    """The window, in seconds, over which a node's regroups are counted."""
    tls_cert: str = ""
    """PEM certificate (chain) the API serves TLS with; empty: plain HTTP."""
    tls_key: str = ""
    """The certificate's private key (PEM)."""
    train_overrides: dict[str, str] = field(default_factory=dict)
    """The training config's values the job sets over the script's defaults (``--set KEY=VALUE``, ``[train]``);
    checked against the script's fields when it declares them."""
    auto_apply: tuple[str, ...] = ()
    """Status rules whose proposals the master applies by itself (``--auto-apply nan,divergence``)."""
    priority: int = 0
    """The job's priority among the jobs of its pool: a job of higher priority that asks for more CPUs than are free
    gets them from the elastic roles of jobs below it (``--priority``)."""
    preempt_grace_s: float = 10.0
    """How long a preempted process has, once told, to finish its unit of work before SIGTERM (``--preempt-grace``)."""
    pool: str = ""
    """The pool's file this job's claims go to (its nodes all on this machine: ``convoy run`` gives it); empty: the
    job is in no pool (nodes on several hosts)."""
    peer_loss_wait_s: float = 2.0
    """How long a worker failure that reads as a lost peer waits for news of a lost node (a regroup, no restart)
    before it counts as a restart: longer where that news takes longer to come (a Ray node's loss)."""

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "run_dir": str(self.run_dir)})

    @classmethod
    def from_json(cls, text: str) -> MasterConfig:
        data = json.loads(text)
        rendezvous = RendezvousConfig(**data.pop("rendezvous"))
        return cls(**{**data, "run_dir": Path(data["run_dir"]), "rendezvous": rendezvous,
                      "auto_apply": tuple(data.get("auto_apply", ()))})

    def validate(self, resume: bool = False) -> None:
        self.rendezvous.validate()
        if self.job_id and not (self.job_id.isalnum() and len(self.job_id) <= 32):
            raise ConfigError(f"--job-id {self.job_id!r}: use up to 32 letters and digits")
        if self.max_regroups < 1:
            raise ConfigError(f"--max-regroups {self.max_regroups}: need 1 or more regroups per node and window")
        check_seconds("--regroup-window", self.regroup_window_s, allow_zero=False)
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts {self.max_restarts}: need 0 or more")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"--port {self.port}: need 0..65535 (0 picks a free port)")
        check_seconds("--heartbeat-timeout", self.heartbeat_timeout_s, allow_zero=False)
        if self.heartbeat_s <= 0 or self.heartbeat_timeout_s <= self.heartbeat_s:
            raise ConfigError("need 0 < heartbeat interval < heartbeat timeout")
        unknown = sorted(set(self.auto_apply) - set(STATUS_RULES))
        if unknown:
            raise ConfigError(f"--auto-apply {','.join(unknown)}: not a status rule "
                              f"(the rules: {', '.join(STATUS_RULES)})")
        check_seconds("--preempt-grace", self.preempt_grace_s)
        check_seconds("--peer-loss-wait", self.peer_loss_wait_s)
        if not -1000 <= self.priority <= 1000:
            raise ConfigError(f"--priority {self.priority}: give a whole number from -1000 to 1000")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("give --tls-cert and --tls-key together (or neither, for plain HTTP)")
        for flag, path in (("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key)):
            if path and not os.access(path, os.R_OK):
                raise ConfigError(f"{flag} {path!r} is not a readable file")
        check_run_dir(self.run_dir)
        if (self.run_dir / STATE_FILE).exists() and not resume:
            raise ConfigError(f"run dir {str(self.run_dir)!r} already holds a job's state: give a new --run-dir "
                              "(or continue it with convoy master --resume)")


@dataclass
class JobConfig:
    """A whole local job, as ``convoy run`` starts it: one master plus N local agents."""

    master: MasterConfig = field(default_factory=MasterConfig)
    workers: WorkerConfig = field(default_factory=WorkerConfig)
    roles: tuple[RoleSpec, ...] = ()
    """The job's roles; empty: one role (DEFAULT_ROLE) of every worker process, as before roles existed."""
    scheduler: str = "local"
    """What places the job's nodes: ``local`` (agents as child processes here) or ``ray`` (one per Ray node)."""
    ray: RayConfig = field(default_factory=RayConfig)
    """With ``scheduler = "ray"``: the cluster and each node's share of it."""

    @property
    def num_agents(self) -> int:
        return self.master.rendezvous.max_nodes

    def validate(self, resume: bool = False) -> None:
        """``resume``: the run dir holds this job's state already (a driver started again)."""
        self.workers.validate(need_entrypoint=not self.roles or not all(role.entrypoint for role in self.roles))
        check_roles(self.roles, job_has_script=bool(self.workers.entrypoint))
        for role in self.roles:
            if role.entrypoint:
                try:
                    check_entrypoint(role.entrypoint, role.module)
                except ConfigError as exc:
                    raise ConfigError(f"role {role.name!r}: {exc}") from None
        self.master.validate(resume)
        check_scheduler(self.scheduler)
        if self.scheduler == "ray":
            self.ray.validate()


def check_run_dir(run_dir: Path) -> None:
    """Create the run directory (mode 0700), or say why it cannot be used.

    A directory others may write to is refused (unless sticky and ours): they could replace the token or
    the state by a link, or read what the job writes."""
    try:
        run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"run dir {str(run_dir)!r} cannot be created: {exc.strerror}") from exc
    if not run_dir.is_dir():
        raise ConfigError(f"run dir {str(run_dir)!r} is not a directory")
    info = run_dir.stat()
    sticky_and_ours = info.st_mode & stat.S_ISVTX and info.st_uid == os.geteuid()
    if info.st_mode & stat.S_IWOTH and not sticky_and_ours:
        raise ConfigError(f"run dir {str(run_dir)!r} is writable by others (mode {stat.S_IMODE(info.st_mode):o}): "
                          f"chmod o-w {str(run_dir)!r} or give another --run-dir")
    probe = run_dir / f".write-test-{os.getpid()}"
    try:
        probe.write_bytes(b"\0" * RUN_DIR_PROBE_BYTES)  # bytes, not just a name: a full disk takes no more
    except OSError as exc:
        raise ConfigError(f"run dir {str(run_dir)!r} is not writable: {exc.strerror}") from exc
    finally:
        probe.unlink(missing_ok=True)

