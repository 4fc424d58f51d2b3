"""A job's training config as versioned data: the schema a script declares, the values a user sets, and the
history of versions with the step each took effect at. Pure (the master holds its lock around each call,
records the events, and persists ``state()`` with the job's state).

A field is ``hot`` (applied in place at a step boundary) or ``restart`` (applied by a coordinated restart of
the round from the snapshot of the step before). Every version holds the whole config, so the values at any
step are those of the newest version whose ``at_step`` is at or before it.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from convoy.errors import ConfigError, ConflictError

HOT, RESTART = "hot", "restart"
KINDS = (HOT, RESTART)
TYPES = ("int", "float", "bool", "str")
MAX_FIELDS = 256
MAX_VERSIONS = 1000
"""Versions kept in the job's state; older ones are summarized by their number only."""
INITIAL, CHANGE, REVERT = "initial", "change", "revert"
PENDING, ACTIVE, SUPERSEDED, REVERTED = "pending", "active", "superseded", "reverted"
Value = int | float | bool | str


@dataclass(frozen=True)
class FieldSpec:
    """One field of the script's config dataclass, as the script declared it."""

    name: str
    type: str
    kind: str
    default: Value
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[Value, ...] = ()
    doc: str = ""

    def check(self) -> None:
        if not self.name.isidentifier():
            raise ConfigError(f"config field name {self.name!r} is not an identifier")
        if self.type not in TYPES:
            raise ConfigError(f"config field {self.name!r} has type {self.type!r}; a live field is one of {TYPES}")
        if self.kind not in KINDS:
            raise ConfigError(f"config field {self.name!r} is {self.kind!r}; mark it convoy.hot() or convoy.restart()")
        if self.minimum is not None and self.maximum is not None and self.minimum > self.maximum:
            raise ConfigError(f"config field {self.name!r}: min {self.minimum} is above max {self.maximum}")
        self.parse(self.default, what="default")

    def parse(self, raw: Any, what: str = "value") -> Value:
        """``raw`` (a typed JSON value, or the text of ``key=value``) as this field's type, checked against its
        range and choices; a ConfigError names the field."""
        value = _coerce(self, raw, what)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"config field {self.name!r}: {what} {raw!r} is not a finite number")
        if self.minimum is not None and not isinstance(value, (bool, str)) and value < self.minimum:
            raise ConfigError(f"config field {self.name!r}: {what} {value!r} is below its minimum {self.minimum:g}")
        if self.maximum is not None and not isinstance(value, (bool, str)) and value > self.maximum:
            raise ConfigError(f"config field {self.name!r}: {what} {value!r} is above its maximum {self.maximum:g}")
        if self.choices and value not in self.choices:
            raise ConfigError(f"config field {self.name!r}: {what} {value!r} is not one of {list(self.choices)}")
        return value


def _coerce(spec: FieldSpec, raw: Any, what: str) -> Value:
    bad = ConfigError(f"config field {spec.name!r} is {spec.type}: {what} {raw!r} is not one")
    if spec.type == "str":
        if not isinstance(raw, str):
            raise bad
        return raw
    if spec.type == "bool":
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower() if isinstance(raw, str) else ""
        if text in ("true", "1", "yes", "on"):
            return True
        if text in ("false", "0", "no", "off"):
            return False
        raise bad
    if isinstance(raw, bool):
        raise bad
    if spec.type == "int":
        if isinstance(raw, int):
            return raw
        if isinstance(raw, float) and raw.is_integer():
            return int(raw)
        if isinstance(raw, str):
            try:
                return int(raw.strip())
            except ValueError:
                raise bad from None
        raise bad
    if isinstance(raw, (int, float)):
        return float(raw)
    if isinstance(raw, str):
        try:
            return float(raw.strip())
        except ValueError:
            raise bad from None
    raise bad


