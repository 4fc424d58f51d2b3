"""Helpers for tests that start real convoy processes: launch, wait, find what is left running.

Every process a test starts gets ``CONVOY_TEST_TAG=<unique>`` in its environment. Agents,
standbys, workers and their children inherit it, so ``ProcessScope.leftovers()`` finds
exactly this test's processes (and any whose command line names this test's tmp dir),
even after they were orphaned and re-parented.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
TAG_VAR = "CONVOY_TEST_TAG"
CONVOY = [sys.executable, "-m", "convoy"]
CONSOLE_SCRIPT = Path(sys.executable).parent / "convoy"
JOB_TIMEOUT_S = 90.0
"""Upper bound for any one convoy command; far above what a job here needs (seconds)."""


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.05) -> object:
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def gone(pid: int) -> bool:
    """The process has exited (or is a zombie waiting for its parent to reap it)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def node_of(pid: int) -> str:
    """The node a role process runs on: its agent tags it (and its fork server, whose environment is what
    ``/proc`` shows of a forked process's) with CONVOY_NODE_ID."""
    return psutil.Process(pid).environ()["CONVOY_NODE_ID"]


def agent_of(pid: int) -> psutil.Process:
    """The agent of role process ``pid``: found by its job and node, not by parentage (a local job's role
    processes are forked by a fork server the launcher started for the agent)."""
    env = psutil.Process(pid).environ()
    for proc in psutil.process_iter(["cmdline"]):
        command = proc.info["cmdline"] or []
        if "agent" in command and "--node-id" in command and "--job-id" in command \
                and command[command.index("--node-id") + 1] == env["CONVOY_NODE_ID"] \
                and command[command.index("--job-id") + 1] == env["CONVOY_JOB_ID"]:
            return proc
    raise AssertionError(f"no agent of node {env['CONVOY_NODE_ID']} of job {env['CONVOY_JOB_ID']}")


def read_pid(path: Path) -> int:
    return int(path.read_text().strip())


def records(record_dir: Path, round_id: int) -> dict[int, dict]:
    """What the fixture worker recorded in one round (env, argv, pid, cwd), by rank."""
    found = {}
    for path in record_dir.glob(f"rank*.round{round_id}.json"):
        record = json.loads(path.read_text())
        found[int(record["env"]["RANK"])] = record
    return found


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def explain(self) -> str:
        return f"exit code {self.returncode}\n--- stdout ---\n{self.stdout}\n--- stderr ---\n{self.stderr}"


