"""The search's results as a table and as the strategy file (pure; standard library only)."""

from __future__ import annotations

import re
from typing import Any

from convoy.errors import ConfigError

UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30}


def parse_bytes(text: str, flag: str = "--memory") -> float:
    """``1.5GB`` -> 1.5e9; ``512MiB``, ``2e9`` too."""
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not found or found.group(2).lower() not in UNITS:
        raise ConfigError(f"{flag} {text!r} is not a size; write e.g. 1.5GB, 800MB or 2GiB")
    return float(found.group(1)) * UNITS[found.group(2).lower()]


def _searched(result: dict[str, Any]) -> dict[str, dict]:
    """The search's measured candidates by key: ``seconds`` (the median of all its steps) and its ``runs``
    (``steps``, ``seconds``, ``peak`` each)."""
    return {_key(entry["strategy"]): entry for entry in result.get("measured", [])}


def _key(strategy: dict) -> str:
    return repr(sorted(strategy.items()))


def table(result: dict[str, Any], show_dropped: bool = True) -> str:
    """candidate | predicted memory | predicted s | measured s (search) | measured memory | why dropped."""
    searched_all = _searched(result)
    grid = {_key(g["strategy"]): g for g in result.get("exhaustive", [])}
    winner = _key(result["winner"]) if "winner" in result else None
    head = (f"{'candidate':<39}{'pred MB':>9}{'pred s':>8}{'search s':>10}{'meas MB':>9}{'mem err':>9}"
            f"{'grid s':>8}  note")
    lines = [head, "-" * len(head)]
    for row in sorted(result["rows"], key=lambda r: (bool(r["dropped"]), r["predicted_s"])):
        key = _key(row["strategy"])
        if row["dropped"] and not show_dropped:
            continue
        searched = searched_all.get(key)
        measured_s = f"{searched['seconds']:.3f}" if searched else "-"
        peak = searched["runs"][-1]["peak"] if searched else (grid[key]["peak"] if key in grid else None)
        peak_text = f"{peak / 1e6:.0f}" if peak is not None else "-"
        error = f"{(row['memory'] - peak) / peak:+.1%}" if peak else "-"
        grid_s = f"{grid[key]['seconds']:.3f}" if key in grid else "-"
        rounds = f"halving: {len(searched['runs'])} round(s)" if searched else "not measured"
        note = "PICK" if key == winner else (f"dropped: {row['dropped']}" if row["dropped"] else rounds)
        lines.append(f"{row['name']:<39}{row['memory'] / 1e6:>9.0f}{row['predicted_s']:>8.3f}{measured_s:>10}"
                     f"{peak_text:>9}{error:>9}{grid_s:>8}  {note}")
    return "\n".join(lines)


def memory_errors(result: dict[str, Any]) -> list[tuple[str, float]]:
    """(where, (predicted - measured) / measured) for every run of a candidate (search and grid), ``where`` naming
    the candidate and whether the search or the grid ran it."""
    rows = {_key(r["strategy"]): r for r in result["rows"]}

    def error(strategy: dict, peak: float) -> float:
        return (rows[_key(strategy)]["memory"] - peak) / peak

    errors = [(f"search {rows[_key(e['strategy'])]['name']}", error(e["strategy"], run["peak"]))
              for e in result.get("measured", []) for run in e["runs"]]
    errors += [(f"grid {rows[_key(g['strategy'])]['name']}", error(g["strategy"], peak))
               for g in result.get("exhaustive", []) for peak in g.get("peaks", [g["peak"]])]
    return errors
