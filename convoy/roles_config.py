"""Role specs: what each role of a job runs, how many of it, its resources and its failure policy, as the job file
and the command line declare them (pure; the master's membership and scaling per role are
control/roles/members.py's)."""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, field, replace
from typing import Callable, TypeVar

from convoy.errors import ConfigError

Value = TypeVar("Value")
AUTO = "auto"
"""A count or memory the master decides (issue 24 item 4: sized from one measured iteration)."""
DEFAULT_ROLE = "default"
"""torchrun's ROLE_NAME of a job that declares no roles: every worker process is one of it, as before roles."""
RESTART_JOB, RESTART_ONE, RESTORE_ONE = "restart-job", "restart-one", "restore-one"
RESTART_ROLE, REPLACE = "restart-role", "replace"
FAILURE_POLICIES = {
    RESTART_JOB: "a new round for the whole job (every process restarts from its latest checkpoint)",
    RESTART_ONE: "restart only the failed process; its unfinished data goes back to the queue",
    RESTORE_ONE: "restart only the failed process and give it back its state (a PS its shard)",
    RESTART_ROLE: "restart every process of the role together, as one group; the other roles keep running",
    REPLACE: "start another process in its place on any node with room, spending no restart, within the role's "
             "max_replacements per replacement_window_s",
}
"""What the master does when a process of the role fails."""
DEFAULT_FAILURE_POLICY = {"worker": RESTART_ONE, "ps": RESTORE_ONE, "chief": RESTART_JOB}
"""The policy of each well-known role; a role group restarts as a group; any other role restarts the job, as a job
without roles does."""
ALONE_POLICIES = (RESTART_ONE, RESTORE_ONE, REPLACE)
"""Policies that start one process again while its role's others run on: not for a role group, whose members share
one torch.distributed world that breaks with any of them."""
DEFAULT_SERVICES = ("ps",)
"""Roles that are services unless their table says ``service = false``."""
ROLE_KEYS = ("entrypoint", "args", "module", "count", "memory", "cpus", "gpus", "failure_policy", "service", "after",
             "group", "max_replacements", "replacement_window_s")
"""The keys a ``[roles.NAME]`` table may hold."""
ROLE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,31}")
MEMORY_UNITS = {"": None, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
                "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
"""Decimal (``MB``) and binary (``MiB``) units, any case, the ``B`` optional; a bare number has no unit (refused)."""
MEMORY = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B?|B)?\s*", re.IGNORECASE)
ROLE_FLAGS = {"ps": "ps", "workers": "worker"}
FIXED_COUNT = {"ps": "the parameter servers' layout (which PS holds which tensors) is fixed when the workers set it "
                     "up"}
"""Roles whose count cannot change while the job runs, with why: one count, no MIN:MAX, no ``convoy scale``."""
"""The command-line shorthands for a role's count (``--ps 2``, ``--workers auto``) and the role each names."""


@dataclass(frozen=True)
class RoleCount:
    """How many processes of a role: exactly ``minimum`` (== ``maximum``), elastic between the two, or auto."""

    minimum: int = 1
    """Fewest processes the role runs with."""
    maximum: int | None = 1
    """Most processes the role may scale to; None only with ``auto``."""
    auto: bool = False
    """The master decides how many fit (from the memory one measured iteration needs)."""

    def __str__(self) -> str:
        if self.auto:
            return AUTO
        return str(self.minimum) if self.minimum == self.maximum else f"{self.minimum}:{self.maximum}"

    def validate(self) -> None:
        if self.auto:
            return
        if self.minimum < 1:
            raise ConfigError(f"count {self}: need at least 1 process (leave a role out rather than give it 0)")
        if self.maximum is None or self.maximum < self.minimum:
            raise ConfigError(f"count {self}: MIN {self.minimum} > MAX {self.maximum}: need 1 <= MIN <= MAX")


