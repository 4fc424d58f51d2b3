"""torchrun's command line for ``convoy run``: its flags, in both spellings, turned into convoy's before parsing.

``convoy run`` takes a torchrun command line with the same meaning: on one host (``--standalone``, or a local
``--rdzv-endpoint`` / ``--master-addr``), and on several, the same command on each host (``--rdzv-endpoint
HOST:PORT``, or ``--master-addr``/``--master-port`` with ``--node-rank``), which becomes convoy's ``--endpoint``
(``control/endpoint.py``: the first to claim it serves the master there). A flag convoy cannot honour (an etcd
backend, a partial redirect) is a ConfigError that names it. Pure: argv in, argv out.
"""

from __future__ import annotations

import os
import socket

from convoy.errors import ConfigError

SPELLINGS = {f"--{name.replace('-', '_')}": f"--{name}" for name in (
    "nproc-per-node", "node-rank", "rdzv-backend", "rdzv-endpoint", "rdzv-id", "rdzv-conf", "master-addr",
    "master-port", "max-restarts", "monitor-interval", "log-dir", "local-ranks-filter", "run-path", "no-python",
    "local-addr")}
"""torchrun's underscore spelling of each flag -> the dashed one."""
VALUED = {"--nproc-per-node", "--node-rank", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--rdzv-conf",
          "--master-addr", "--master-port", "--monitor-interval", "--role", "--log-dir", "--redirects", "--tee",
          "--local-ranks-filter", "--nnodes", "--max-restarts", "--local-addr", "-r", "-t"}
FLAGS = {"--standalone", "--run-path", "--no-python"}
BACKENDS = ("c10d", "static")
LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", "0.0.0.0", ""}
_STOP = {"-m", "--module"}


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
    """convoy's own options that take a value (so their value is not taken for the script)."""
    return name in {"--run-dir", "--host", "--port", "--rdzv-wait", "--join-timeout", "--heartbeat-timeout",
                    "--max-regroups", "--regroup-window", "--ps", "--workers", "--stop-grace", "--preload", "--set",
                    "--auto-apply", "--job-id", "--role-name", "--endpoint", "--token-file", "--join-token",
                    "--log-level"}


def translate(argv: list[str], gpus: int = 0) -> list[str]:
    """``convoy run``'s argv with torchrun's flags turned into convoy's; ``gpus``: the GPUs this host has."""
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
    out: list[str] = []
    given = {name: value for name, value in pairs}
    nnodes = given.get("--nnodes") or "1"
    for name, value in pairs:
        out += _one(name, value, nnodes, given, gpus)
    return out + rest


def _several_hosts(nnodes: str, given: dict[str, str | None]) -> bool:
    """A job of several nodes (or with its rendezvous on another host): one launcher per host, convoy's --endpoint."""
    endpoint = given.get("--rdzv-endpoint") or given.get("--master-addr") or ""
    host = endpoint.rpartition(":")[0] if "--rdzv-endpoint" in given and ":" in endpoint else endpoint
    return ("--rdzv-endpoint" in given or "--master-addr" in given) and (
        nnodes not in ("1", "1:1") or not _local(host.strip("[]")))


def _endpoint(name: str, value: str, given: dict[str, str | None]) -> list[str]:
    """``--endpoint HOST:PORT`` from torchrun's ``--rdzv-endpoint HOST[:PORT]`` (port 29400 by default, as
    torchrun's) or ``--master-addr HOST`` with ``--master-port`` (29500 by default)."""
    if name == "--rdzv-endpoint":
        if value.endswith("]") or ":" not in value:
            host, port = value, "29400"
        else:
            host, _, port = value.rpartition(":")
    else:
        if "--rdzv-endpoint" in given:
            return []  # the endpoint names the rendezvous; MASTER_ADDR is then the first node's, as in torchrun
        host, port = value, given.get("--master-port") or "29500"
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{name} {value}: the port is not a number 1..65535")
    if not host:
        raise ConfigError(f"{name} {value}: give the host of the rendezvous")
    return ["--endpoint", f"{host}:{port}"]


