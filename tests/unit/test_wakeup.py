"""Wakeup: threading.Event's meaning, and a wait that a raising signal handler cannot leave half done."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from convoy.procs import Wakeup

REPO = Path(__file__).resolve().parents[2]


def test_a_set_wakes_a_waiter_in_another_thread_at_once() -> None:
    with Wakeup() as wake:
        timer = threading.Timer(0.05, wake.set)
        began = time.monotonic()
        timer.start()
        assert wake.wait(10.0)
        assert time.monotonic() - began < 5.0
        timer.join()


def test_it_stays_set_until_cleared_and_a_cleared_one_waits_its_timeout() -> None:
    with Wakeup() as wake:
        assert not wake.is_set()
        wake.set()
        assert wake.wait(0) and wake.wait(0.01) and wake.is_set()
        wake.clear()
        began = time.monotonic()
        assert not wake.wait(0.1)
        assert time.monotonic() - began >= 0.1  # no byte left behind by the set wakes it early


def test_sets_without_a_wait_never_block_the_setter() -> None:
    with Wakeup() as wake:
        for _ in range(200_000):  # far more than a pipe holds: a set of a set one writes nothing
            wake.set()
            wake._set = False  # as if a clear had run between the sets, so each one writes
        wake.set()
        assert wake.wait(0)


def test_a_set_after_close_is_harmless() -> None:
    wake = Wakeup()
    wake.close()
    wake.set()
    assert wake.is_set()


CHILD = textwrap.dedent("""
    import signal, sys, threading, time
    from convoy.procs import Wakeup

    class Stop(Exception):
        pass

    armed = False

    def handler(signum, frame):
        global armed
        if armed:  # as procs.raise_interrupted: one raise, then nothing until the loop arms it again
            armed = False
            raise Stop()

    signal.signal(signal.SIGUSR1, handler)
    wake = Wakeup()

    def setter():
        while True:
            wake.set()
            time.sleep(0.0002)

    threading.Thread(target=setter, daemon=True).start()
    print("ready", flush=True)
    caught = 0
    end = time.monotonic() + float(sys.argv[1])
    while time.monotonic() < end:
        try:
            armed = True
            wake.wait(0.001)
            wake.clear()
            armed = False
        except Stop:
            caught += 1
    wake.clear()
    assert wake.wait(5.0)  # the setter still wakes it
    print(f"caught {caught}", flush=True)
""")


def test_a_raising_signal_handler_in_a_waiting_main_thread_leaves_it_working() -> None:
    """The main thread waits and clears in a loop while another thread sets, and signals raise in it thousands of
    times: each lands as the handler's exception, never as another error (threading.Event's wait could end in
    "release unlocked lock"), and the loop goes on to its end."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        sent = 0
        while child.poll() is None and sent < 3000:
            os.kill(child.pid, signal.SIGUSR1)
            sent += 1
            if sent % 100 == 0:
                time.sleep(0.01)  # the child's loop runs between the bursts
        out, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 0, err
    caught = int(out.split()[-1])
    assert caught > 10, (out, err)  # signals sent while one is pending merge into it: fewer land than were sent
    assert err == ""
