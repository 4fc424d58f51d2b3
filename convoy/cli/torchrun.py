"""torchrun's command line for ``convoy run``: its flags, in both spellings, turned into convoy's before parsing.

``convoy run`` takes a torchrun command line with the same meaning: on one host (``--standalone``, or a local
``--rdzv-endpoint`` / ``--master-addr``), and on several, the same command on each host (``--rdzv-endpoint
HOST:PORT``, or ``--master-addr``/``--master-port`` with ``--node-rank``), which becomes convoy's ``--endpoint``
(``launch/endpoint.py``: the first to claim it serves the master there). Every flag of torchrun 2.13's ``--help``
is taken with its meaning there, or is a ConfigError that names it and says why (``REFUSED``, an etcd backend, a
partial redirect). Pure: argv in, argv out (``count_devices`` asks torch only for ``gpu``, ``xpu`` or ``auto``).
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import socket
from dataclasses import dataclass
from typing import Callable

from convoy.cli.options import add_run_options
from convoy.errors import ConfigError

SPELLINGS = {f"--{name.replace('-', '_')}": f"--{name}" for name in (
    "nproc-per-node", "node-rank", "rdzv-backend", "rdzv-endpoint", "rdzv-id", "rdzv-conf", "master-addr",
    "master-port", "max-restarts", "monitor-interval", "log-dir", "local-ranks-filter", "run-path", "no-python",
    "local-addr", "start-method", "event-log-handler", "duplicate-stdout-filters", "duplicate-stderr-filters",
    "logs-specs", "numa-binding", "signals-to-handle", "shutdown-timeout", "virtual-local-rank")}
"""torchrun's underscore spelling of each flag -> the dashed one."""
VALUED = {"--nproc-per-node", "--node-rank", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--rdzv-conf",
          "--master-addr", "--master-port", "--monitor-interval", "--role", "--log-dir", "--redirects", "--tee",
          "--local-ranks-filter", "--nnodes", "--max-restarts", "--local-addr", "-r", "-t", "--start-method",
          "--event-log-handler", "--duplicate-stdout-filters", "--duplicate-stderr-filters", "--logs-specs",
          "--numa-binding", "--signals-to-handle", "--shutdown-timeout"}
BACKENDS = ("c10d", "static")
LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", "0.0.0.0", ""}
START_METHODS = ("spawn", "fork", "forkserver")
EVENT_HANDLERS = ("null", "console", "dynamic_rendezvous")
"""The event log handlers torch 2.13 registers (``torch.distributed.elastic.events.handlers``)."""
STOP_SIGNALS = ("SIGHUP", "SIGINT", "SIGQUIT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGXCPU", "SIGPWR")
"""What ``--signals-to-handle`` may name: the signals that ask a process to stop (a scheduler's, a terminal's)."""
REFUSED = {
    "--logs-specs": "convoy loads no torchrun.logs_specs plug-in: each worker's output goes to RUN_DIR/logs/"
                    "round<R>/rank<N>.log (or --log-dir), shaped by -r, -t and --local-ranks-filter; leave it out",
    "--numa-binding": "convoy does not bind each worker to the CPUs near its GPU; leave it out, or start convoy run "
                      "under numactl to bind the whole job",
    "--virtual-local-rank": "convoy gives each worker its own LOCAL_RANK and leaves CUDA_VISIBLE_DEVICES as it is; "
                            "leave it out and pick the device with torch.cuda.set_device(LOCAL_RANK)",
}
"""torchrun's flags convoy cannot honour, and why (each a one-line ConfigError naming the flag)."""
_STOP = {"-m", "--module"}


@dataclass
class _Line:
    """What a flag's meaning may depend on: the other flags of the line, and the host's devices."""

    given: dict[str, str | None]
    devices: Callable[[str], int]

    @property
    def nnodes(self) -> str:
        return self.given.get("--nnodes") or "1"

    @property
    def one_node(self) -> bool:
        return self.nnodes in ("1", "1:1")


def count_devices(kind: str) -> int:
    """This host's devices of ``kind`` as torchrun counts them: ``cuda``, ``xpu``, or ``auto`` (the current
    accelerator's; 0 without one)."""
    import torch  # only for --nproc-per-node gpu, xpu or auto: any other command line starts without torch

    if kind == "auto":
        return torch.accelerator.device_count() if torch.accelerator.is_available() else 0
    backend = getattr(torch, kind)
    return backend.device_count() if backend.is_available() else 0


