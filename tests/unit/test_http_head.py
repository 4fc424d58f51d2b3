"""The master's request heads and replies (``http_head.py``) and its compressed replies (``replies.encoded_once``,
``replies.Joined``, ``client.inflated``): malformed heads are refused, keep-alive follows the version and
Connection, a reply's head is whole, and a gzip reply inflates within a bound only."""

from __future__ import annotations

import gzip
import http.client

import pytest

from convoy.control.http_head import parse_head, reply_head
from convoy.control.protocol.client import inflated
from convoy.control.replies import GZIP_AT, Joined, Tail, encoded_once


def test_a_head_is_split_into_its_line_and_fields_with_names_in_lower_case() -> None:
    head = parse_head(b"POST /v1/join HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer abc\r\nX-Two: a: b\r\n\r\n")
    assert (head.method, head.target, head.version) == ("POST", "/v1/join", "HTTP/1.1")
    assert head.get("authorization") == "Bearer abc" and head.get("X-TWO") == "a: b" and head.get("missing") == ""
    assert head.keep_alive
    assert not parse_head(b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n").keep_alive
    assert not parse_head(b"GET / HTTP/1.0\r\n\r\n").keep_alive
    assert parse_head(b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n").keep_alive


MALFORMED = [b"GET /\r\n\r\n", b"GET / HTTP/1.1 extra\r\n\r\n", b"GET / HTTP/1.1\r\nno colon\r\n\r\n",
             b"GET / HTTP/1.1\r\n: empty name\r\n\r\n", b"GET / HTTP/1.1\r\nName : spaced\r\n\r\n",
             b"GET / HTTP/1.1\r\nA: b\r\n folded\r\n\r\n"]


@pytest.mark.parametrize("block", MALFORMED)
def test_a_malformed_head_is_refused(block: bytes) -> None:
    with pytest.raises(ValueError, match="malformed"):
        parse_head(block)


def test_a_reply_head_names_the_status_and_length_and_ends_its_block() -> None:
    head = reply_head(409, 12, (("Connection", "close"),)).decode()
    assert head.startswith("HTTP/1.1 409 Conflict\r\nServer: convoy\r\nDate: ") and head.endswith("\r\n\r\n")
    assert "Connection: close\r\n" in head and "Content-Length: 12\r\n" in head


def test_a_long_reply_is_compressed_once_and_inflates_only_within_its_bound() -> None:
    assert encoded_once(b"x" * (GZIP_AT - 1)).gzipped is None
    body = b'{"members": [' + b'{"node_id": "sim00001", "host": "127.0.0.1"},' * 4000 + b"]}"
    reply = encoded_once(body)
    assert reply == body and reply.gzipped is not None and len(reply.gzipped) < len(body) / 10
    assert inflated(reply.gzipped, len(body)) == body
    with pytest.raises(http.client.HTTPException, match="inflates past"):
        inflated(gzip.compress(b"\0" * (1 << 20)), 1 << 16)  # a small body that would inflate far
    with pytest.raises(http.client.HTTPException, match="does not inflate"):
        inflated(b"not gzip at all", 1 << 16)


def test_a_reply_of_its_own_head_and_a_shared_tail_is_one_gzip_member_that_inflates_to_both() -> None:
    """A heartbeat reply: the node's own head, then the roles' addresses every node behind by the same waves gets.
    The tail is deflated once for all of them; each reply is a standard gzip (any client inflates it)."""
    tail = Tail(b'"addresses":{"actor":[' + b",".join(b'"127.1.%d.%d:20000"' % (i // 250, i % 250)
                                                       for i in range(8000)) + b"]}}")
    replies = [Joined(b'{"job_status":"running","poll_s":%d,' % n, tail) for n in range(3)]
    for n, reply in enumerate(replies):
        assert bytes(reply) == b'{"job_status":"running","poll_s":%d,' % n + tail
        assert gzip.decompress(reply.gzipped) == bytes(reply) == inflated(reply.gzipped, 1 << 24)
        assert len(reply.gzipped) < len(reply) / 4
    assert replies[0].gzipped[-len(tail.deflated) - 8:-8] == tail.deflated, "the tail's blocks as made once"
    assert Joined(b"{", Tail(b"}")).gzipped is None, "a short reply goes as it is"
