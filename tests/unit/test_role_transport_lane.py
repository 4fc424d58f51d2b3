"""The shared-memory lane of the role transport: a caller on the service's host sends and receives its tensors
through one /dev/shm segment (only headers on the socket), the segment's name is gone from /dev/shm once both sides
have it mapped, it grows to the largest message, and a hostile caller's lane (a path outside /dev/shm, a link, the
wrong token or size, entries outside the lane) is refused with the reason while the service serves on."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from convoy.parallel.transport import BadMessage, Connection, Credentials, Identity, Listener, Message
from convoy.parallel.transport.lane import ALIGN, LANE_META, OPEN, OPENED, REFUSED, TOKEN_BYTES, Lane
from convoy.parallel.transport.wire import recv_message, send_message
from convoy.shm import SHM_DIR

JOB = Credentials.fresh()
ME = JOB.as_process(Identity("actor", 0, 1))


def lanes_named() -> set[str]:
    return {path.name for path in SHM_DIR.glob("convoy-*lane-*")}


@pytest.fixture
def service() -> Iterator[Listener]:
    def doubled(message: Message, caller: Identity) -> Message:
        return Message("doubled", {"op": message.op, "seen": sorted(message.tensors), **message.meta},
                       {name: doubled_tensor(t) for name, t in message.tensors.items()})

    listener = Listener(doubled, credentials=JOB)
    yield listener
    listener.close()


def doubled_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return ~tensor if tensor.dtype == torch.bool else tensor * 2


def tensors() -> dict[str, torch.Tensor]:
    return {"obs": torch.randn(64, 4), "action": torch.randint(2, (64,)), "done": torch.zeros(64, dtype=torch.bool),
            "half": torch.randn(3, 5).to(torch.bfloat16), "empty": torch.zeros(0, 7)}


def test_a_lane_carries_request_and_reply_tensors_and_leaves_no_name_in_dev_shm(service: Listener) -> None:
    before = lanes_named()
    conn = Connection(service.address, credentials=ME, lane_bytes=1 << 16)
    sent = tensors()
    for _ in range(3):
        reply = conn.request(Message("step", {"n": 1}, sent))
        assert reply.meta["seen"] == sorted(sent) and reply.meta["n"] == 1 and LANE_META not in reply.meta
        for name, tensor in sent.items():
            back = reply.tensors[name]
            assert back.dtype == tensor.dtype and torch.equal(back, doubled_tensor(tensor)), name
    assert conn.lane is not None and conn.lane_why == ""
    assert conn.laned == 6, "each request and each reply went through the lane"
    assert lanes_named() == before, "the segment's name is unlinked once both sides have it mapped"
    conn.close()


def test_a_reply_too_large_for_the_lane_comes_on_the_socket_and_the_lane_grows_for_the_next(
        service: Listener) -> None:
    conn = Connection(service.address, credentials=ME, lane_bytes=4096)
    conn.request(Message("small", {}, {"x": torch.ones(4)}))
    assert conn.lane is not None and conn.lane.size == 4096
    frames = torch.randint(0, 255, (32, 4, 84, 84), dtype=torch.uint8)  # 900 KB: an Atari batch
    reply = conn.request(Message("frames", {}, {"frames": frames}))
    assert torch.equal(reply.tensors["frames"], frames * 2)
    assert conn.lane.size == 1 << 20, "grown to the power of two that holds the request"
    before = conn.laned
    conn.request(Message("frames", {}, {"frames": frames}))
    assert conn.laned == before + 2
    conn.close()


def test_without_a_lane_asked_for_tensors_ride_the_socket(service: Listener) -> None:
    conn = Connection(service.address, credentials=ME)
    reply = conn.request(Message("step", {}, {"x": torch.arange(5.0)}))
    assert torch.equal(reply.tensors["x"], torch.arange(5.0) * 2)
    assert conn.lane is None and conn.laned == 0
    conn.close()


def open_raw(conn: Connection, meta: dict[str, object]) -> Message:
    send_message(conn.sock, Message(OPEN, meta))
    return recv_message(conn.sock, conn.limits)


def test_a_lane_the_service_cannot_trust_is_refused_with_why_and_the_connection_serves_on(
        service: Listener, tmp_path: Path) -> None:
    conn = Connection(service.address, credentials=ME)
    lane, path, token = Lane.create(8192)
    try:
        elsewhere = tmp_path / path.name
        elsewhere.write_bytes(b"\0" * 8192)
        link = SHM_DIR / f"convoy-lane-{secrets.token_hex(16)}"
        link.symlink_to(path)
        cases = {
            "outside /dev/shm": ({"path": str(elsewhere), "bytes": 8192, "token": token.hex()}, "is not a lane's"),
            "a name not a lane's": ({"path": str(SHM_DIR / "convoy-x-replay0"), "bytes": 8192, "token": token.hex()},
                                    "is not a lane's"),
            "a link": ({"path": str(link), "bytes": 8192, "token": token.hex()}, "cannot open"),
            "the wrong size": ({"path": str(path), "bytes": 16384, "token": token.hex()}, "of 16384 bytes"),
            "the wrong token": ({"path": str(path), "bytes": 8192, "token": secrets.token_hex(TOKEN_BYTES)},
                                "does not hold the token"),
            "over the bounds": ({"path": str(path), "bytes": 1 << 40, "token": token.hex()}, "outside this service"),
            "no such segment (another host)": ({"path": str(SHM_DIR / f"convoy-lane-{secrets.token_hex(16)}"),
                                                "bytes": 8192, "token": token.hex()}, "cannot open"),
            "malformed": ({"path": 7}, "is opened with"),
        }
        for case, (meta, why) in cases.items():
            reply = open_raw(conn, meta)
            assert reply.op == REFUSED and why in reply.meta["why"], (case, reply)
        link.unlink()
        assert torch.equal(conn.request(Message("step", {}, {"x": torch.ones(2)})).tensors["x"], torch.full((2,), 2.0))
        assert open_raw(conn, {"path": str(path), "bytes": 8192, "token": token.hex()}).op == OPENED
    finally:
        path.unlink(missing_ok=True)
        lane.close()
        conn.close()


@pytest.mark.parametrize("entry, why", [
    (["x", "torch.float32", [4], 64 * 1024], "is not an aligned span"),
    (["x", "torch.float32", [1 << 20], ALIGN], "is not an aligned span"),
    (["x", "torch.float32", [4], 1], "is not an aligned span"),
    (["x", "torch.float32", [4], 0], "is not an aligned span"),
    (["x", "torch.complex128", [4], ALIGN], "is not [name, dtype, shape]"),
    (["x", "torch.float32", [4]], "is not [name, dtype, shape, offset]"),
])
def test_a_lane_entry_outside_the_lane_is_refused_and_closes_that_connection_only(
        service: Listener, entry: list[object], why: str) -> None:
    hostile = Connection(service.address, credentials=ME, lane_bytes=8192)
    hostile.request(Message("open", {}, {"x": torch.ones(1)}))
    with pytest.raises(BadMessage, match=r"refused this process: .*" + why.replace("[", r"\[").replace("]", r"\]")):
        hostile.request(Message("step", {LANE_META: [entry]}))
    other = Connection(service.address, credentials=ME, lane_bytes=8192)
    assert torch.equal(other.request(Message("step", {}, {"x": torch.ones(1)})).tensors["x"], torch.full((1,), 2.0))
    other.close()


def test_lane_entries_on_a_connection_that_opened_no_lane_are_refused(service: Listener) -> None:
    conn = Connection(service.address, credentials=ME)
    with pytest.raises(BadMessage, match="this connection opened none"):
        conn.request(Message("step", {LANE_META: [["x", "torch.float32", [1], ALIGN]]}))


def test_the_lane_is_named_for_the_job_so_its_end_removes_one_a_crash_left() -> None:
    lane, path, _ = Lane.create(4096, "job42")
    try:
        assert path.parent == SHM_DIR and path.name.startswith("convoy-job42-lane-")
        assert os.stat(path).st_mode & 0o777 == 0o600
    finally:
        path.unlink()
        lane.close()