class Launched:
    """One started command; output goes to files so nothing can block on a full pipe."""

    def __init__(self, proc: subprocess.Popen[bytes], out: Path, err: Path, scope: ProcessScope) -> None:
        self.proc, self.out_path, self.err_path, self.scope = proc, out, err, scope
        self.descendants: dict[int, float] = {}

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def wait_output(self, pattern: str, timeout: float = JOB_TIMEOUT_S) -> re.Match[str]:
        """Wait until stdout matches ``pattern`` (a regex); fail if the process ends first."""
        def found() -> re.Match[str] | None:
            match = re.search(pattern, self.stdout(), re.MULTILINE)
            if match is None and self.proc.poll() is not None:
                match = re.search(pattern, self.stdout(), re.MULTILINE)
                if match is None:
                    pytest.fail(f"process ended before printing {pattern!r}:\n{self.result().explain()}")
            return match

        return wait_for(found, timeout, f"output matching {pattern!r}")  # type: ignore[return-value]

    def wait(self, timeout: float = JOB_TIMEOUT_S) -> Result:
        """Wait for the exit; on timeout kill this test's processes and fail with the output."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.scope.kill_all()
            pytest.fail(f"{self.proc.args!r} did not exit within {timeout:.0f} s:\n{self.result().explain()}")
        return self.result()

    def result(self) -> Result:
        return Result(self.proc.returncode if self.proc.returncode is not None else -999, self.stdout(), self.stderr())


class ProcessScope:
    """The processes of one test: tagged environment, output files, leftover search, cleanup."""

    def __init__(self, tmp_path: Path) -> None:
        self.tag = uuid.uuid4().hex
        self.tmp_path = tmp_path
        self.launched: list[Launched] = []

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The test's environment: tagged, and with a CPU pool of its own (no claim of another test or job)."""
        env = dict(os.environ)
        env[TAG_VAR] = self.tag
        env["CONVOY_POOL"], env["CONVOY_POOL_CPUS"] = str(self.tmp_path / "cpu-pool.db"), "2"
        env.update(extra or {})
        return env

    def start(self, args: Sequence[str], command: Sequence[str] = CONVOY, cwd: Path | None = None,
              env: dict[str, str] | None = None) -> Launched:
        """Start ``command + args`` in its own session (so a test can signal its whole group)."""
        index = len(self.launched)
        out, err = self.tmp_path / f"cmd{index}.out", self.tmp_path / f"cmd{index}.err"
        with open(out, "wb") as out_file, open(err, "wb") as err_file:
            proc = subprocess.Popen(
                [*command, *map(str, args)], stdin=subprocess.DEVNULL, stdout=out_file, stderr=err_file,
                cwd=cwd or self.tmp_path, env=self.env(env), start_new_session=True,
                preexec_fn=as_a_terminal_starts_it,
            )
        launched = Launched(proc, out, err, self)
        self.launched.append(launched)
        return launched

    def run(self, args: Sequence[str], timeout: float = JOB_TIMEOUT_S, **kwargs: object) -> Result:
        return self.start(args, **kwargs).wait(timeout)  # type: ignore[arg-type]

    def gloo_ranks(self, script: str, world_size: int, args: Sequence[object], env: dict[str, str] | None = None,
                   timeout: float = JOB_TIMEOUT_S * 2) -> list[str]:
        """Run ``script`` as ``world_size`` ranks of one gloo job on loopback (torchrun's variables,
        one node); fail the test unless every rank exits 0. Returns each rank's stdout."""
        from convoy.ports import unclaimed_port

        port = str(unclaimed_port())
        launched = [self.start(args, command=[sys.executable, script], env={
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1", **(env or {})}) for rank in range(world_size)]
        results = [rank.wait(timeout) for rank in launched]
        for rank, result in enumerate(results):
            assert result.returncode == 0, f"rank {rank}: {result.explain()}"
        return [result.stdout for result in results]

    def leftovers(self) -> list[psutil.Process]:
        """Live (non-zombie) processes started by this test, found by env tag or tmp dir in argv."""
        marker = str(self.tmp_path)
        found = []
        for proc in psutil.process_iter():
            if proc.pid == os.getpid():
                continue
            try:
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                if proc.environ().get(TAG_VAR) == self.tag or any(marker in part for part in proc.cmdline()):
                    found.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return found

    def wait_no_leftovers(self, timeout: float = 10.0, pids: Sequence[int] = ()) -> list[str]:
        """Wait until none of this test's processes runs, and each of ``pids`` has exited; return descriptions
        of any still there. Name the pids the test knows: a process part-way through its exit has no readable
        command line or environment any more, so the search by tag alone can miss it while it still runs."""
        deadline = time.monotonic() + timeout
        while True:
            left = self.leftovers() + [proc for proc in map(_running, pids) if proc is not None]
            if not left or time.monotonic() > deadline:
                return [_describe(p) for p in left]
            time.sleep(0.1)

    def kill_all(self) -> None:
        """SIGKILL every group this test started and every tagged process (teardown)."""
        for launched in self.launched:
            if launched.proc.poll() is None:
                try:
                    os.killpg(launched.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for proc in self.leftovers():
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        for launched in self.launched:
            try:
                launched.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass


def as_a_terminal_starts_it() -> None:
    """In a child before exec: the signals a command may be asked to stop by at their defaults, as a terminal's
    foreground command has them, whatever the test runner inherited (a shell without job control, a CI's among
    them, starts a background command with SIGINT and SIGQUIT ignored, so a Python program started so never sees
    a Ctrl-C; ``nohup`` ignores SIGHUP). A test that wants one ignored ignores it in its own command."""
    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)


def _running(pid: int) -> psutil.Process | None:
    """The process ``pid`` while it has not exited (a zombie has); None once it has."""
    try:
        proc = psutil.Process(pid)
        return None if proc.status() == psutil.STATUS_ZOMBIE else proc
    except psutil.NoSuchProcess:
        return None


def _describe(proc: psutil.Process) -> str:
    try:
        return f"pid {proc.pid} ppid {proc.ppid()}: {' '.join(proc.cmdline())}"
    except psutil.Error:
        return f"pid {proc.pid} (gone)"


def one_error_line(result: Result) -> str:
    """The single stderr line of a usage error; fails unless there is exactly one."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.explain()
    assert len(lines) == 1, f"expected one line on stderr:\n{result.explain()}"
    assert lines[0].startswith("convoy: error: "), result.explain()
    return lines[0]


def fixture(name: str) -> str:
    return str(FIXTURES / name)


def known_bug(reason: str) -> pytest.MarkDecorator:
    """A test that is right and fails because of a convoy bug: it turns red (XPASS, strict) once fixed,
    so whoever fixes the bug removes the marker."""
    return pytest.mark.xfail(strict=True, reason=f"convoy bug: {reason}")
