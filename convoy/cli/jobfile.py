"""The TOML job file of ``convoy run job.toml``: every ``convoy run`` option and the roles, checked whole, each error
naming the file, the line and the key (tomllib gives no positions, so the lines are found in the text here)."""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import tomllib

from convoy.config import check_entrypoint, parse_nnodes
from convoy.errors import ConfigError
from convoy.ray_config import check_scheduler
from convoy.roles_config import (ROLE_FLAGS, RoleCount, RoleSpec, apply_role_counts, parse_count, parse_role_flag,
                                 role_from_table)

JOB_FILE_SUFFIX = ".toml"
"""``convoy run NAME.toml`` reads a job file where a script would stand."""


@dataclass(frozen=True)
class JobFile:
    """What a job file gives: ``convoy run`` options, as that command's parser holds them, and the roles."""

    path: Path
    options: dict[str, object]
    """By the argparse dest of the flag each key names (``entrypoint`` is ``script``); paths resolved."""
    roles: tuple[RoleSpec, ...] = ()
    """The ``[roles.NAME]`` tables and the roles of the ``ps``, ``workers`` and ``role`` keys."""


def _whole(minimum: int, maximum: int | None = None) -> Callable[[object], object]:
    def convert(value: object) -> object:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{value!r} is not a whole number")
        if value < minimum or (maximum is not None and value > maximum):
            raise ConfigError(f"{value}: need {minimum}..{maximum}" if maximum else f"{value}: need {minimum} or more")
        return value
    return convert


def _seconds(positive: bool) -> Callable[[object], object]:
    def convert(value: object) -> object:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise ConfigError(f"{value!r} is not a number of seconds")
        if value < 0 or (positive and value == 0):
            raise ConfigError(f"{value}: need seconds {'> 0' if positive else '>= 0'}")
        return float(value)
    return convert


def _typed(kind: type) -> Callable[[object], object]:
    def convert(value: object) -> object:
        if not isinstance(value, kind) or (kind is str and not value):
            raise ConfigError(f"{value!r} is not {'true or false' if kind is bool else 'a non-empty string'}")
        return value
    return convert


def _nnodes(value: object) -> object:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{value!r} is not N or 'MIN:MAX'")
    parse_nnodes(str(value))
    return str(value)


def _amount(value: object) -> object:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{value!r} is not an amount >= 0")
    return float(value)


def _strings(value: object) -> list[str]:
    if isinstance(value, str) or not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ConfigError(f"{value!r} is not a list of strings, e.g. [\"--lr\", \"0.1\"]")
    return list(value)


JOB_FILE_OPTIONS: dict[str, tuple[str, Callable[[object], object]]] = {
    "entrypoint": ("script", _typed(str)), "args": ("args", _strings), "module": ("module", _typed(bool)),
    "nnodes": ("nnodes", _nnodes), "nproc_per_node": ("nproc_per_node", _whole(1)),
    "max_restarts": ("max_restarts", _whole(0)), "run_dir": ("run_dir", _typed(str)), "host": ("host", _typed(str)),
    "port": ("port", _whole(0, 65535)), "rdzv_wait": ("rdzv_wait", _seconds(False)),
    "join_timeout": ("join_timeout", _seconds(True)), "heartbeat_timeout": ("heartbeat_timeout", _seconds(True)),
    "max_regroups": ("max_regroups", _whole(1)), "regroup_window": ("regroup_window", _seconds(True)),
    "relaunch": ("relaunch", _typed(bool)), "stop_grace": ("stop_grace", _seconds(False)),
    "preload": ("preload", lambda value: ",".join(_strings(value))),
    "ps": ("ps", parse_count), "workers": ("workers", parse_count), "role": ("role", _strings),
    "auto_apply": ("auto_apply", lambda value: ",".join(_strings(value))),
    "priority": ("priority", _whole(-1000, 1000)), "preempt_grace": ("preempt_grace", _seconds(False)),
    "scheduler": ("scheduler", lambda value: check_scheduler(str(_typed(str)(value)))),
    "address": ("address", _typed(str)), "placement_timeout": ("placement_timeout", _seconds(True)),
    "ray_cpus": ("ray_cpus", _amount), "ray_gpus": ("ray_gpus", _amount), "ray_memory": ("ray_memory", _typed(str)),
    "ray_resource": ("ray_resource", _strings),
}
"""Each top-level key: the argparse dest of the ``convoy run`` flag it stands for, and the check of its value."""
_KEY_PART = r"""(?:[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|'[^']*')"""
_KEY_PATH = rf"{_KEY_PART}(?:\s*\.\s*{_KEY_PART})*"
_TABLE_LINE = re.compile(rf"\s*\[\[?\s*({_KEY_PATH})\s*\]\]?")
_KEY_LINE = re.compile(rf"\s*({_KEY_PATH})\s*=")


def key_lines(text: str) -> dict[tuple[str, ...], int]:
    """The line (from 1) of each table header and key of a TOML text, by full key path."""
    lines: dict[tuple[str, ...], int] = {}
    table: tuple[str, ...] = ()
    in_string = False
    for number, line in enumerate(text.splitlines(), start=1):
        quotes = line.count('"""') + line.count("'''")
        if in_string:  # inside a multi-line string: nothing here is a key
            in_string = quotes % 2 == 0
            continue
        header, assignment = _TABLE_LINE.match(line), _KEY_LINE.match(line)
        if header:
            table = _key_path(header.group(1))
            lines.setdefault(table, number)
        elif assignment:
            lines.setdefault(table + _key_path(assignment.group(1)), number)
        in_string = quotes % 2 == 1
    return lines


