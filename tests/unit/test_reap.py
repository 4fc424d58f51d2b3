"""convoy.agent.reap: a node's leftovers found by cgroup and by environment, and killed."""

from __future__ import annotations

import os
import subprocess
import time
import uuid

import pytest

from convoy.agent.reap import NodeCgroup, reap, tagged_processes

RUN = uuid.uuid4().hex[:8]
JOB1, JOB2, JOB3 = f"reap1{RUN}", f"reap2{RUN}", f"reap3{RUN}"
"""Job ids of this run alone: a scan of /proc sees every process of the machine, another test run's too."""


def _sleeper(env: dict[str, str], new_session: bool = False) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "60"], env={**os.environ, **env}, start_new_session=new_session)


def test_processes_with_the_node_environment_are_found_and_killed() -> None:
    mine = _sleeper({"CONVOY_JOB_ID": JOB1, "CONVOY_NODE_ID": "n0"}, new_session=True)
    other_node = _sleeper({"CONVOY_JOB_ID": JOB1, "CONVOY_NODE_ID": "n1"})
    other_job = _sleeper({"CONVOY_JOB_ID": JOB2, "CONVOY_NODE_ID": "n0"})
    try:
        assert tagged_processes(JOB1, "n0") == [mine.pid]
        assert reap(JOB1, "n0") == 1
        assert mine.wait(5) == -9
        assert other_node.poll() is None and other_job.poll() is None, "only that job's node is reaped"
    finally:
        for proc in (mine, other_node, other_job):
            proc.kill()
            proc.wait()


def test_a_node_cgroup_holds_what_its_members_start_and_is_removed() -> None:
    cgroup = NodeCgroup.create(JOB3, "n0")
    if cgroup is None:
        pytest.skip("no writable cgroup hierarchy here (the /proc scan still reaps)")
    parent = subprocess.Popen(["sh", "-c", "read go; sleep 60 & echo $!; wait"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
    try:
        assert cgroup.add(parent.pid)
        assert parent.stdin is not None and parent.stdout is not None
        parent.stdin.write(b"go\n")
        parent.stdin.flush()
        child = int(parent.stdout.readline())
        deadline = time.monotonic() + 5
        while child not in cgroup.pids() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(cgroup.pids()) == sorted([parent.pid, child]), "a member's children stay in its cgroup"
        assert reap(JOB3, "n0") == 2
        assert parent.wait(5) == -9
        assert not cgroup.path.exists()
    finally:
        parent.kill()
        parent.wait()
        if cgroup.path.exists():
            cgroup.remove()