@dataclass(frozen=True)
class Schema:
    """What a script declared: its fields, and whether it can be restarted (``restartable``: it resumes from a
    Checkpointer, so a restart field can be applied by a restart)."""

    fields: tuple[FieldSpec, ...]
    restartable: bool = True

    def check(self) -> None:
        if not self.fields:
            raise ConfigError("the training config declares no fields")
        if len(self.fields) > MAX_FIELDS:
            raise ConfigError(f"the training config declares {len(self.fields)} fields (at most {MAX_FIELDS})")
        names = [spec.name for spec in self.fields]
        if len(set(names)) != len(names):
            raise ConfigError(f"the training config declares a field twice: {names}")
        for spec in self.fields:
            spec.check()

    @property
    def by_name(self) -> dict[str, FieldSpec]:
        return {spec.name: spec for spec in self.fields}

    def defaults(self) -> dict[str, Value]:
        return {spec.name: spec.default for spec in self.fields}

    def parse(self, assignments: dict[str, Any], what: str = "value") -> dict[str, Value]:
        """Typed values of ``assignments`` (field -> raw value); an unknown field is a ConfigError naming it
        and the fields there are."""
        specs = self.by_name
        parsed: dict[str, Value] = {}
        for name, raw in assignments.items():
            spec = specs.get(name)
            if spec is None:
                known = ", ".join(sorted(specs))
                raise ConfigError(f"the training config has no field {name!r} (its fields: {known})")
            parsed[name] = spec.parse(raw, what)
        return parsed

    def to_json(self) -> dict[str, Any]:
        return {"fields": [asdict(spec) | {"choices": list(spec.choices)} for spec in self.fields],
                "restartable": self.restartable}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Schema:
        try:
            fields = tuple(FieldSpec(**{**entry, "choices": tuple(entry.get("choices") or ())})
                           for entry in data["fields"])
            schema = cls(fields, bool(data.get("restartable", True)))
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"malformed training config schema: {exc}") from exc
        schema.check()
        return schema


@dataclass
class Version:
    """One version of the whole config; ``changed`` names what differs from the version before it."""

    number: int
    values: dict[str, Value]
    changed: dict[str, Value]
    kind: str
    """``initial``, ``change`` (a user's, or an applied proposal's) or ``revert``."""
    apply: str
    """``hot`` or ``restart``: how the change reaches the ranks."""
    at_step: int
    """The first step that runs with this version."""
    author: str
    reason: str
    created_at: float
    status: str = PENDING
    switched: dict[str, int] = field(default_factory=dict)
    """Task (``role:rank``) -> the first step it ran with this version (from the ranks' own reports)."""
    trusted: bool = False
    """Every rank ran ``trust_steps`` steps with it: a failure after that is not this version's."""
    role_steps: dict[str, int] = field(default_factory=dict)
    """Role -> its first step with this version, where the roles of a job count steps of their own (an actor's
    episodes, a learner's updates); a role not named here switches at ``at_step``."""

    def step_for(self, role: str) -> int:
        """The first step of ``role`` that runs with this version."""
        return self.role_steps.get(role, self.at_step)

    def public(self) -> dict[str, Any]:
        return asdict(self)


