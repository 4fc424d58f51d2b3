"""``convoy.train_config()``: a training config the job can change while it runs, torch-free.

    @dataclass
    class Config:
        lr: float = convoy.hot(0.1, min=0.0, doc="learning rate")
        batch_size: int = convoy.restart(32, min=1)

    cfg = convoy.train_config(Config)       # the job's values (--set, [train], convoy config set)
    for step in range(start, steps):
        ...                                 # read cfg.lr, cfg.batch_size
        convoy.report(step, loss=loss)      # a hot change lands in cfg here, at the same step on every rank

The master keeps the versions; each node's agent writes them to a file of the run dir and then bumps a counter
beside it, which ``report`` reads after every step from a shared mapping (no system call: the file is read only
when the counter moved). A hot version is set on ``cfg`` at the boundary before its first step; a
restart version parks the rank after the step before it until the agent restarts the round, whose processes
resume from their Checkpointer with the new values. Outside convoy the script gets its defaults.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import re
import sys
import typing
from pathlib import Path
from typing import Any, Callable, TypeVar

from convoy.control.protocol import training as tp
from convoy.errors import ConfigError, ConvoyError
from convoy.worker import agent_link

T = TypeVar("T")
META_KEY = "convoy"
TYPE_NAMES = {int: "int", float: "float", bool: "bool", str: "str"}
CONFIG_DIR = "train"


def hot(default: Any, *, min: float | None = None, max: float | None = None,  # noqa: A002 (the natural names)
        choices: tuple[Any, ...] = (), doc: str = "") -> Any:
    """A field applied in place at a step boundary (learning rate, weight decay, clipping, log interval)."""
    return dataclasses.field(default=default, metadata={META_KEY: {"kind": "hot", "minimum": min, "maximum": max,
                                                                   "choices": list(choices), "doc": doc}})


def restart(default: Any, *, min: float | None = None, max: float | None = None,  # noqa: A002
            choices: tuple[Any, ...] = (), doc: str = "") -> Any:
    """A field applied by a coordinated restart from the snapshot of the step before (batch size, micro-batches,
    data loader workers, parallel degrees). A field not marked at all is one of these."""
    return dataclasses.field(default=default, metadata={META_KEY: {"kind": "restart", "minimum": min, "maximum": max,
                                                                   "choices": list(choices), "doc": doc}})


def declared_fields(cls: type) -> list[tp.FieldDecl]:
    """The schema of a config dataclass; a ConfigError names a field convoy cannot carry."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise ConfigError(f"convoy.train_config takes a dataclass (got {cls!r})")
    hints = typing.get_type_hints(cls)
    out = []
    for spec in dataclasses.fields(cls):
        kind = TYPE_NAMES.get(hints.get(spec.name))  # type: ignore[arg-type]
        if kind is None:
            raise ConfigError(f"config field {spec.name!r} of {cls.__name__} is {hints.get(spec.name)!r}: a live field "
                              "is an int, float, bool or str")
        if spec.default is dataclasses.MISSING:
            raise ConfigError(f"config field {spec.name!r} of {cls.__name__} needs a default")
        meta = dict(spec.metadata.get(META_KEY) or {"kind": "restart"})
        out.append(tp.FieldDecl(name=spec.name, type=kind, default=spec.default, **meta))  # type: ignore[arg-type]
    return out


def config_file(run_dir: Path | str, node_id: str) -> Path:
    """Where one node's agent keeps the training config's versions."""
    return Path(run_dir) / CONFIG_DIR / f"config-{re.sub(r'[^A-Za-z0-9_.-]', '_', node_id)}.json"


def write_config(path: Path, state: tp.ConfigState) -> None:
    """Replace the file at once (a reader sees the old whole file or the new one), then bump its counter."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(state.model_dump_json())
    os.replace(partial, path)
    fd = os.open(generation_file(path), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        now = int.from_bytes(os.pread(fd, GENERATION_BYTES, 0).ljust(GENERATION_BYTES, b"\0"), "little")
        os.pwrite(fd, ((now + 1) % 2**64).to_bytes(GENERATION_BYTES, "little"), 0)
    finally:
        os.close(fd)


GENERATION_BYTES = 8


def generation_file(path: Path) -> Path:
    """The counter the agent bumps after each write of the config file ``path``."""
    return path.with_name(f"{path.name}.gen")


class Generation:
    """A rank's read-only mapping of a config file's counter: one memory read tells whether the file changed."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < GENERATION_BYTES:  # the agent has not written yet; its pwrite keeps the size
                os.ftruncate(fd, GENERATION_BYTES)
            self._map = mmap.mmap(fd, GENERATION_BYTES, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)

    def read(self) -> bytes:
        return self._map[:GENERATION_BYTES]


def effective(versions: list[tp.VersionInfo], step: int, role: str = "") -> tp.VersionInfo | None:
    """The version ``step`` of a process of ``role`` runs with: the newest whose first step (the role's own, where
    roles count steps of their own) is at or before it."""
    live = [v for v in versions if v.step_for(role) <= step]
    return max(live, key=lambda v: v.number) if live else None


