"""The default node id of ``convoy agent``: HOST-SLOT, the lowest slot no live agent of the run dir holds, so an
agent started again on the same host (after a SIGKILL, too) gets its predecessor's id."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from convoy.agent.agent_config import default_node_id

HOLD = "import sys, time; from convoy.agent.agent_config import default_node_id as d; print(d(sys.argv[1]), " \
       "flush=True); time.sleep(60)"


def holder(run_dir: Path) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def test_slots_are_taken_lowest_first_and_come_back_when_their_holder_dies(tmp_path: Path) -> None:
    host = socket.gethostname()
    first, first_id = holder(tmp_path)
    second, second_id = holder(tmp_path)
    try:
        assert (first_id, second_id) == (f"{host}-0", f"{host}-1")
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        again, again_id = holder(tmp_path)
        again.kill()
        assert again_id == f"{host}-0", "the relaunched agent takes the slot of the one that died"
    finally:
        for proc in (first, second):
            proc.kill()
            proc.wait(10)
    time.sleep(0.1)
    assert default_node_id(tmp_path) == f"{host}-0"
