"""A parameter-server process's request loop: the ops a worker sends (set up a shard, restore one from a file,
pull, push, snapshot, save, status, tags, shut down), mapped onto one ``ParameterServer`` by a table of handlers.
The bytes, the handshake and the fence against stale workers are the role services' transport
(convoy/parallel/transport/), the snapshots snapshots.py's. ``from_role_env`` is a PS of a convoy job of roles."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from convoy.errors import ConfigError
from convoy.parallel.ps.optimizers import OptimizerSpec
from convoy.parallel.ps.placement import Placement
from convoy.parallel.ps.server import ParameterServer, restore_shard, save_shard
from convoy.parallel.ps.snapshots import Restored, ShardSnapshots
from convoy.parallel.transport import Credentials, Identity, IncarnationFence, Limits, Listener, Message, confined
from convoy.parallel.transport.handshake import Admit
from convoy.worker.role_env import SERVICE_HOST_ENV, role

PULL_WAIT_S = 120.0
SHARD_SUFFIX = ".pt"
"""The only files a caller may have a server save to or restore from (in the run dir)."""


class ServerProcess:
    """Serves one shard on ``host:port`` (0: any free port) until a worker sends ``shutdown``. With ``snapshots``
    it snapshots its shard at setup and when asked; with ``restore`` it first takes the shard back from them
    (raises ``NoShardToRestore`` when there is none), and only then listens. ``credentials`` (default: the
    process's, from its agent) are what its callers must prove they share; ``admit`` refuses stale callers;
    ``run_dir`` (default: CONVOY_RUN_DIR) is where the ops ``save`` and ``restore`` may name files."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, snapshots: ShardSnapshots | None = None,
                 restore: bool = False, say: Callable[[str], None] = print, *,
                 credentials: Credentials | None = None, admit: Admit | None = None, run_dir: Path | None = None,
                 limits: Limits | None = None) -> None:
        self.server: ParameterServer | None = None
        self.snapshots = snapshots
        self.restored: Restored | None = None
        given = run_dir or os.environ.get("CONVOY_RUN_DIR")
        self.run_dir = Path(given) if given else None
        if restore:
            if snapshots is None:
                raise ConfigError("a parameter server told to restore its shard needs its snapshots (ShardSnapshots)")
            self.restored = snapshots.restore(say)
            if self.restored is None:
                say("this parameter server was never set up (restarted before its chief's setup reached it): it "
                    "starts empty, and the chief sets it up")
            self.server = self.restored.server if self.restored is not None else None
        self.stopped = threading.Event()
        self.ops: dict[str, Callable[[Message], Message]] = {
            "setup": self._setup, "restore": self._restore, "pull": self._pull, "push": self._push,
            "snapshot": self._snapshot, "save": self._save, "status": self._status, "tags": self._tags,
            "shutdown": self._shutdown}
        self.listener = Listener(self.handle, host, port, replied=self._replied, credentials=credentials,
                                 admit=admit, limits=limits)
        self.address = self.listener.address

    def wait(self, timeout: float | None = None) -> bool:
        """Block until shut down (the ``shutdown`` reply sent); then close the listener and wait for its threads.
        False if ``timeout`` passed first."""
        done = self.stopped.wait(timeout)
        if done:
            self.listener.close()
        return done

    def _replied(self, reply: Message) -> None:
        if reply.op == "bye":
            self.stopped.set()

    def _shard(self) -> ParameterServer:
        if self.server is None:
            raise ConfigError("this parameter server holds no shard yet; send 'setup' or 'restore' first")
        return self.server

    def handle(self, message: Message, caller: Identity | None = None) -> Message:
        """The reply to one op (``caller``: who sent it, as the transport proved)."""
        op = self.ops.get(message.op)
        if op is None:
            raise ConfigError(f"parameter server: unknown op {message.op[:40]!r}; send one of {', '.join(self.ops)}")
        return op(message)

    def _setup(self, message: Message) -> Message:
        meta, tensors = message.meta, message.tensors
        placement = Placement.from_dict(meta["placement"])
        dense = {name[len("dense/"):]: t for name, t in tensors.items() if name.startswith("dense/")}
        rows = {name[len("rows/"):]: t for name, t in tensors.items() if name.startswith("rows/")}
        self.server = ParameterServer(int(meta["index"]), placement, OptimizerSpec.from_dict(meta["optimizer"]),
                                      dense, rows)
        if self.snapshots is not None:
            self.snapshots.take(self.server)  # a kill from here on finds a shard to come back with
        return Message("ok", {"pid": os.getpid()})

    def _restore(self, message: Message) -> Message:
        self.server = restore_shard(confined(self.run_dir, str(message.meta["path"]), SHARD_SUFFIX))
        if self.snapshots is not None:
            self.snapshots.take(self.server)
        return Message("ok", {"pid": os.getpid(), "version": self.server.version})

    def _pull(self, message: Message) -> Message:
        server, meta = self._shard(), message.meta
        applied = server.wait_applied(str(meta["worker"]), int(meta["at_least"]), PULL_WAIT_S)
        ids = {name[len("ids/"):]: t for name, t in message.tensors.items() if name.startswith("ids/")}
        dense, rows = server.pull(ids)
        out: dict[str, torch.Tensor] = {f"dense/{name}": t for name, t in dense.items()}
        out.update({f"rows/{name}": t for name, t in rows.items()})
        return Message("pulled", {"version": server.version, "applied": applied}, out)

    def _push(self, message: Message) -> Message:
        server, meta, tensors = self._shard(), message.meta, message.tensors
        dense = {name[len("dense/"):]: t for name, t in tensors.items() if name.startswith("dense/")}
        rows = {name[len("ids/"):]: (t, tensors[f"grads/{name[len('ids/'):]}"])
                for name, t in tensors.items() if name.startswith("ids/")}
        tag = meta.get("tag")
        version = server.push(str(meta["worker"]), dense, rows, None if tag is None else int(tag))
        return Message("pushed", {"version": version, "kept": self._kept(str(meta["worker"]))})

    def _snapshot(self, message: Message) -> Message:
        server = self._shard()
        if self.snapshots is None:
            raise ConfigError("this parameter server keeps no snapshots; start it with ShardSnapshots")
        version = self.snapshots.take(server)
        if message.meta.get("persist"):
            self.snapshots.save(server)
        return Message("ok", {"version": version, "kept": self._kept(str(message.meta.get("worker", "")))})

    def _save(self, message: Message) -> Message:
        if "path" in message.meta:
            path = confined(self.run_dir, str(message.meta["path"]), SHARD_SUFFIX)  # refused before any work
            save_shard(self._shard(), path)
        elif self.snapshots is not None:
            self.snapshots.save(self._shard())
        else:
            raise ConfigError("this parameter server has no save directory: send 'save' with a path")
        return Message("ok", {"pid": os.getpid(), "version": self._shard().version})

    def _status(self, message: Message) -> Message:
        server, worker = self.server, str(message.meta["worker"])
        applied = server.applied.get(worker, 0) if server else 0
        return Message("ok", {"pid": os.getpid(), "version": server.version if server else 0, "applied": applied,
                              "ready": server is not None, "kept": self._kept(worker)})

    def _tags(self, message: Message) -> Message:
        server = self._shard()
        with server.changed:
            tags = torch.tensor(sorted(server.tags), dtype=torch.int64)
            return Message("ok", {"duplicates": server.duplicates, "version": server.version}, {"tags": tags})

    def _shutdown(self, message: Message) -> Message:
        return Message("bye", {"pid": os.getpid()})  # stopped once this reply is out (_replied)

    def _kept(self, worker: str) -> int:
        """The worker's pushes a kill of this server cannot take away (without snapshots: every applied one,
        since nothing could be resent to a fresh server anyway)."""
        if self.snapshots is None:
            return self.server.applied.get(worker, 0) if self.server else 0
        return self.snapshots.kept.get(worker, 0)