class LiveConfig:
    """The script's config object and the versions behind it; ``boundary`` runs after every step."""

    def __init__(self, instance: Any, state: tp.ConfigState, path: Path | None,
                 on_change: Callable[[Any, dict[str, Any]], None] | None, kinds: dict[str, str],
                 role: str = "default") -> None:
        """``role``: this process's role, whose own step a version names (a plain worker's is ``default``)."""
        self.instance, self.path, self.on_change, self.kinds, self.role = instance, path, on_change, kinds, role
        self.versions = list(state.versions)
        self.applied: tp.VersionInfo | None = None
        self.switched: dict[str, int] = {}
        """Version number -> the first step this rank ran with it, not yet told to the master."""
        self._first: str | None = None
        """The version set at the start: its first step is the first one this rank finishes."""
        self._seen: tuple[int, int] | None = None
        self._generation: Generation | None = None
        self._generation_seen = b""
        if path is not None:
            try:
                self._generation = Generation(generation_file(path))
            except (OSError, ValueError) as exc:  # a read-only run dir: look at the file itself after each step
                print(f"convoy: cannot map the training config's counter beside {path} ({exc}); checking the file "
                      "after every step", file=sys.stderr, flush=True)

    def seek(self, step: int) -> None:
        """Set the values of the version ``step`` runs with (at the start, or after a restore)."""
        version = effective(self.versions, step, self.role)
        if version is not None:
            self._set(version, None)

    def boundary(self, finished: int) -> tp.VersionInfo | None:
        """After step ``finished``: take a newer file, set a hot version due at the next step; returns a restart
        version due then (the rank parks), else None."""
        if self._first is not None:
            self.switched[self._first], self._first = finished, None
        self._refresh()
        version = effective(self.versions, finished + 1, self.role)
        if version is None or (self.applied is not None and version.number == self.applied.number):
            return None
        if self.applied is not None and self._needs_restart(self.applied, version):
            return version
        self._set(version, finished + 1)
        return None

    def _needs_restart(self, old: tp.VersionInfo, new: tp.VersionInfo) -> bool:
        return any(self.kinds.get(name) == "restart" and old.values.get(name) != value
                   for name, value in new.values.items())

    def _set(self, version: tp.VersionInfo, step: int | None) -> None:
        changed = {name: value for name, value in version.values.items()
                   if getattr(self.instance, name, None) != value}
        for name, value in changed.items():
            setattr(self.instance, name, value)
        self.applied = version
        if step is None:
            self._first = str(version.number)
        else:
            self.switched[str(version.number)] = step
        if changed and self.on_change is not None:
            self.on_change(self.instance, changed)

    def _refresh(self) -> None:
        if self.path is None:
            return
        generation = self._generation.read() if self._generation is not None else b""
        if generation and generation == self._generation_seen:
            return
        try:
            stat = self.path.stat()
        except FileNotFoundError:  # none written yet as of this count (the agent writes the file, then counts)
            self._generation_seen = generation
            return
        seen = (stat.st_mtime_ns, stat.st_size)
        if seen == self._seen:
            self._generation_seen = generation
            return
        try:
            state = tp.ConfigState.model_validate_json(self.path.read_bytes())
        except (OSError, ValueError) as exc:
            print(f"convoy: cannot read the training config {self.path}: {exc}; keeping the one in use",
                  file=sys.stderr, flush=True)
            return
        self._seen, self._generation_seen = seen, generation
        self.versions = list(state.versions)

    def take_switched(self) -> dict[str, int]:
        taken, self.switched = self.switched, {}
        return taken


_live: LiveConfig | None = None


def current() -> LiveConfig | None:
    return _live


def train_config(cls: type[T], *, restartable: bool = True, step: int | None = None,
                 on_change: Callable[[T, dict[str, Any]], None] | None = None) -> T:
    """An instance of the dataclass ``cls`` with the job's values; changes of the job's config land on it.

    ``restartable``: the script resumes from a Checkpointer, so restart fields may change (False: only hot
    fields can). ``step``: the step the script starts at (after ``Checkpointer.restore()``), to take the values
    of that step; default: the newest. ``on_change(cfg, changed)`` runs after a hot change is set on ``cfg``.
    """
    global _live
    fields = declared_fields(cls)
    instance = cls()
    link = agent_link.link()
    if link is None:  # outside convoy: the defaults
        return instance
    declare = tp.ConfigDeclare(**link.task, fields=fields, restartable=restartable)
    try:
        answer = link.backend.call("/train/declare", declare, tp.ConfigState)
    except ConvoyError as exc:
        raise ConfigError(f"cannot declare the training config to convoy: {exc}") from exc
    if isinstance(answer, str):
        raise ConfigError(f"the training config was refused: {answer}")
    kinds = {decl.name: decl.kind for decl in fields}
    live = LiveConfig(instance, answer, config_file(link.run_dir, link.node_id), on_change, kinds,  # type: ignore
                      link.task["role"])
    if step is None:
        newest = max(answer.versions, key=lambda v: v.number) if answer.versions else None
        if newest is not None:
            live._set(newest, None)
    else:
        live.seek(step)
    _live = live
    return instance
