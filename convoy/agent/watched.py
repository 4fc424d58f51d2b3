"""``python -m convoy.agent.watched [-m] ENTRY [ARGS...]``: a role process started without the node's fork server
runs its script as ``python ENTRY ARGS`` (or ``python -m ENTRY``) would, beside the watcher of its lease
(``lease_watch.py``), as the fork server's children do: a process whose agent went silent stops itself."""

from __future__ import annotations

import sys

from convoy.agent.standby import run_script


def main(argv: list[str]) -> int:
    module = argv[:1] == ["-m"]
    entry, *args = argv[1:] if module else argv
    sys.argv = [entry, *args]
    return run_script(entry, module)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