@dataclass(frozen=True)
class RoleSpec:
    """One role of a job; a role without an entrypoint runs the job's script, which can ask ``convoy.role()``."""

    name: str
    """The role's name: torchrun's ROLE_NAME for its processes, and what ``convoy scale`` names."""
    entrypoint: str = ""
    """The role's script (or module with ``module``); empty: the job's script."""
    args: tuple[str, ...] = ()
    """Arguments of the role's own script; without an entrypoint, they follow the job's script arguments."""
    module: bool = False
    """Run ``entrypoint`` as ``python -m entrypoint``."""
    count: RoleCount = field(default_factory=RoleCount)
    """How many processes the role runs."""
    memory_bytes: int | None = None
    """Memory limit of each process in bytes; None: no limit (or the master sizes it, with ``memory_auto``)."""
    memory_auto: bool = False
    """The master sizes each process's memory from one measured iteration."""
    cpus: float | None = None
    """CPUs each process may use; None: no limit. Also its threads: ``OMP_NUM_THREADS`` is the whole part (at
    least 1); a role that declares none gets 1 thread, as torchrun gives each of several workers a node."""
    failure_policy: str = ""
    """One of FAILURE_POLICIES; empty: the role's default (DEFAULT_FAILURE_POLICY, else restart the job)."""
    gpus: int = 0
    """GPUs each process takes from its node: the agent hands out whole devices, visible to the process as
    ``CUDA_VISIBLE_DEVICES`` (so it sees them as ``cuda:0`` ...); 0: none."""
    service: bool | None = None
    """A service runs until every non-service role has finished, then is stopped; its failures never decide the
    job's outcome by finishing. None: the role's default (DEFAULT_SERVICES)."""
    after: tuple[str, ...] | None = None
    """Roles whose processes must all have published their addresses before this role's start (``()``: at once).
    None: a non-service role starts after every service role, a service at once."""
    group: bool = False
    """The role's processes share a torch.distributed world of their own (RANK, WORLD_SIZE, MASTER_ADDR/PORT of the
    role), formed by a rendezvous of the role alone and formed again, from the members' snapshots, in a new round of
    the role whenever a member fails or its count changes."""
    max_replacements: int = 10
    """``replace``: more replacements than this within ``replacement_window_s`` is a failure loop: the job fails."""
    replacement_window_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.failure_policy:
            default = RESTART_ROLE if self.group else DEFAULT_FAILURE_POLICY.get(self.name, RESTART_JOB)
            object.__setattr__(self, "failure_policy", default)
        if self.service is None:
            object.__setattr__(self, "service", self.name in DEFAULT_SERVICES)
        if self.after is not None and not isinstance(self.after, tuple):
            object.__setattr__(self, "after", tuple(self.after))

    @property
    def memory(self) -> str:
        """The memory as the job file writes it (``auto``, bytes, or empty for none)."""
        return AUTO if self.memory_auto else "" if self.memory_bytes is None else f"{self.memory_bytes}B"

    def validate(self) -> None:
        """Check the values (a RoleSpec built in Python gets the same checks as one parsed from a file)."""
        try:
            if not ROLE_NAME.fullmatch(self.name):
                raise ConfigError("a role name is a letter, then up to 31 letters, digits, '_' or '-'")
            self.count.validate()
            if self.memory_auto and self.memory_bytes is not None:
                raise ConfigError(f"memory: give auto or a size ({self.memory_bytes} bytes), not both")
            if self.memory_bytes is not None and self.memory_bytes < 1:
                raise ConfigError(f"memory {self.memory_bytes} bytes: need a positive size, e.g. '12GiB'")
            if self.cpus is not None and not (math.isfinite(self.cpus) and self.cpus > 0):
                raise ConfigError(f"cpus {self.cpus}: need a positive number, e.g. 2 or 0.5")
            if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 0:
                raise ConfigError(f"gpus {self.gpus!r}: need a whole number of devices, 0 or more")
            if self.name in FIXED_COUNT and (self.count.auto or self.count.minimum != self.count.maximum):
                raise ConfigError(f"count {self.count}: give one count; {FIXED_COUNT[self.name]}")
            if self.failure_policy not in FAILURE_POLICIES:
                raise ConfigError(f"failure_policy {self.failure_policy!r}: use one of {', '.join(FAILURE_POLICIES)}")
            self._validate_group()
            if isinstance(self.max_replacements, bool) or not isinstance(self.max_replacements, int) \
                    or self.max_replacements < 0:
                raise ConfigError(f"max_replacements {self.max_replacements!r}: need a whole number, 0 or more")
            if not (math.isfinite(self.replacement_window_s) and self.replacement_window_s > 0):
                raise ConfigError(f"replacement_window_s {self.replacement_window_s}: need a positive number of "
                                  "seconds")
        except ConfigError as exc:
            raise ConfigError(f"role {self.name!r}: {exc}") from None


    def _validate_group(self) -> None:
        if not self.group:
            return
        if self.count.auto:
            raise ConfigError("group = true needs a count (N or MIN:MAX), not auto: an auto role is sized from one "
                              "process measuring an iteration alone, while a group's members start together in one "
                              "world; measure with a count of 1, then give the role its count")
        if self.failure_policy in ALONE_POLICIES:
            raise ConfigError(f"failure_policy {self.failure_policy!r} restarts one process while the others run on, "
                              "but a group's members share one torch.distributed world that breaks with any of "
                              f"them: use {RESTART_ROLE!r} (the default of a group) or {RESTART_JOB!r}")
        if self.name in FIXED_COUNT:
            raise ConfigError(f"group = true: the {self.name} role serves over its own sockets and forms no group")