def _local(host: str) -> bool:
    return host in LOCAL_HOSTS or host in {socket.gethostname(), socket.getfqdn()}


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """The launcher's options, and the script with its arguments (from the first word that is not an option)."""
    index = 0
    while index < len(argv):
        arg = argv[index]
        name = arg.split("=", 1)[0]
        name = SPELLINGS.get(name, name)
        if not arg.startswith("-") or arg == "--":
            break
        if name in _STOP:
            index += 1
            break
        index += 1 if "=" in arg or name not in VALUED and not _convoy_valued(name) else 2
    return argv[:index], argv[index:]


def _convoy_valued(name: str) -> bool:
    """convoy's own options that take a value (so their value is not taken for the script), from its parser."""
    return name in _convoy_valued_options()


@functools.cache
def _convoy_valued_options() -> frozenset[str]:
    parser = argparse.ArgumentParser(add_help=False)
    add_run_options(parser)
    return frozenset(option for action in parser._actions if action.nargs != 0 for option in action.option_strings)


def translate(argv: list[str], devices: Callable[[str], int] = count_devices) -> list[str]:
    """``convoy run``'s argv with torchrun's flags turned into convoy's; ``devices``: this host's devices by kind."""
    options, rest = _split(list(argv))
    pairs: list[tuple[str, str | None]] = []
    index = 0
    while index < len(options):
        arg = options[index]
        name, eq, value = arg.partition("=")
        name = SPELLINGS.get(name, name)
        valued = name in VALUED or _convoy_valued(name)
        if valued and not eq:
            if index + 1 >= len(options):
                raise ConfigError(f"{name} needs a value")
            value, index = options[index + 1], index + 1
        pairs.append((name, value if (eq or valued) else None))
        index += 1
    line = _Line({name: value for name, value in pairs}, devices)
    out: list[str] = []
    for name, value in pairs:
        if name in REFUSED:
            raise ConfigError(f"{name}{' ' + value if value else ''}: {REFUSED[name]}")
        handler = HANDLERS.get(name)
        out += handler(name, value or "", line) if handler else [name] if value is None else [name, value]
    return out + rest


def _several_hosts(line: _Line) -> bool:
    """A job of several nodes (or with its rendezvous on another host): one launcher per host, convoy's --endpoint."""
    given = line.given
    endpoint = given.get("--rdzv-endpoint") or given.get("--master-addr") or ""
    host = endpoint.rpartition(":")[0] if "--rdzv-endpoint" in given and ":" in endpoint else endpoint
    return ("--rdzv-endpoint" in given or "--master-addr" in given) and (
        not line.one_node or not _local(host.strip("[]")))


def _endpoint(name: str, value: str, line: _Line) -> list[str]:
    """``--endpoint HOST:PORT`` from torchrun's ``--rdzv-endpoint HOST[:PORT]`` (port 29400 by default, as
    torchrun's) or ``--master-addr HOST`` with ``--master-port`` (29500 by default)."""
    if name == "--rdzv-endpoint":
        if value.endswith("]") or ":" not in value:
            host, port = value, "29400"
        else:
            host, _, port = value.rpartition(":")
    else:
        if "--rdzv-endpoint" in line.given:
            return []  # the endpoint names the rendezvous; MASTER_ADDR is then the first node's, as in torchrun
        host, port = value, line.given.get("--master-port") or "29500"
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{name} {value}: the port is not a number 1..65535")
    if not host:
        raise ConfigError(f"{name} {value}: give the host of the rendezvous")
    return ["--endpoint", f"{host}:{port}"]


def _standalone(name: str, value: str, line: _Line) -> list[str]:
    if not line.one_node:
        raise ConfigError(f"--standalone runs one node, but --nnodes is {line.nnodes}: drop one of them")
    return []


def _nproc(name: str, value: str, line: _Line) -> list[str]:
    return ["--nproc-per-node", str(nproc_per_node(value, line.devices))]


