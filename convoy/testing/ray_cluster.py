"""A real Ray cluster on this machine for tests and benchmarks: a head and raylets started with ``ray start
--block`` (each its own CPUs and custom resources), a node removed by SIGKILL of its raylet, and everything stopped
and reaped at the end, leftovers found by the cluster's own temp dir in their command lines."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from types import TracebackType

import psutil

from convoy.ports import unclaimed_port

START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 3.0
"""How long ``close`` lets the nodes stop themselves: a node that ran jobs' actors took 9 s, all of it past
the point where its daemons had nothing left to do; what is still there then is killed."""


class RayNodeProcess:
    """One ``ray start --block``: its raylet and the node's other daemons are its children."""

    def __init__(self, process: subprocess.Popen[bytes], resources: dict[str, float]) -> None:
        self.process, self.resources = process, resources

    def raylet(self) -> psutil.Process:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            for child in psutil.Process(self.process.pid).children(recursive=True):
                try:
                    if child.name() == "raylet":
                        return child
                except psutil.NoSuchProcess:
                    continue
            if self.process.poll() is not None:
                raise RuntimeError(f"ray start exited with {self.process.returncode}")
            time.sleep(0.1)
        raise TimeoutError("no raylet under ray start")

    def kill(self) -> None:
        """The node is lost: its raylet SIGKILLed (Ray's own ``ray start --block`` then ends the node's rest)."""
        self.raylet().send_signal(signal.SIGKILL)

    def stop(self) -> None:
        """SIGTERM (``ray start --block`` then stops the node's daemons); see ``reap``."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def reap(self, timeout: float) -> None:
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class LocalRayCluster:
    """``with LocalRayCluster() as cluster: cluster.add_node(1, {"a": 1})``: a head (``head_cpus``, its resources)
    on 127.0.0.1 at a free port; ``address`` is what ``--address`` takes."""

    def __init__(self, head_cpus: float = 1, head_resources: dict[str, float] | None = None) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="cvray-", dir="/tmp")  # short: Ray's socket paths live under it
        self.port = unclaimed_port("127.0.0.1")
        self.address = f"127.0.0.1:{self.port}"
        self.nodes: list[RayNodeProcess] = []
        token = os.path.join(self.temp_dir, "auth_token")  # the cluster's own: every daemon and driver shows it
        with open(os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as handle:
            handle.write(secrets.token_hex(32))
        self.driver_env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token}
        """What a driver of this cluster needs in its environment (besides the address)."""
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ADDRESS": "", **self.driver_env}
        self.head = self._start(["--head", "--port", str(self.port), "--temp-dir", self.temp_dir,
                                 "--include-dashboard", "false"], head_cpus, head_resources or {})

    def _start(self, args: list[str], cpus: float, resources: dict[str, float]) -> RayNodeProcess:
        command = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", *args, "--node-ip-address",
                   "127.0.0.1", "--num-cpus", f"{cpus:g}", "--num-gpus", "0", "--disable-usage-stats",
                   "--resources", json.dumps(resources)]
        process = subprocess.Popen(command, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   start_new_session=True)
        node = RayNodeProcess(process, resources)
        node.raylet()
        return node

    def add_node(self, cpus: float = 1, resources: dict[str, float] | None = None) -> RayNodeProcess:
        """A raylet more, returned once the cluster counts it alive."""
        alive = self.alive_nodes()
        node = self._start(["--address", self.address], cpus, resources or {})
        self.nodes.append(node)
        self.wait_nodes(alive + 1)
        return node

    def alive_nodes(self) -> int:
        """Nodes the cluster counts as alive (``ray list``-free: from the GCS through a short driver)."""
        code = "import ray, sys; ray.init(address=sys.argv[1], logging_level=40); " \
               "print(sum(n['Alive'] for n in ray.nodes()))"
        out = subprocess.run([sys.executable, "-c", code, self.address], env=self.env, capture_output=True,
                             text=True, timeout=120, check=True).stdout
        return int(out.strip().splitlines()[-1])

    def wait_nodes(self, count: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.alive_nodes() != count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Ray cluster did not reach {count} alive nodes")
            time.sleep(0.2)

    def close(self) -> None:
        """Every node stopped at once (``STOP_TIMEOUT_S`` for all), then whatever outlived them killed."""
        for node in [*self.nodes, self.head]:
            node.stop()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for node in [*self.nodes, self.head]:
            node.reap(max(0.0, deadline - time.monotonic()))
        for process in psutil.process_iter(["cmdline"]):  # daemons that outlived their ray start
            try:
                if any(self.temp_dir in part for part in process.info["cmdline"] or ()):
                    process.kill()
            except psutil.Error:
                continue
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> LocalRayCluster:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
                 ) -> None:
        self.close()