def _one(name: str, value: str | None, nnodes: str, given: dict[str, str | None], gpus: int) -> list[str]:
    if name == "--standalone":
        if nnodes not in ("1", "1:1"):
            raise ConfigError(f"--standalone runs one node, but --nnodes is {nnodes}: drop one of them")
        return []
    if name == "--nproc-per-node":
        return ["--nproc-per-node", str(nproc_per_node(value or "", gpus))]
    if name == "--rdzv-backend":
        if value not in BACKENDS:
            raise ConfigError(f"--rdzv-backend {value}: convoy's master is the rendezvous; give c10d or static (or "
                              "leave it out)")
        return []
    if name in ("--rdzv-endpoint", "--master-addr") and _several_hosts(nnodes, given):
        return _endpoint(name, value or "", given)
    if name in ("--rdzv-endpoint", "--master-addr"):
        host, port = value or "", ""
        if name == "--rdzv-endpoint" and ":" in host:
            host, _, port = host.rpartition(":")
        if not _local(host.strip("[]")) or nnodes not in ("1", "1:1"):
            raise ConfigError(f"{name} {value}: a rendezvous on another host (or of several nodes) is not taken by "
                              "convoy run yet; start `convoy master --host 0.0.0.0 --port PORT` on one host and "
                              "`convoy agent --master HOST:PORT` on each")
        if name == "--rdzv-endpoint" and port:
            if not port.isdigit():
                raise ConfigError(f"--rdzv-endpoint {value}: the port is not a number")
            return ["--port", port] if "--master-port" not in given else []
        return []
    if name == "--master-port":
        if not (value or "").isdigit() or not 0 < int(value or 0) < 65536:
            raise ConfigError(f"--master-port {value}: give a port 1..65535")
        if _several_hosts(nnodes, given) and "--rdzv-endpoint" not in given:
            return []  # with --master-addr on several hosts it is the rendezvous's port: convoy's master serves it
        return ["--master-port", value or ""]
    if name == "--node-rank":
        if not (value or "").isdigit():
            raise ConfigError(f"--node-rank {value}: give a number 0..NNODES-1")
        if _several_hosts(nnodes, given):
            return ["--node-rank", value or ""]
        if value != "0" or nnodes not in ("1", "1:1"):
            raise ConfigError(f"--node-rank {value}: convoy run starts the nodes of one host itself; on several "
                              "hosts run `convoy agent` on each (the master gives the ranks)")
        return []
    if name == "--rdzv-id":
        return ["--job-id", value or ""]
    if name == "--rdzv-conf":
        return _rdzv_conf(value or "")
    if name == "--monitor-interval":
        try:
            seconds = float(value or "")
        except ValueError:
            raise ConfigError(f"--monitor-interval {value}: give seconds, a number above 0") from None
        if not seconds > 0:
            raise ConfigError(f"--monitor-interval {value}: give seconds, a number above 0")
        return []  # convoy's agent watches its workers every 20 ms, more often than any interval asks
    if name == "--run-path":
        return []  # convoy runs the script with runpy.run_path, as torchrun's --run-path does
    if name == "--role":
        return ["--role", value or ""] if "=" in (value or "") else ["--role-name", value or ""]
    if name in ("--redirects", "-r", "--tee", "-t"):
        return _streams("--redirects" if name in ("--redirects", "-r") else "--tee", value or "")
    if name == "--local-addr":
        return []  # the address of this host among the nodes: one host here
    return [name] if value is None else [name, value]


def nproc_per_node(value: str, gpus: int) -> int:
    """torchrun's ``--nproc-per-node``: a number, ``cpu``, ``gpu`` or ``auto`` (GPUs if any, else CPUs)."""
    if value.isdigit():
        return int(value)
    if value == "cpu" or (value == "auto" and gpus == 0):
        return os.cpu_count() or 1
    if value in ("gpu", "auto"):
        if gpus == 0:
            raise ConfigError("--nproc-per-node gpu: this host has no GPU; give a number, cpu or auto")
        return gpus
    raise ConfigError(f"--nproc-per-node {value!r}: give a number, cpu, gpu or auto")


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
