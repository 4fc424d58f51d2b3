"""Role services of a job that runs with TLS: each makes its own certificate, a caller of the job gets through,
a caller that does not speak TLS does not, and a relay that ends TLS with a certificate of its own (a man in the
middle) is refused although it passes every byte on: the proofs cover the certificate each side saw."""

from __future__ import annotations

import select
import socket
import ssl
import threading
import time

import pytest
import torch

from convoy.parallel.transport import Connection, ConnectionLost, Credentials, Identity, Listener, Message, Refused
from convoy.parallel.transport.tls import caller_context, service_context

pytest.importorskip("cryptography")  # what a TLS job's services make their certificates with

JOB = Credentials.fresh(Identity("worker", 0, 0), tls=True)


def echo(message: Message, caller: Identity) -> Message:
    return Message("echo", {"caller": caller.describe()}, message.tensors)


def test_a_caller_of_a_tls_job_is_served_over_tls() -> None:
    listener = Listener(echo, credentials=JOB.as_process(Identity("ps", 0, 0)))
    connection = Connection(listener.address, credentials=JOB)
    assert connection.sock.version() == "TLSv1.3"
    reply = connection.request(Message("hello?", {}, {"big": torch.arange(300_000)}))
    assert reply.meta == {"caller": "worker 0 (incarnation 0)"} and torch.equal(reply.tensors["big"],
                                                                                 torch.arange(300_000))
    assert connection.peer == Identity("ps", 0, 0)
    with pytest.raises(ConnectionLost, match="went away during the handshake"):
        Connection(listener.address, credentials=Credentials(JOB.secret, JOB.identity, tls=False))
    plain = Listener(echo, credentials=Credentials(JOB.secret, Identity("ps", 1, 0), tls=False))
    with pytest.raises(Refused, match="does not speak TLS as this job does"):
        Connection(plain.address, credentials=JOB)
    connection.close()
    assert Connection(listener.address, credentials=JOB).request(Message("again")).op == "echo"
    for each in (listener, plain):
        each.close()


def relay(service: str) -> tuple[socket.socket, threading.Thread]:
    """A man in the middle: ends the caller's TLS with a certificate of its own, opens TLS to the service, and
    copies the plain bytes both ways, from one thread (an SSL socket read and written by two threads at once can
    lose a record: OpenSSL's connections are not thread-safe)."""
    own, _ = service_context()
    front = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        caller, _ = front.accept()
        inside = own.wrap_socket(caller, server_side=True)
        host, _, port = service.rpartition(":")
        onward = caller_context().wrap_socket(socket.create_connection((host, int(port))))
        other = {inside: onward, onward: inside}
        for each in other:
            each.settimeout(0.05)  # a read that finds only part of a record returns to the loop, not blocks it
        deadline = time.monotonic() + 30
        try:
            while time.monotonic() < deadline:
                ready = [each for each in other if each.pending()] or select.select(list(other), [], [], 0.1)[0]
                for each in ready:
                    try:
                        chunk = each.recv(1 << 16)
                    except (TimeoutError, ssl.SSLWantReadError):
                        continue
                    if not chunk:
                        return
                    other[each].sendall(chunk)
        except OSError:
            return
        finally:
            for each in other:
                each.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return front, thread


def test_a_relay_with_a_certificate_of_its_own_is_refused() -> None:
    listener = Listener(echo, credentials=JOB.as_process(Identity("ps", 0, 0)))
    front, thread = relay(listener.address)
    with pytest.raises(Refused, match=r"worker 0 \(incarnation 0\) did not prove it holds this job's secret"):
        Connection(f"127.0.0.1:{front.getsockname()[1]}", credentials=JOB)
    thread.join(10)
    assert not thread.is_alive() and listener.refused == 1
    front.close()
    listener.close()
