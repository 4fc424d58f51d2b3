"""Every ``convoy`` command line the docs show works as written: the README, the pages under docs/, the READMEs
of the examples and the workloads, and the examples' own docstrings. Each line goes through the real parser
(torchrun's spellings translated first, as ``convoy run`` does), ``convoy plan``'s check that none of its own flags
came after the script, and every example it names exists. Optional parts (``[--out FILE]``) are left out and the
first of alternatives (``a|b``) taken, a one-letter placeholder (``--node-rank K``) read as 1, and a line read up to
a placeholder that stands for more words (``...``)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from convoy.cli.main import build_parser
from convoy.cli.torchrun import translate as translate_torchrun
from convoy.errors import ConvoyError
from convoy.strategy.cli import script_arguments

REPO = Path(__file__).resolve().parents[2]
COMMANDS = ("run", "master", "agent", "status", "scale", "config", "manager", "dashboard", "pipeline", "plan",
            "decode", "gbdt", "confidential")
LINE = re.compile(r"^\s*(?:[\w-]+\$ )?(convoy (?:" + "|".join(COMMANDS) + r")\b.*)$")  # "host0$ convoy ..." too


def sources() -> list[Path]:
    pages = [REPO / "README.md", REPO / "examples" / "README.md",
             *sorted(page for page in (REPO / "docs").rglob("*.md") if page.name != "architecture.md")]  # drawings
    return pages + sorted((REPO / "convoy").rglob("README.md")) + sorted((REPO / "examples").glob("*.py"))


def shown_commands(path: Path) -> list[tuple[str, str]]:
    """(where, line) for each command line in a code block of a page, or indented in an example's docstring; a
    line continued with a backslash is one command, named by its first line."""
    found, fenced, held = [], False, ""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if held:
            held = held[:-1] + " " + line.strip()
            if not held.endswith("\\"):
                found[-1] = (found[-1][0], held)
                held = ""
            continue
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        shown = fenced if path.suffix == ".md" else line.startswith("    convoy ")
        match = LINE.match(line) if shown else None
        if match:
            found.append((f"{path.relative_to(REPO)}:{number}", match.group(1)))
            held = match.group(1) if match.group(1).endswith("\\") else ""
    return found


SHOWN = [one for path in sources() for one in shown_commands(path)]


def as_typed(line: str) -> list[str]:
    """The words a user types: no comment, no optional part, the first of alternatives, up to a placeholder."""
    line = re.split(r"\s+#", line, maxsplit=1)[0]
    line = re.sub(r"\[[^\]]*\]", "", line)
    words = []
    for word in shlex.split(line)[1:]:
        if word.endswith("..."):
            break
        words.append("1" if re.fullmatch(r"[A-Z]", word) else word.split("|")[0])  # --node-rank K
    return words


def test_the_docs_show_commands_to_check() -> None:
    assert len(SHOWN) >= 20, SHOWN
    assert any("convoy plan --nodes 2" in line for _, line in SHOWN)


@pytest.mark.parametrize("where,line", SHOWN, ids=[where for where, _ in SHOWN])
def test_each_command_the_docs_show_parses_as_written(where: str, line: str) -> None:
    argv = as_typed(line)
    if argv[0] == "run":
        try:
            argv = argv[:1] + translate_torchrun(argv[1:])
        except ConvoyError as exc:
            pytest.fail(f"{where}: {line}: {exc}")
    try:
        args = build_parser(argv[0]).parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: {line}: the parser refuses it (see above)")
    if argv[0] == "plan":
        script_arguments(args.script, list(args.script_args))  # raises where a plan flag follows the script
    for word in argv:
        if word.startswith("examples/") and word.endswith(".py"):
            assert (REPO / word).is_file(), f"{where}: {line}: {word} does not exist"