def parse_count(value: object) -> RoleCount:
    """A role count as the file or a flag gives it: ``N``, ``"N"``, ``"MIN:MAX"`` or ``"auto"``."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"count {value!r}: give N, 'MIN:MAX' or 'auto'")
    text = str(value).strip()
    if text.lower() == AUTO:
        return RoleCount(minimum=1, maximum=None, auto=True)
    parts = text.split(":")
    if len(parts) not in (1, 2) or not all(part.strip().isdigit() for part in parts):
        raise ConfigError(f"count {value!r} is not N, MIN:MAX or auto, e.g. 4, '2:8' or 'auto'")
    count = RoleCount(minimum=int(parts[0]), maximum=int(parts[-1]))
    count.validate()
    return count


def parse_memory(value: object) -> tuple[int | None, bool]:
    """A memory size (``"12GiB"``, ``"512MB"``) or ``"auto"`` into ``(bytes, auto)``."""
    if not isinstance(value, str):
        raise ConfigError(f"memory {value!r}: give a size with its unit as a string, e.g. '12GiB' or '512MB', "
                          "or 'auto'")
    if value.strip().lower() == AUTO:
        return None, True
    match = MEMORY.fullmatch(value)
    unit_name = (match.group(2) or "").upper() if match else ""
    unit = MEMORY_UNITS.get(unit_name[:-1] if len(unit_name) > 1 and unit_name.endswith("B") else unit_name)
    if match is None or unit is None:
        raise ConfigError(f"memory {value!r} is not a size: give a number and a unit (B, KB, MB, GB, TB, KiB, MiB, "
                          "GiB, TiB), e.g. '12GiB', or 'auto'")
    size = int(float(match.group(1)) * unit)
    if size < 1:
        raise ConfigError(f"memory {value!r}: need a positive size")
    return size, False


def role_from_table(name: str, table: dict[str, object], locate: Callable[[str], str]) -> RoleSpec:
    """A RoleSpec from a ``[roles.NAME]`` table; ``locate(key)`` gives the ``file:line: `` of a key for errors."""
    for key in table:
        if key not in ROLE_KEYS:
            close = difflib.get_close_matches(key, ROLE_KEYS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"{locate(key)}unknown key {key!r} in [roles.{name}]: {hint}a role takes "
                              f"{', '.join(ROLE_KEYS)}")
    if not ROLE_NAME.fullmatch(name):
        raise ConfigError(f"{locate('')}[roles.{name}]: a role name is a letter, then up to 31 letters, digits, "
                          "'_' or '-'")

    def read(key: str, convert: Callable[[object], Value], default: Value) -> Value:
        if key not in table:
            return default
        try:
            return convert(table[key])
        except ConfigError as exc:
            raise ConfigError(f"{locate(key)}roles.{name}.{key}: {exc}") from None

    no_memory: tuple[int | None, bool] = (None, False)
    memory_bytes, memory_auto = read("memory", parse_memory, no_memory)
    spec = RoleSpec(
        name=name, entrypoint=read("entrypoint", _string, ""), args=tuple(read("args", _strings, [])),
        module=read("module", _boolean, False), count=read("count", parse_count, RoleCount()),
        memory_bytes=memory_bytes, memory_auto=memory_auto, cpus=read("cpus", _cpus, None),
        gpus=read("gpus", _gpus, 0), failure_policy=read("failure_policy", _policy, ""),
        service=read("service", _boolean, None), after=read("after", _role_names, None),
        group=read("group", _boolean, False), max_replacements=read("max_replacements", _whole, 10),
        replacement_window_s=read("replacement_window_s", _seconds, 60.0),
    )
    spec.validate()
    return spec


def parse_role_flag(spec: str) -> tuple[str, RoleCount]:
    """``--role NAME=COUNT`` into the role's name and count."""
    name, sep, count = spec.partition("=")
    if not sep or not ROLE_NAME.fullmatch(name.strip()):
        raise ConfigError(f"--role {spec!r} is not NAME=COUNT, e.g. --role actor=4 or --role learner=1:2")
    try:
        return name.strip(), parse_count(count)
    except ConfigError as exc:
        raise ConfigError(f"--role {spec!r}: {exc}") from None


