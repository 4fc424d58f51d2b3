"""Ports a process binds later: a port counts as free only where torch's TCPStore could listen on it (every
address), and the agent picks role ports outside the kernel's range for outgoing connections, so that no
connection made before the process binds takes one (the cause of a role group that could not form)."""

from __future__ import annotations

import datetime
import socket
import subprocess

import pytest
import torch.distributed as dist

from convoy.ports import FIRST_UNCLAIMED, can_listen, outgoing_range, unclaimed_port


def own_address() -> str:
    """This host's first address other than the loopback (skips where it has none)."""
    listed = subprocess.run(["hostname", "-I"], capture_output=True, text=True, check=False).stdout.split()
    addresses = [a for a in listed if "." in a and not a.startswith("127.")]
    if not addresses:
        pytest.skip("this host has no IPv4 address besides the loopback")
    return addresses[0]


def store_listens(port: int) -> bool:
    """Whether torch's TCPStore (the server of a role group's rendezvous) can listen on ``port``."""
    try:
        store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=5))
    except RuntimeError as exc:
        assert "EADDRINUSE" in str(exc) or "in use" in str(exc), exc
        return False
    del store
    return True


def test_a_port_held_on_the_hosts_own_address_is_not_free_though_the_loopback_could_bind_it() -> None:
    with socket.socket() as holder:
        holder.bind((own_address(), 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        with socket.socket() as loopback:  # what the agent checked before: the loopback alone binds it
            loopback.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            loopback.bind(("127.0.0.1", port))
        assert not store_listens(port)
        assert not can_listen(port)
    assert can_listen(port) and store_listens(port)


def test_a_port_an_open_connection_uses_is_not_free() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        with socket.create_connection(server.getsockname()) as client:
            port = client.getsockname()[1]
            assert not can_listen(port) and not store_listens(port)


def test_the_port_of_a_stopped_server_is_free_though_its_connections_linger_in_time_wait() -> None:
    """A restarted rank takes its old port back: what its old server accepted and closed first does not hold it."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore and the role services
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.close()  # the server's side closes first, so the server's port is the one left in TIME_WAIT
    assert client.recv(1) == b""
    client.close()
    server.close()
    assert can_listen(port) and store_listens(port)


def test_role_ports_are_picked_outside_the_range_outgoing_connections_take_theirs_from() -> None:
    low, high = outgoing_range()
    picked = {unclaimed_port("127.0.0.1") for _ in range(50)}
    assert all(port >= FIRST_UNCLAIMED and not low <= port <= high for port in picked), picked
    assert len(picked) > 40, "the picks are spread, so two agents on one host rarely try the same port"
    assert all(can_listen(port) for port in picked)


def test_a_port_another_listener_holds_is_not_reused_until_it_closes() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert not can_listen(port)
    assert can_listen(port), "free again once its listener closed"