def _backend(name: str, value: str, line: _Line) -> list[str]:
    if value not in BACKENDS:
        raise ConfigError(f"--rdzv-backend {value}: convoy's master is the rendezvous; give c10d or static (or leave "
                          "it out)")
    return []


def _rendezvous(name: str, value: str, line: _Line) -> list[str]:
    """``--rdzv-endpoint`` / ``--master-addr``: several hosts' endpoint, or on one host where the master listens."""
    if _several_hosts(line):
        return _endpoint(name, value, line)
    host, port = value, ""
    if name == "--rdzv-endpoint" and ":" in host:
        host, _, port = host.rpartition(":")
    if not _local(host.strip("[]")) or not line.one_node:
        raise ConfigError(f"{name} {value}: a rendezvous on another host (or of several nodes) is not taken by "
                          "convoy run yet; start `convoy master --host 0.0.0.0 --port PORT` on one host and "
                          "`convoy agent --master HOST:PORT` on each")
    if name == "--rdzv-endpoint" and port:
        if not port.isdigit():
            raise ConfigError(f"--rdzv-endpoint {value}: the port is not a number")
        return ["--port", port] if "--master-port" not in line.given else []
    return []


def _master_port(name: str, value: str, line: _Line) -> list[str]:
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise ConfigError(f"--master-port {value}: give a port 1..65535")
    if _several_hosts(line) and "--rdzv-endpoint" not in line.given:
        return []  # with --master-addr on several hosts it is the rendezvous's port: convoy's master serves it
    return ["--master-port", value]


def _node_rank(name: str, value: str, line: _Line) -> list[str]:
    if not value.isdigit():
        raise ConfigError(f"--node-rank {value}: give a number 0..NNODES-1")
    if _several_hosts(line):
        return ["--node-rank", value]
    if value != "0" or not line.one_node:
        raise ConfigError(f"--node-rank {value}: convoy run starts the nodes of one host itself; on several hosts "
                          "run `convoy agent` on each (the master gives the ranks)")
    return []


def _monitor_interval(name: str, value: str, line: _Line) -> list[str]:
    try:
        seconds = float(value)
    except ValueError:
        raise ConfigError(f"--monitor-interval {value}: give seconds, a number above 0") from None
    if not seconds > 0:
        raise ConfigError(f"--monitor-interval {value}: give seconds, a number above 0")
    return []  # convoy's agent watches its workers every 20 ms, more often than any interval asks


def _start_method(name: str, value: str, line: _Line) -> list[str]:
    """Taken, and nothing to do: torchrun starts a script as a process of its own whatever the method (the method
    is that of its multiprocessing, for a function or --run-path); convoy forks each worker from the node's server,
    which has imported only --preload, and runs the script there as a fresh ``__main__``."""
    if value not in START_METHODS:
        raise ConfigError(f"--start-method {value}: give spawn, fork or forkserver (torchrun's choices)")
    return []


def _event_log_handler(name: str, value: str, line: _Line) -> list[str]:
    """Taken: convoy records the job's events in RUN_DIR/state.db whatever the handler (``convoy status`` lists
    them) and prints the job's course (rounds, failures, restarts, the end) on its console."""
    if value not in EVENT_HANDLERS:
        raise ConfigError(f"--event-log-handler {value}: torch registers null, console and dynamic_rendezvous; convoy "
                          "records the job's events in RUN_DIR/state.db with any of them (convoy status lists them)")
    return []


def _duplicate_filters(name: str, value: str, line: _Line) -> list[str]:
    """An empty list duplicates nothing, in torchrun as here; convoy cannot pick one stream's lines out."""
    if value:
        raise ConfigError(f"{name} {value}: convoy captures a worker's stdout and stderr as one stream, so it cannot "
                          "copy one stream's lines; grep the rank's log (RUN_DIR/logs/round<R>/rank<N>.log, or under "
                          "--log-dir) instead")
    return []


def _signals(name: str, value: str, line: _Line) -> list[str]:
    stop_signals(value)
    return ["--signals-to-handle", value]


def _shutdown_timeout(name: str, value: str, line: _Line) -> list[str]:
    """torchrun's seconds from a worker's stop signal to its SIGKILL: convoy's --stop-grace."""
    if not value.isdigit():
        raise ConfigError(f"--shutdown-timeout {value}: give whole seconds >= 0 (convoy's --stop-grace takes "
                          "fractions)")
    return ["--stop-grace", value]


