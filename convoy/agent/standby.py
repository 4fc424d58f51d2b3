"""A standby worker: imports the heavy modules first, then waits for its rank and runs the script.

The agent keeps one standby per local worker, so a (re)start pays for ``import torch`` before
the round even closes (argv: the preload list and a fd to signal readiness). The order arrives
as one JSON line on stdin:
``{"env": {...}, "argv": [...], "entrypoint": "...", "module": false}``. An unmodified script
runs as it would under ``python script.py`` (``__name__ == "__main__"``, ``sys.argv``, ``sys.path[0]``),
beside the watcher of its round lease, where it has one (``lease_watch.py``).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import runpy
import sys
import traceback

from convoy.agent.round_store import serve_if_asked
from convoy.procs import exit_without_teardown
from convoy.worker.lease_watch import watch_from_child, watch_lease

_AGENT_DIR = os.path.dirname(os.path.abspath(__file__))


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


def preload(modules: str) -> None:
    for name in filter(None, modules.split(",")):
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # the script imports what it needs itself; preloading is only a head start


def keep_process_groups() -> None:
    """Hold a reference to every process group the script creates, so none is freed before exit.

    Freeing a gloo process group joins its worker thread while the GIL is held; that thread may
    need the GIL to free the last work item, and the process hangs (seen in torch 2.13 when DDP
    drops the last reference after ``destroy_process_group()``, often with torch._dynamo
    preloaded). The standby ends with ``exit_without_teardown``, so the groups are never torn down at all.
    """
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    create = getattr(c10d, "_new_process_group_helper", None)
    if create is None:
        return
    kept: list[object] = []

    def create_and_keep(*args: object, **kwargs: object) -> object:
        created = create(*args, **kwargs)
        kept.append(created)
        return created

    c10d._new_process_group_helper = create_and_keep  # type: ignore[union-attr]


def main() -> int:
    modules, ready_fd = sys.argv[1], int(sys.argv[2])
    preload(modules)
    keep_process_groups()
    gc.freeze()  # preloaded objects live for good: later collections and the exit skip them
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
    if order.get("no_python"):  # --no-python: this process becomes the executable (same pid, output, session)
        sys.stdout.flush()
        watch_from_child()  # the program it becomes runs no thread of ours: a child watches its lease
        try:
            os.execvp(sys.argv[0], sys.argv)
        except OSError as exc:
            print(f"convoy: cannot run {sys.argv[0]!r} (--no-python): {exc.strerror}", file=sys.stderr, flush=True)
            return 127
    serve_if_asked()  # rank 0: the round's store (``round_store.py``), bound here
    exit_without_teardown(run_script(str(order["entrypoint"]), bool(order["module"])))


def run_script(entrypoint: str, module: bool) -> int:
    """Run the script as ``python script.py`` would, its lease watched (a process a convoy agent started under a
    round lease stops itself once the lease has expired); return its exit code."""
    watch_lease()
    try:
        if module:
            runpy.run_module(entrypoint, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(entrypoint))
            runpy.run_path(entrypoint, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 (reported as python itself would, exit code 1)
        _print_script_traceback(exc)
        return 1
    return 0


def _print_script_traceback(exc: BaseException) -> None:
    """Print the traceback from the script's own frames on, as ``python script.py`` would."""
    tb = exc.__traceback__
    while tb is not None and (os.path.dirname(os.path.abspath(tb.tb_frame.f_code.co_filename)) == _AGENT_DIR
                              or tb.tb_frame.f_code.co_filename in ("<frozen runpy>", runpy.__file__)):
        tb = tb.tb_next  # the standby's or the fork server's own frames
    traceback.print_exception(type(exc), exc, tb)
    sys.stderr.flush()


if __name__ == "__main__":
    sys.exit(main())