def _key_path(text: str) -> tuple[str, ...]:
    return tuple(part.strip("\"'") for part in re.findall(_KEY_PART, text))


class _Places:
    """Where each key of one job file is, as the ``FILE:LINE: `` an error starts with."""

    def __init__(self, path: Path, text: str) -> None:
        self.path, self.lines = path, key_lines(text)

    def line(self, *keys: str) -> int | None:
        """The key's line; for a key inside an inline table, the line of the nearest key around it."""
        for end in range(len(keys), 0, -1):
            if keys[:end] in self.lines:
                return self.lines[keys[:end]]
        return None

    def __call__(self, *keys: str) -> str:
        line = self.line(*keys)
        return f"{self.path}: " if line is None else f"{self.path}:{line}: "


def load_job_file(path: Path) -> JobFile:
    """Read and check a job file whole, before anything starts; the first bad key is a ConfigError."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"job file {str(path)!r} cannot be read: {reason}") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        line = re.search(r"at line (\d+)", str(exc))
        raise ConfigError(f"{path}:{line.group(1) if line else 1}: not valid TOML: {exc}") from None
    place = _Places(path, text)
    options: dict[str, object] = {}
    for key, value in data.items():
        if key == "roles":
            continue
        if key == "train":
            options["set"] = _train_table(value, place)
            continue
        if key not in JOB_FILE_OPTIONS:
            close = difflib.get_close_matches(key, [*JOB_FILE_OPTIONS, "roles", "train"], n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"{place(key)}unknown key {key!r}: {hint}a job file takes the `convoy run` options "
                              f"with '_' for '-' ({', '.join(JOB_FILE_OPTIONS)}), [roles.NAME] tables and a [train] "
                              "table")
        dest, convert = JOB_FILE_OPTIONS[key]
        try:
            options[dest] = convert(value)
        except ConfigError as exc:
            raise ConfigError(f"{place(key)}{key}: {exc}") from None
    base = path.parent  # paths in the file are relative to the file, wherever convoy runs
    if "run_dir" in options:
        options["run_dir"] = base / str(options["run_dir"])
    if "script" in options:
        module = bool(options.get("module", False))
        options["script"] = str(options["script"]) if module else str(base / str(options["script"]))
        try:
            check_entrypoint(str(options["script"]), module)
        except ConfigError as exc:
            raise ConfigError(f"{place('entrypoint')}entrypoint: {exc}") from None
    roles = _file_roles(data.get("roles", {}), options, base, place)  # takes the ps, workers and role keys out
    return JobFile(path, options, roles)


def _train_table(table: Any, place: _Places) -> list[str]:
    """The ``[train]`` table: the training config's values, as ``--set KEY=VALUE`` items."""
    if not isinstance(table, dict):
        raise ConfigError(f"{place('train')}train: give the training config's values as a table, [train]")
    items = []
    for key, value in table.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (int, float, str)):
            text = str(value)
        else:
            raise ConfigError(f"{place('train', key)}train.{key}: a value of the training config is a number, a "
                              f"bool or a string (got {type(value).__name__})")
        items.append(f"{key}={text}")
    return items


def _file_roles(tables: Any, options: dict[str, object], base: Path, place: _Places) -> tuple[RoleSpec, ...]:
    """The roles of the ``[roles.NAME]`` tables, then those of the ``ps``, ``workers`` and ``role`` keys."""
    if not isinstance(tables, dict):
        raise ConfigError(f"{place('roles')}roles: declare each role as a table, [roles.NAME]")
    roles = []
    for name, table in tables.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{place('roles', name)}roles.{name}: declare the role as a table, [roles.{name}]")
        role = role_from_table(name, table, lambda key, name=name: place("roles", name, *filter(None, [key])))
        if role.entrypoint and not role.module:
            role = replace(role, entrypoint=str(base / role.entrypoint))
        if role.entrypoint:
            try:
                check_entrypoint(role.entrypoint, role.module)
            except ConfigError as exc:
                raise ConfigError(f"{place('roles', name, 'entrypoint')}roles.{name}.entrypoint: {exc}") from None
        roles.append(role)
    counts: list[tuple[str, RoleCount, str]] = []
    for key, role_name in ROLE_FLAGS.items():
        count = options.pop(key, None)
        if isinstance(count, RoleCount):
            counts.append((role_name, count, key))
    for spec in _strings(options.pop("role", [])):
        try:
            counts.append((*parse_role_flag(spec), "role"))
        except ConfigError as exc:
            raise ConfigError(f"{place('role')}role: {exc}") from None
    given: dict[str, str] = {}
    result = tuple(roles)
    for role_name, count, key in counts:
        earlier = given.get(role_name)
        if role_name in tables:
            earlier = f"[roles.{role_name}] (line {place.line('roles', role_name)})"
        if earlier:
            raise ConfigError(f"{place(key)}{key}: role {role_name!r} given twice: by {earlier} and by {key}; "
                              "keep one")
        given[role_name] = key
        try:
            result = apply_role_counts(result, [(role_name, count, key)], job_has_script="script" in options)
        except ConfigError as exc:
            raise ConfigError(f"{place(key)}{exc}") from None
    return result
