"""A parameter server's shard snapshots (bytes equal after a restore, a torn write never read, the fallbacks to the
previous snapshot and to the persistent save, and the error when there is neither), the worker's unkept pushes,
and a worker that goes on, on real loopback sockets, through a server replaced by a restored one on a new port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from convoy.parallel.ps.client import PSClient
from convoy.parallel.ps.optimizers import OptimizerSpec
from convoy.parallel.ps.placement import DenseSpec, TableSpec, place
from convoy.parallel.ps.resume import ServerLost, Unkept, find_server
from convoy.parallel.ps.server import ParameterServer, shard_of
from convoy.parallel.ps.service import ServerProcess, from_role_env
from convoy.parallel.ps.snapshots import NoShardToRestore, ShardSnapshots
from convoy.parallel.transport import Credentials, Identity, Message
from convoy.worker.role_env import SERVICE_HOST_ENV, SERVICE_SECRET_ENV

ROWS, DIM = 30, 4
JOB = Credentials.fresh(Identity("worker", 0, 0))
AS_PS = JOB.as_process(Identity("ps", 0, 0))


def placement(servers: int = 1):
    return place([DenseSpec("w", (5, 3))], [TableSpec("emb", ROWS, DIM)], servers)


def whole_model() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return {"w": torch.randn(5, 3, generator=gen)}, {"emb": torch.randn(ROWS, DIM, generator=gen)}


def new_server() -> ParameterServer:
    dense, tables = whole_model()
    mine, rows = shard_of(placement(), 0, dense, tables)
    return ParameterServer(0, placement(), OptimizerSpec("adam", 0.01), mine, rows)


def push(server: ParameterServer, step: int, worker: str = "w0") -> None:
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(0, ROWS, (6,), generator=gen)
    server.push(worker, {"w": torch.randn(5, 3, generator=gen)}, {"emb": (ids, torch.randn(6, DIM, generator=gen))})


def flat_bytes(state: object) -> list[bytes]:
    """Every tensor of a nested state, as raw bytes, in a fixed order; other leaves as their repr."""
    if isinstance(state, torch.Tensor):
        return [state.contiguous().view(torch.uint8).numpy().tobytes()]
    if isinstance(state, dict):
        return [b for key in sorted(state) for b in [repr(key).encode(), *flat_bytes(state[key])]]
    return [repr(state).encode()]


def test_a_restored_shard_equals_the_snapshot_byte_for_byte(tmp_path: Path) -> None:
    server, snapshots = new_server(), ShardSnapshots(tmp_path / "seg", tmp_path / "ckpt")
    for step in range(3):
        push(server, step)
    push(server, 9, worker="w1")
    assert snapshots.take(server) == 4 and snapshots.kept == {"w0": 3, "w1": 1}
    taken = server.state_dict()
    push(server, 10)  # after the snapshot: not in it
    restored = ShardSnapshots(tmp_path / "seg", tmp_path / "ckpt").restore()
    assert restored.source == "in-memory snapshot"
    assert restored.server.version == 4 and restored.server.applied == {"w0": 3, "w1": 1}
    assert flat_bytes(restored.server.state_dict()) == flat_bytes(taken)


def test_a_torn_snapshot_is_never_read_and_the_previous_one_is(tmp_path: Path) -> None:
    server, snapshots = new_server(), ShardSnapshots(tmp_path / "seg")
    push(server, 0)
    snapshots.take(server)
    push(server, 1)
    snapshots.take(server)
    second = server.state_dict()
    push(server, 2)
    # a kill mid-write: the slot being written (the older one) is marked invalid first, then part of it is written
    file = snapshots.file
    index = file.begin(99)
    file.write_tensors(index, [torch.full((64,), 7.0)], [0])
    restored = ShardSnapshots(tmp_path / "seg").restore()
    assert restored.server.version == 2
    assert flat_bytes(restored.server.state_dict()) == flat_bytes(second)


def test_a_corrupt_newest_snapshot_falls_back_to_the_previous_one_and_says_so(tmp_path: Path) -> None:
    server, snapshots = new_server(), ShardSnapshots(tmp_path / "seg")
    push(server, 0)
    snapshots.take(server)
    first = server.state_dict()
    push(server, 1)
    snapshots.take(server)
    file = snapshots.file
    newest = max(range(2), key=lambda i: file.slots()[i][0])
    _, _, data_len, meta_len, _ = file.slots()[newest]
    start = 4096 + newest * file.slot_size + data_len
    assert file._mm is not None
    file._mm[start + meta_len // 2] ^= 0xFF  # the skeleton overwritten: its checksum fails
    said: list[str] = []
    restored = ShardSnapshots(tmp_path / "seg").restore(said.append)
    assert restored.server.version == 1 and flat_bytes(restored.server.state_dict()) == flat_bytes(first)
    assert said and "fails its checksum" in said[0]


def test_without_a_segment_the_persistent_save_is_used_and_without_either_a_clear_error(tmp_path: Path) -> None:
    server, snapshots = new_server(), ShardSnapshots(tmp_path / "seg", tmp_path / "ckpt")
    push(server, 0)
    assert snapshots.save(server) == tmp_path / "ckpt" / "shard.pt"
    restored = ShardSnapshots(tmp_path / "other-seg", tmp_path / "ckpt").restore()
    assert restored.source == "persistent save" and restored.server.version == 1
    lost = ShardSnapshots(tmp_path / "lost-seg", tmp_path / "lost")
    lost.take(new_server())  # set up, then its segment gone (its node lost) and no persistent save
    lost.close()
    (tmp_path / "lost-seg").unlink()
    with pytest.raises(NoShardToRestore, match=r"no in-memory snapshot in .*nor-seg nor a persistent save at "
                                               r".*lost/shard.pt; the shard is lost"):
        ShardSnapshots(tmp_path / "nor-seg", tmp_path / "lost").restore()
    assert ShardSnapshots(tmp_path / "nor-seg", tmp_path / "nothing").restore() is None, \
        "a rank never set up has nothing to take back: it starts empty"


def test_a_ps_of_a_job_restores_when_told_starts_empty_if_never_set_up_and_else_fails_clearly_without_a_shard(tmp_path: Path) -> None:
    env = {"CONVOY_ROLE_PORT": "0", "CONVOY_JOB_ID": f"test-{tmp_path.name}", "CONVOY_RUN_DIR": str(tmp_path),
           "ROLE_NAME": "ps", "ROLE_RANK": "3", "ROLE_WORLD_SIZE": "4", "CONVOY_ROLE_RESTORE": "1",
           SERVICE_HOST_ENV: "127.0.0.1", SERVICE_SECRET_ENV: JOB.secret.hex()}
    said: list[str] = []
    never_set_up = from_role_env(env, say=said.append)
    try:
        assert never_set_up.server is None and never_set_up.restored is None
        assert said == ["this parameter server was never set up (restarted before its chief's setup reached it): it "
                        "starts empty, and the chief sets it up"]
    finally:
        never_set_up.listener.close()
    (tmp_path / "checkpoints" / "ps3").mkdir(parents=True)
    (tmp_path / "checkpoints" / "ps3" / "set-up").touch()
    with pytest.raises(NoShardToRestore, match="ps3"):
        from_role_env(env)
    with pytest.raises(Exception, match="CONVOY_JOB_ID, CONVOY_ROLE_HOST not set"):
        from_role_env({"CONVOY_ROLE_PORT": "0", "CONVOY_RUN_DIR": str(tmp_path)})


def test_unkept_pushes_are_resent_renumbered_and_the_ones_not_held_counted_lost() -> None:
    unkept = Unkept()
    for number in range(1, 8):
        unkept.add(number, Message("push", {"n": number}))
    unkept.trim(3)  # the server's snapshot holds the first 3
    assert len(unkept) == 4
    resend, lost = unkept.resume(applied=3, pushed=7)
    assert [m.meta["n"] for m in resend] == [4, 5, 6, 7] and lost == 0
    resend, lost = unkept.resume(applied=1, pushed=7)  # came back from an older save: pushes 2 and 3 are gone
    assert [m.meta["n"] for m in resend] == [4, 5, 6, 7] and lost == 2
    assert [n for n, _ in unkept.entries] == [2, 3, 4, 5], "numbered as the restored server will count them"


def test_a_worker_goes_on_through_a_killed_server_restored_on_a_new_port(tmp_path: Path) -> None:
    dense, tables = whole_model()
    layout = placement(2)
    segments = [ShardSnapshots(tmp_path / f"seg{s}", tmp_path / f"ckpt{s}") for s in range(2)]
    servers = [ServerProcess(snapshots=segments[s], credentials=AS_PS) for s in range(2)]
    published = [server.address for server in servers]
    client = PSClient(layout, list(published), "w0", staleness=0, follow=lambda: published, follow_s=10,
                      credentials=JOB)
    client.setup(OptimizerSpec("sgd", 0.1), dense, tables)
    ids = {"emb": torch.arange(ROWS)}
    steps = 0

    def train(count: int) -> None:
        nonlocal steps
        for _ in range(count):
            pulled = client.pull(ids)
            client.push({"w": torch.ones(5, 3)}, {"emb": (pulled.ids["emb"], torch.ones(ROWS, DIM))})
            steps += 1

    train(4)
    client.flush()  # pushes are sent on their own connection: let all 4 land before the snapshot is asked for
    client.snapshot()
    train(3)  # three pushes server 1 has applied but not kept
    client.flush()
    servers[1].listener.close()  # the server dies: its connections drop
    published[1] = ""
    with pytest.raises(ServerLost, match=r"parameter server 1 \(last at .*\) went away"):
        find_server(lambda: published, 1, "w0", servers[1].address, JOB, timeout=0.3)
    again = ServerProcess(snapshots=ShardSnapshots(tmp_path / "seg1", tmp_path / "ckpt1"), restore=True,
                          credentials=AS_PS)
    assert again.restored is not None and again.restored.server.applied == {"w0": 4}
    published[1] = again.address
    train(2)
    client.flush()
    assert client.applied() == [steps, steps] and client.resent == [0, 3] and client.lost == [0, 0]
    assert client.moves == [(1, servers[1].address, again.address)]
    pulled = client.pull(ids)
    assert torch.allclose(pulled.dense["w"], dense["w"] - 0.1 * steps), "every push applied exactly once"
    assert torch.allclose(pulled.rows["emb"], tables["emb"] - 0.1 * steps)
    client.shutdown_servers()
    client.close()
    for server in (servers[0], again):
        assert server.wait(10)


SNAPSHOT_FOREVER = """
import sys, torch
from pathlib import Path
from convoy.parallel.ps.optimizers import OptimizerSpec
from convoy.parallel.ps.placement import DenseSpec, TableSpec, place
from convoy.parallel.ps.server import ParameterServer
from convoy.parallel.ps.snapshots import ShardSnapshots
layout = place([DenseSpec("w", (1 << 20,))], [TableSpec("emb", 4, 2)], 1)
server = ParameterServer(0, layout, OptimizerSpec("sgd", 1.0), {"w": torch.zeros(1 << 20)}, {"emb": torch.zeros(4, 2)})
snapshots = ShardSnapshots(Path(sys.argv[1]))
while True:
    server.push("w0", {"w": -torch.ones(1 << 20)}, {})
    print(snapshots.take(server), flush=True)
