"""A parameter-server process's request loop: the ops a worker sends (set up a shard, restore one from a file,
pull, push, save, shut down), mapped onto one ``ParameterServer``. Pure dispatch; the bytes are transport.py's."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch

from convoy.errors import ConfigError
from convoy.parallel.ps.optimizers import OptimizerSpec
from convoy.parallel.ps.placement import Placement
from convoy.parallel.ps.server import ParameterServer, restore_shard, save_shard
from convoy.parallel.ps.transport import Listener, Message

PULL_WAIT_S = 120.0


class ServerProcess:
    """Serves one shard on ``host:port`` (0: any free port) until a worker sends ``shutdown``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.server: ParameterServer | None = None
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
            return Message("ok", {"pid": os.getpid()})
        if op == "restore":
            self.server = restore_shard(Path(meta["path"]))
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
            version = server.push(str(meta["worker"]), dense, rows)
            return Message("pushed", {"version": version})
        if op == "save":
            save_shard(self._shard(), Path(meta["path"]))
            return Message("ok", {"pid": os.getpid(), "version": self._shard().version})
        if op == "status":
            server = self.server
            applied = server.applied.get(str(meta["worker"]), 0) if server else 0
            return Message("ok", {"pid": os.getpid(), "version": server.version if server else 0, "applied": applied})
        if op == "shutdown":
            return Message("bye", {"pid": os.getpid()})  # stopped once this reply is out (_replied)
        raise ConfigError(f"parameter server: unknown op {op!r}; send setup, restore, pull, push, save, status or "
                          f"shutdown")