class ConfigHistory:
    """The versions of one job's config, from the first declaration on."""

    def __init__(self, overrides: dict[str, str] | None = None) -> None:
        self.overrides = dict(overrides or {})
        """``--set`` and ``[train]`` values of the job, applied to the defaults when the script declares."""
        self.schema: Schema | None = None
        self.declared_by = ""
        self.versions: list[Version] = []

    @property
    def current(self) -> Version | None:
        return self.versions[-1] if self.versions else None

    def declare(self, schema: Schema, by: str) -> Version | None:
        """The script's schema: the first declaration makes version 1 (defaults + the job's overrides); an equal
        one is a no-op (None); a different one is a ConflictError."""
        schema.check()
        if self.schema is not None:
            if schema != self.schema:
                raise ConflictError(f"{by} declares a training config other than the one {self.declared_by} declared;"
                                    " every process of the job must declare the same dataclass")
            return None
        values = schema.defaults() | schema.parse(self.overrides, what="--set value")
        self.schema, self.declared_by = schema, by
        first = Version(1, values, dict(values), INITIAL, HOT, 0, "job", "the script's defaults and the job's --set",
                        time.time(), ACTIVE, trusted=False)
        self.versions.append(first)
        return first

    def prepare(self, assignments: dict[str, Any]) -> tuple[dict[str, Value], str]:
        """Check a change against the schema and the current version: the fields that change, and how they
        apply (``restart`` when any of them is a restart field). Changes nothing."""
        schema, current = self.schema, self.current
        if schema is None or current is None:
            raise ConflictError("the job's script has not declared its training config yet (convoy.train_config); "
                                "set it once the workers run, or give --set to convoy run")
        if not assignments:
            raise ConfigError("give at least one field to set (KEY=VALUE)")
        wanted = schema.parse(assignments)
        changed = {name: value for name, value in wanted.items() if current.values.get(name) != value}
        if not changed:
            raise ConflictError(f"version {current.number} already has {_words(wanted)}: nothing to change")
        specs = schema.by_name
        restart = sorted(name for name in changed if specs[name].kind == RESTART)
        if restart and not schema.restartable:
            raise ConflictError(f"{', '.join(restart)} can only change by a restart, and the script declared that it "
                                "cannot restart (restartable=False); change its hot fields only")
        pending = [v for v in self.versions if v.status == PENDING and v.apply == RESTART]
        if pending:
            raise ConflictError(f"version {pending[0].number} is being applied by a restart; set the config again "
                                "once it is active")
        return changed, RESTART if restart else HOT

    def add(self, changed: dict[str, Value], apply: str, at_step: int, author: str, reason: str,
            kind: str = CHANGE, rollback: bool = False, role_steps: dict[str, int] | None = None) -> Version:
        """A new version: the current values with ``changed``, from ``at_step`` on (``role_steps``: a role's own
        first step), each no earlier than any version before it, except for a ``rollback``, whose steps from
        ``at_step`` on run again."""
        current = self.current
        assert current is not None and self.schema is not None
        role_steps = dict(role_steps or {})
        if not rollback:
            at_step = max(at_step, max((v.at_step for v in self.versions), default=0))
            role_steps = {role: max(step, max(v.step_for(role) for v in self.versions))
                          for role, step in role_steps.items()}
        version = Version(current.number + 1, current.values | changed, dict(changed), kind, apply, at_step, author,
                          reason, time.time(), role_steps=role_steps)
        self.versions.append(version)
        del self.versions[:-MAX_VERSIONS]
        return version

    def effective(self, step: int, role: str = "") -> Version | None:
        """The version step ``step`` (of ``role``) runs with."""
        live = [v for v in self.versions if v.status != REVERTED and v.step_for(role) <= step]
        return live[-1] if live else None

    def number(self, number: int) -> Version | None:
        return next((v for v in self.versions if v.number == number), None)

    def before(self, version: Version) -> Version | None:
        """The version that was in effect just before ``version``."""
        earlier = [v for v in self.versions if v.number < version.number and v.status != REVERTED]
        return earlier[-1] if earlier else None

    def state(self) -> dict[str, Any]:
        return {"overrides": self.overrides, "schema": self.schema.to_json() if self.schema else None,
                "declared_by": self.declared_by, "versions": [v.public() for v in self.versions]}

    @classmethod
    def from_state(cls, data: dict[str, Any]) -> ConfigHistory:
        history = cls(data.get("overrides") or {})
        if data.get("schema"):
            history.schema = Schema.from_json(data["schema"])
        history.declared_by = str(data.get("declared_by", ""))
        history.versions = [Version(**entry) for entry in data.get("versions", [])]
        return history


def _words(values: dict[str, Value]) -> str:
    return ", ".join(f"{name}={value!r}" for name, value in values.items())


def parse_assignments(items: list[str]) -> dict[str, str]:
    """``["lr=0.05", "clip=1"]`` -> ``{"lr": "0.05", "clip": "1"}``; a ConfigError names an item without ``=``."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{item!r} is not KEY=VALUE (e.g. lr=0.05)")
        out[key.strip()] = value.strip()
    return out