def role_counts_from_flags(shorthands: dict[str, str | None],
                           role_flags: list[str]) -> list[tuple[str, RoleCount, str]]:
    """``(role, count, flag as given)`` from ``--ps`` and ``--workers`` (by their dest in ROLE_FLAGS) and each
    ``--role NAME=COUNT``."""
    counts = []
    for dest, value in shorthands.items():
        if value is not None:
            try:
                counts.append((ROLE_FLAGS[dest], parse_count(value), f"--{dest} {value}"))
            except ConfigError as exc:
                raise ConfigError(f"--{dest} {value!r}: {exc}") from None
    return counts + [(*parse_role_flag(spec), f"--role {spec}") for spec in role_flags]


def apply_role_counts(roles: tuple[RoleSpec, ...], counts: list[tuple[str, RoleCount, str]],
                      job_has_script: bool) -> tuple[RoleSpec, ...]:
    """Override the count of declared roles, or add roles, from ``(role, count, flag)`` of the command line.

    A role the flags add runs the job's script, so it needs one; two flags for one role are refused."""
    given: dict[str, str] = {}
    result = list(roles)
    for name, count, flag in counts:
        if name in given:
            raise ConfigError(f"role {name!r} given twice: by {given[name]} and by {flag}; keep one")
        given[name] = flag
        index = next((i for i, role in enumerate(result) if role.name == name), None)
        if index is not None:
            result[index] = replace(result[index], count=count)
        elif not job_has_script:
            raise ConfigError(f"{flag}: no {name} role possible: the job declares no [roles.{name}] and gives no "
                              f"script for one to run; declare [roles.{name}] with an entrypoint, or give SCRIPT")
        else:
            result.append(RoleSpec(name=name, count=count))
    return tuple(result)


def check_roles(roles: tuple[RoleSpec, ...], job_has_script: bool) -> None:
    """Each role valid, named once, with something to run, and the ``after``s naming roles there are, in no
    cycle."""
    seen = set()
    for role in roles:
        role.validate()
        if role.name in seen:
            raise ConfigError(f"role {role.name!r} given twice: declare each role once")
        seen.add(role.name)
        if not role.entrypoint and not job_has_script:
            raise ConfigError(f"role {role.name!r} has no entrypoint and the job gives no script: give the role an "
                              "entrypoint, or the job a SCRIPT that asks convoy.role()")
    start_order(roles)


def waits_for(roles: tuple[RoleSpec, ...]) -> dict[str, tuple[str, ...]]:
    """The roles each role starts after: its ``after``, else every service (none for a service)."""
    services = tuple(role.name for role in roles if role.service)
    return {role.name: role.after if role.after is not None else () if role.service else services for role in roles}


def start_order(roles: tuple[RoleSpec, ...]) -> list[str]:
    """The roles in an order that starts each after the roles it waits for; a ConfigError for an ``after`` that
    names a role the job does not have, or for a cycle of them (named in full)."""
    waits, known = waits_for(roles), [role.name for role in roles]
    for name, before in waits.items():
        for other in before:
            if other not in known:
                close = difflib.get_close_matches(other, known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(f"role {name!r}: after = {list(before)} names {other!r}, which is not a role of "
                                  f"this job{hint}; its roles: {', '.join(known)}")
    order: list[str] = []
    path: list[str] = []

    def visit(name: str) -> None:
        if name in order:
            return
        if name in path:
            cycle = [*path[path.index(name):], name]
            raise ConfigError(f"roles wait for each other in a cycle: {' -> '.join(cycle)} (each 'after' waits for the "
                              "next); drop one of these after entries")
        path.append(name)
        for other in waits[name]:
            visit(other)
        path.pop()
        order.append(name)

    for name in known:
        visit(name)
    return order


def _cpus(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ConfigError(f"cpus {value!r}: need a positive number, e.g. 2 or 0.5")
    return float(value)


def _gpus(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"gpus {value!r}: need a whole number of devices, 0 or more, e.g. 1")
    return value


def _policy(value: object) -> str:
    if value not in FAILURE_POLICIES:
        raise ConfigError(f"failure_policy {value!r}: use one of {', '.join(FAILURE_POLICIES)}")
    return str(value)


def _role_names(value: object) -> tuple[str, ...]:
    names = _strings(value)
    for name in names:
        if not ROLE_NAME.fullmatch(name):
            raise ConfigError(f"{name!r} is not a role name (a letter, then letters, digits, '_' or '-')")
    return tuple(names)


def _whole(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{value!r}: need a whole number, 0 or more")
    return value


def _seconds(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{value!r}: need a positive number of seconds, e.g. 60")
    return float(value)


def _string(value: object) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{value!r} is not a string")
    return value


def _strings(value: object) -> list[str]:
    if isinstance(value, str) or not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ConfigError(f"{value!r} is not a list of strings, e.g. [\"--lr\", \"0.1\"]")
    return list(value)


def _boolean(value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{value!r} is not true or false")
    return value
