"""Small pure helpers: exit descriptions on the wire, signal names, the wire models' limits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from convoy.config import JobConfig, MasterConfig, WorkerConfig
from convoy.control.protocol.messages import JoinRequest, WaitRequest, WorkerExit
from convoy.launch.schedulers.local import LocalScheduler
from convoy.ports import hold_port, port_taken
from convoy.procs import Interrupted, signal_name


def test_worker_exit_describes_code_signal_and_start_failure() -> None:
    base = {"node_id": "n", "round_id": 1, "rank": 0, "local_rank": 0}
    assert WorkerExit(**base, exitcode=3).describe() == "exited with code 3"
    assert WorkerExit(**base, signal="SIGKILL").describe() == "was killed by SIGKILL"
    assert WorkerExit(**base, start_failed=True, exitcode=1).describe() == "could not be started"


@pytest.mark.parametrize(("code", "name"), [(-9, "SIGKILL"), (-15, "SIGTERM"), (-11, "SIGSEGV"), (0, None), (1, None),
                                            (-200, "signal 200")])
def test_signal_name(code: int, name: str | None) -> None:
    assert signal_name(code) == name


def test_interrupted_exit_codes_follow_the_shell() -> None:
    assert Interrupted(2).exit_code == 130 and str(Interrupted(2)) == "SIGINT"
    assert Interrupted(15).exit_code == 143


@pytest.mark.parametrize("fields", [
    {"node_id": "", "host": "h", "nproc": 1, "port": 1},
    {"node_id": "n", "host": "h", "nproc": 0, "port": 1},
    {"node_id": "n", "host": "h", "nproc": 1, "port": 70000},
])
def test_join_request_limits(fields: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        JoinRequest(**fields)  # type: ignore[arg-type]


def test_long_polls_are_bounded() -> None:
    with pytest.raises(ValidationError):
        WaitRequest(node_id="n", round_id=1, timeout_s=3600)


def test_every_exit_of_a_relaunched_agent_is_reported_once(tmp_path: Path) -> None:
    """Each relaunch replaces the node's Popen; the old one is freed, and its id() may be reused."""
    config = JobConfig(master=MasterConfig(run_dir=tmp_path), workers=WorkerConfig(entrypoint="x.py"))
    scheduler = LocalScheduler(config, tmp_path / "token", 1)
    for attempt in range(30):
        proc = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({attempt % 3})"])
        scheduler.agents["local0"] = proc
        proc.wait()
        del proc
        assert scheduler.newly_exited() == [("local0", attempt % 3)], f"exit {attempt} of the relaunched agent"
        assert scheduler.newly_exited() == [], "an exit is reported once"


def test_a_held_port_cannot_be_bound_by_another_process_until_released() -> None:
    held = hold_port()
    port = held.getsockname()[1]
    taker = subprocess.run([sys.executable, "-c", f"import socket; socket.socket().bind(('', {port}))"],
                           capture_output=True, text=True)
    assert taker.returncode != 0 and "Address already in use" in taker.stderr
    held.close()
    again = subprocess.run([sys.executable, "-c", f"import socket; socket.socket().bind(('', {port}))"])
    assert again.returncode == 0


def test_torchs_bind_failure_reads_as_a_taken_port() -> None:
    torch_line = ("[rank0]: torch.distributed.DistNetworkError: The server socket has failed to listen on any local "
                  "network address. port: 29500, useIpv6: false, code: -98, name: EADDRINUSE, message: address "
                  "already in use")
    assert port_taken(["step 1", torch_line])
    assert port_taken(["OSError: [Errno 98] Address already in use"])
    assert not port_taken(["RuntimeError: injected failure in rank 0", "connection refused"])
