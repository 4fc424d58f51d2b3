"""SIGTERM to a worker whose snapshot copy is in flight: the copy lands, then the worker exits 143, even with its
main thread blocked in C (as in a collective); a script's own SIGTERM handler is left alone. Real processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import os, signal, socket, sys, time
    from pathlib import Path
    from convoy.runtime.checkpoint_state import BackgroundCopy
    from convoy.runtime.stop_copy import ExitAfterCopy

    mode, out = sys.argv[1], Path(sys.argv[2])
    if mode == "own":
        signal.signal(signal.SIGTERM, lambda *_: (out.write_text("own handler"), os._exit(7)))
    copies = BackgroundCopy()
    installed = ExitAfterCopy.install(copies)
    if mode != "idle":
        copies.start(lambda: (time.sleep(0.6), out.write_text("landed")), "convoy-snapshot")
    print("installed" if installed else "left alone", flush=True)
    left, right = socket.socketpair()
    left.recv(1)  # the main thread blocks in C until the process ends
""")


def stopped(tmp_path: Path, mode: str) -> tuple[int, str, str, float]:
    out = tmp_path / "out.txt"
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, mode, str(out)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    said = proc.stdout.readline().strip()
    began = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=10)
    finally:
        proc.kill()
    return code, said, out.read_text() if out.exists() else "", time.monotonic() - began


def test_sigterm_lets_the_copy_in_flight_land_then_exits_143(tmp_path: Path) -> None:
    code, said, wrote, _ = stopped(tmp_path, "copying")
    assert said == "installed" and code == 128 + signal.SIGTERM and wrote == "landed"


def test_sigterm_with_no_copy_in_flight_exits_at_once(tmp_path: Path) -> None:
    code, said, _, took = stopped(tmp_path, "idle")
    assert said == "installed" and code == 128 + signal.SIGTERM
    assert took < 2.0, "nothing to wait for: the exit is immediate"


def test_a_scripts_own_sigterm_handler_is_left_alone(tmp_path: Path) -> None:
    code, said, wrote, _ = stopped(tmp_path, "own")
    assert said == "left alone" and code == 7 and wrote == "own handler"


def test_settle_from_another_thread_never_meets_a_copy_not_yet_started() -> None:
    """The SIGTERM watcher settles the copies from its own thread while the training thread starts the next one:
    it sees the last started copy or none, never a thread it cannot join (a race once seen in an RL learner)."""
    import threading

    from convoy.runtime.checkpoint_state import BackgroundCopy

    copies, errors, done = BackgroundCopy(), [], threading.Event()

    def settle_often() -> None:
        while not done.is_set():
            try:
                copies.settle(0.01)
            except RuntimeError as exc:
                errors.append(exc)

    watcher = threading.Thread(target=settle_often)
    watcher.start()
    for _ in range(3000):
        copies.start(lambda: None, "convoy-snapshot")
        copies.wait()
    done.set()
    watcher.join()
    assert errors == []
