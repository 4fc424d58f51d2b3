"""The parameter-server example's worker when its server's address changes before it could connect: a server
started again (on another node, or down while the worker starts, its address then empty) is found at the address
the agent publishes now. The worker kept the address it started with for a minute, failed, and spent a restart
of its role (seen in benchmarks/ps.py --only role_faults, a fork server SIGSTOPped: a worker forked while the
servers started again had an empty address). Real processes and sockets: a worker process of the example, a
parameter server on the role-service transport, and the agent's addresses file, written as an agent does."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers import REPO, wait_for

from convoy.parallel.ps.service import ServerProcess
from convoy.parallel.transport import Credentials, Identity
from convoy.worker.role_env import ADDRESSES_ENV, ADDRESSES_FILE_ENV, SERVICE_SECRET_ENV, write_addresses

pytestmark = pytest.mark.slow
EXAMPLE = REPO / "examples" / "train_ps.py"
WORKER = """
import importlib.util, sys
from convoy.parallel.ps.placement import DenseSpec, place
spec = importlib.util.spec_from_file_location("train_ps_example", sys.argv[1])
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)
client = example.connect(place([DenseSpec("w", (4,))], [], 1), 0, 4)
print("connected to the parameter server with pid", client.server_pids()[0], flush=True)
client.close()
"""


class StaleAddress:
    """A port where the server used to be: whatever listens there now accepts a connection and closes it at once
    (it is no parameter server); ``tried`` is set by the first caller."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.tried = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.tried.set()
            conn.close()


def test_a_worker_follows_its_server_to_the_address_published_after_it_started(tmp_path: Path) -> None:
    credentials = Credentials.fresh(Identity("ps", 0, 0))
    server = ServerProcess("127.0.0.1", 0, credentials=credentials, run_dir=tmp_path)
    stale = StaleAddress()
    published = tmp_path / "addresses.json"
    write_addresses(published, 1, {"ps": [stale.address], "worker": [""]})
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "ROLE_NAME": "worker", "ROLE_RANK": "0",
           "ROLE_WORLD_SIZE": "1", ADDRESSES_ENV: f'{{"ps": ["{stale.address}"]}}',
           ADDRESSES_FILE_ENV: str(published), SERVICE_SECRET_ENV: credentials.secret.hex()}
    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(EXAMPLE)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(stale.tried.is_set, 60, "the worker to try the address it started with")
        write_addresses(published, 2, {"ps": [server.address], "worker": [""]})  # the server is up again, elsewhere
        out, _ = worker.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        worker.kill()
        out, _ = worker.communicate()
        pytest.fail(f"the worker kept the address it started with for 30 s after its server was published "
                    f"elsewhere: {out[-500:]}")
    finally:
        stale.sock.close()
        server.listener.close()
    assert worker.returncode == 0, out
    assert "connected to the parameter server with pid" in out, out
