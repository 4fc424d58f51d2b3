"""A standby worker: imports the heavy modules first, then waits for its rank and runs the script.

The agent keeps one standby per local worker, so a (re)start pays for ``import torch`` before
the round even closes (argv: the preload list and a fd to signal readiness). The order arrives
as one JSON line on stdin:
``{"env": {...}, "argv": [...], "entrypoint": "...", "module": false}``. An unmodified script
runs as it would under ``python script.py`` (``__name__ == "__main__"``, ``sys.argv``, ``sys.path[0]``).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import runpy
import sys
import traceback


def _read_order() -> dict[str, object] | None:
    chunks = []
    while True:
        chunk = os.read(0, 65536)
        if not chunk:
            break
        chunks.append(chunk)
        if chunk.endswith(b"\n"):
            break
    data = b"".join(chunks).strip()
    return json.loads(data) if data else None


def main() -> int:
    preload, ready_fd = sys.argv[1], int(sys.argv[2])
    for name in filter(None, preload.split(",")):
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # the script imports what it needs itself; preloading is only a head start
    gc.freeze()  # preloaded objects live for good: later collections and the exit skip them (~1 s less)
    os.write(ready_fd, b"R")  # tells the agent this standby is warm
    os.close(ready_fd)
    order = _read_order()
    if order is None:
        return 0  # the agent let this standby go unused
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.environ.update(order["env"])  # type: ignore[arg-type]
    sys.argv = list(order["argv"])  # type: ignore[call-overload]
    entrypoint = str(order["entrypoint"])
    try:
        if order["module"]:
            runpy.run_module(entrypoint, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(entrypoint))
            runpy.run_path(entrypoint, run_name="__main__")
    except Exception as exc:  # noqa: BLE001 (reported as python itself would, exit code 1)
        _print_script_traceback(exc)
        return 1
    return 0


def _print_script_traceback(exc: BaseException) -> None:
    """Print the traceback from the script's own frames on, as ``python script.py`` would."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>", runpy.__file__):
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb)
    sys.stderr.flush()


if __name__ == "__main__":
    sys.exit(main())