def from_role_env(env: Mapping[str, str] | None = None, say: Callable[[str], None] = print,
                  all_interfaces: bool = False) -> ServerProcess:
    """The PS of a convoy job of roles: serves on the node's own address (every interface only with
    ``all_interfaces``) at CONVOY_ROLE_PORT, to the job's processes alone (CONVOY_ROLE_SECRET), refusing a worker of
    an ended incarnation; snapshots under its rank, and, started again by the restore-one policy
    (CONVOY_ROLE_RESTORE=1), first takes its shard back."""
    env = os.environ if env is None else env
    missing = [name for name in ("CONVOY_ROLE_PORT", "CONVOY_JOB_ID", "CONVOY_RUN_DIR", SERVICE_HOST_ENV)
               if name not in env]
    if missing:
        raise ConfigError(f"{', '.join(missing)} not set: a parameter server of a job of roles is started by convoy "
                          "(convoy run --ps N ...)")
    credentials = Credentials.from_env(env)
    rank = int(env.get("ROLE_RANK", "0"))
    run_dir = Path(env["CONVOY_RUN_DIR"])
    snapshots = ShardSnapshots.for_rank(env["CONVOY_JOB_ID"], rank, run_dir)
    host = "" if all_interfaces else env[SERVICE_HOST_ENV]
    return ServerProcess(host, int(env["CONVOY_ROLE_PORT"]), snapshots, env.get("CONVOY_ROLE_RESTORE") == "1", say,
                         credentials=credentials, admit=IncarnationFence(role(env)).check, run_dir=run_dir)