def _run_path(name: str, value: str, line: _Line) -> list[str]:
    return []  # convoy runs the script with runpy.run_path, as torchrun's --run-path does


def _role(name: str, value: str, line: _Line) -> list[str]:
    return ["--role", value] if "=" in value else ["--role-name", value]


def _redirect(name: str, value: str, line: _Line) -> list[str]:
    return _streams("--redirects" if name in ("--redirects", "-r") else "--tee", value)


HANDLERS: dict[str, Callable[[str, str, _Line], list[str]]] = {
    "--standalone": _standalone, "--nproc-per-node": _nproc, "--rdzv-backend": _backend,
    "--rdzv-endpoint": _rendezvous, "--master-addr": _rendezvous, "--master-port": _master_port,
    "--node-rank": _node_rank, "--rdzv-id": lambda name, value, line: ["--job-id", value],
    "--rdzv-conf": lambda name, value, line: _rdzv_conf(value), "--monitor-interval": _monitor_interval,
    "--run-path": _run_path, "--role": _role, "--redirects": _redirect, "-r": _redirect, "--tee": _redirect,
    "-t": _redirect, "--start-method": _start_method, "--event-log-handler": _event_log_handler,
    "--duplicate-stdout-filters": _duplicate_filters, "--duplicate-stderr-filters": _duplicate_filters,
    "--signals-to-handle": _signals, "--shutdown-timeout": _shutdown_timeout,
}
"""torchrun's flag -> what it becomes in convoy's command line (a flag not here is convoy's own, kept as it is)."""


def nproc_per_node(value: str, devices: Callable[[str], int]) -> int:
    """torchrun's ``--nproc-per-node``: a number, ``cpu`` (the CPUs this process may use), ``gpu``, ``xpu``, or
    ``auto`` (the accelerator's devices if there is one, else the CPUs)."""
    if value.isdigit():
        return int(value)
    if value == "cpu" or (value == "auto" and devices("auto") == 0):
        return len(os.sched_getaffinity(0))
    kind = {"gpu": "cuda", "xpu": "xpu", "auto": "auto"}.get(value)
    if kind is None:
        raise ConfigError(f"--nproc-per-node {value!r}: give a number, cpu, gpu, xpu or auto")
    count = devices(kind)
    if count == 0:
        raise ConfigError(f"--nproc-per-node {value}: this host has no {kind.upper()} device; give a number, cpu or "
                          "auto")
    return count


def stop_signals(text: str) -> list[signal.Signals]:
    """torchrun's ``--signals-to-handle`` (``SIGTERM,SIGUSR1``) as signals; a name convoy cannot stop on is named."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    for name in names:
        if name not in STOP_SIGNALS or not hasattr(signal, name):
            raise ConfigError(f"--signals-to-handle {name}: give signals that ask a process to stop, from "
                              f"{', '.join(STOP_SIGNALS)}")
    return [signal.Signals[name] for name in names]


def _rdzv_conf(text: str) -> list[str]:
    out: list[str] = []
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key == "join_timeout":
            out += ["--join-timeout", value]
        elif key == "token":
            out += ["--join-token", value]
        elif key == "token_file":
            out += ["--token-file", value]
        elif key == "last_call_timeout":
            out += ["--rdzv-wait", value]
        elif key in ("read_timeout", "timeout", "is_host", "store_type"):
            continue  # of torch's TCPStore, which convoy's master stands in for
        else:
            raise ConfigError(f"--rdzv-conf {key}: convoy takes join_timeout, last_call_timeout, token and token_file "
                              "(read_timeout, timeout, is_host and store_type do not apply to its master)")
    return out


def _streams(flag: str, value: str) -> list[str]:
    """``-r``/``-t``: convoy captures a worker's stdout and stderr together, so a stream is both or neither: 0 or
    3 (for every local rank, or per local rank as ``0:3,1:0``)."""
    parts = [part.rpartition(":")[2] for part in value.split(",")] if value else [""]
    if any(part not in ("0", "3") for part in parts):
        raise ConfigError(f"{flag} {value}: convoy captures stdout and stderr together; give 0 or 3 (per local rank "
                          "as 0:3,1:0)")
    return [flag, value]