"""


@pytest.mark.slow
def test_a_server_killed_while_it_snapshots_leaves_a_whole_shard_of_one_version(tmp_path: Path) -> None:
    segment = tmp_path / "seg"
    child = subprocess.Popen([sys.executable, "-c", SNAPSHOT_FOREVER, str(segment)], stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    try:
        assert child.stdout is not None
        for line in child.stdout:
            if int(line) >= 20:
                break
        os.kill(child.pid, signal.SIGKILL)  # most likely in the middle of a 4 MiB copy
    finally:
        child.kill()
        child.wait()
    restored = ShardSnapshots(segment).restore()
    version = restored.server.version
    assert version >= 20 and restored.server.applied == {"w0": version}
    assert torch.equal(restored.server.dense["w"], torch.full((1 << 20,), float(version))), \
        "every value of the shard is of the snapshot's version: no torn write was read"


def test_a_stale_address_taken_by_another_listener_does_not_hold_up_the_wait(tmp_path: Path) -> None:
    server = ServerProcess(snapshots=ShardSnapshots(tmp_path / "seg"), credentials=AS_PS)
    dense, tables = whole_model()
    client = PSClient(placement(), [server.address], "w0", credentials=JOB)
    client.setup(OptimizerSpec("sgd", 0.1), dense, tables)
    client.close()
    with socket.create_server(("127.0.0.1", 0)) as taker:  # accepts (its backlog) and never answers
        published = [f"127.0.0.1:{taker.getsockname()[1]}"]
        looks: list[str] = []

        def follow() -> list[str]:
            looks.append(published[0])
            if len(looks) == 2:
                published[0] = server.address  # the master publishes the server's new address
            return list(published)

        started = time.monotonic()
        found = find_server(follow, 0, "w0", published[0], JOB, timeout=20)
        assert found.address == server.address and time.monotonic() - started < 10
        assert looks[0] != server.address
        found.connection.close()
    server.listener.close()
