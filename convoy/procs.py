"""Process helpers shared by the launcher and the agent (no torch, no third-party imports)."""

from __future__ import annotations

import ctypes
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int) -> None:
    """In a child before exec: get ``sig`` when the parent dies (Linux), so nothing is orphaned."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)


def signal_name(returncode: int) -> str | None:
    """``SIGKILL`` for a return code of -9; None for a normal exit."""
    if returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived; ``exit_code`` is the shell's 128 + signal number."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.exit_code = 128 + signum


def raise_interrupted(signum: int, frame: object) -> None:
    """A signal handler that turns SIGINT/SIGTERM into ``Interrupted`` in the main thread.

    Only the first signal counts: both are ignored from then on, so a second one (a terminal's
    Ctrl-C followed by the launcher's SIGTERM) cannot break the orderly stop the first began.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Interrupted(signum)
