"""A parameter-server process's request loop: the ops a worker sends (set up a shard, restore one from a file,
pull, push, snapshot, save, status, tags, shut down), mapped onto one ``ParameterServer``. Pure dispatch; the
bytes are transport.py's, the snapshots snapshots.py's. ``from_role_env`` is a PS of a convoy job of roles."""

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
from convoy.parallel.ps.transport import Listener, Message

PULL_WAIT_S = 120.0


class ServerProcess:
    """Serves one shard on ``host:port`` (0: any free port) until a worker sends ``shutdown``. With ``snapshots``
    it snapshots its shard at setup and when asked; with ``restore`` it first takes the shard back from them
    (raises ``NoShardToRestore`` when there is none), and only then listens."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, snapshots: ShardSnapshots | None = None,
                 restore: bool = False, say: Callable[[str], None] = print) -> None:
        self.server: ParameterServer | None = None
        self.snapshots = snapshots
        self.restored: Restored | None = None
        if restore:
            if snapshots is None:
                raise ConfigError("a parameter server told to restore its shard needs its snapshots (ShardSnapshots)")
            self.restored = snapshots.restore(say)
            self.server = self.restored.server
        self.stopped = threading.Event()
        self.listener = Listener(self.handle, host, port, replied=self._replied)
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

    def handle(self, message: Message) -> Message:
        op, meta, tensors = message.op, message.meta, message.tensors
        if op == "setup":
            placement = Placement.from_dict(meta["placement"])
            dense = {name[len("dense/"):]: t for name, t in tensors.items() if name.startswith("dense/")}
            rows = {name[len("rows/"):]: t for name, t in tensors.items() if name.startswith("rows/")}
            self.server = ParameterServer(int(meta["index"]), placement, OptimizerSpec.from_dict(meta["optimizer"]),
                                          dense, rows)
            if self.snapshots is not None:
                self.snapshots.take(self.server)  # a kill from here on finds a shard to come back with
            return Message("ok", {"pid": os.getpid()})
        if op == "restore":
            self.server = restore_shard(Path(meta["path"]))
            if self.snapshots is not None:
                self.snapshots.take(self.server)
            return Message("ok", {"pid": os.getpid(), "version": self.server.version})
        if op == "pull":
            server = self._shard()
            applied = server.wait_applied(str(meta["worker"]), int(meta["at_least"]), PULL_WAIT_S)
            ids = {name[len("ids/"):]: t for name, t in tensors.items() if name.startswith("ids/")}
            dense, rows = server.pull(ids)
            out: dict[str, torch.Tensor] = {f"dense/{name}": t for name, t in dense.items()}
            out.update({f"rows/{name}": t for name, t in rows.items()})
            return Message("pulled", {"version": server.version, "applied": applied}, out)
        if op == "push":
            server = self._shard()
            dense = {name[len("dense/"):]: t for name, t in tensors.items() if name.startswith("dense/")}
            rows = {name[len("ids/"):]: (t, tensors[f"grads/{name[len('ids/'):]}"])
                    for name, t in tensors.items() if name.startswith("ids/")}
            tag = meta.get("tag")
            version = server.push(str(meta["worker"]), dense, rows, None if tag is None else int(tag))
            return Message("pushed", {"version": version, "kept": self._kept(str(meta["worker"]))})
        if op == "snapshot":
            server = self._shard()
            if self.snapshots is None:
                raise ConfigError("this parameter server keeps no snapshots; start it with ShardSnapshots")
            version = self.snapshots.take(server)
            if meta.get("persist"):
                self.snapshots.save(server)
            return Message("ok", {"version": version, "kept": self._kept(str(meta.get("worker", "")))})
        if op == "save":
            if "path" in meta:
                save_shard(self._shard(), Path(meta["path"]))
            elif self.snapshots is not None:
                self.snapshots.save(self._shard())
            else:
                raise ConfigError("this parameter server has no save directory: send 'save' with a path")
            return Message("ok", {"pid": os.getpid(), "version": self._shard().version})
        if op == "status":
            server = self.server
            worker = str(meta["worker"])
            applied = server.applied.get(worker, 0) if server else 0
            return Message("ok", {"pid": os.getpid(), "version": server.version if server else 0, "applied": applied,
                                  "ready": server is not None, "kept": self._kept(worker)})
        if op == "tags":
            server = self._shard()
            with server.changed:
                tags = torch.tensor(sorted(server.tags), dtype=torch.int64)
                return Message("ok", {"duplicates": server.duplicates, "version": server.version}, {"tags": tags})
        if op == "shutdown":
            return Message("bye", {"pid": os.getpid()})  # stopped once this reply is out (_replied)
        raise ConfigError(f"parameter server: unknown op {op!r}; send setup, restore, pull, push, snapshot, save, "
                          f"status, tags or shutdown")

    def _kept(self, worker: str) -> int:
        """The worker's pushes a kill of this server cannot take away (without snapshots: every applied one,
        since nothing could be resent to a fresh server anyway)."""
        if self.snapshots is None:
            return self.server.applied.get(worker, 0) if self.server else 0
        return self.snapshots.kept.get(worker, 0)


def from_role_env(env: Mapping[str, str] | None = None, say: Callable[[str], None] = print) -> ServerProcess:
    """The PS of a convoy job of roles: serves on CONVOY_ROLE_PORT, snapshots under its rank, and, started again
    by the restore-one policy (CONVOY_ROLE_RESTORE=1), first takes its shard back."""
    env = os.environ if env is None else env
    missing = [name for name in ("CONVOY_ROLE_PORT", "CONVOY_JOB_ID", "CONVOY_RUN_DIR") if name not in env]
    if missing:
        raise ConfigError(f"{', '.join(missing)} not set: a parameter server of a job of roles is started by convoy "
                          "(convoy run --ps N ...)")
    rank = int(env.get("ROLE_RANK", "0"))
    snapshots = ShardSnapshots.for_rank(env["CONVOY_JOB_ID"], rank, Path(env["CONVOY_RUN_DIR"]))
    return ServerProcess("", int(env["CONVOY_ROLE_PORT"]), snapshots, env.get("CONVOY_ROLE_RESTORE") == "1", say)
