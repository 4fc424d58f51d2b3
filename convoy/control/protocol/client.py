"""HTTP client for the master's API: persistent connection, retries with backoff."""

from __future__ import annotations

import http.client
import json
import random
import secrets
import socket
import ssl
import time
import zlib
from typing import Any, Callable, TypeVar

from pydantic import BaseModel

from convoy.control.protocol import messages as p
from convoy.errors import (AuthError, ConfigError, ConflictError, ConvoyError, JobEndedError, MasterUnreachableError,
                           StateWriteError)

Reply = TypeVar("Reply", bound=BaseModel)
MAX_REPLY_BYTES = 64 << 20
"""The most a compressed reply may inflate to (a round of 100k nodes is about 9 MB)."""
REPLY_GRACE_S = 3.0
"""How much longer than its long-poll wait a request may take before it counts as lost."""
FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.05, 1.0


def jittered(backoff: float, rng: random.Random) -> float:
    """A retry's pause: ``backoff`` scaled by a random factor in [0.5, 1.5), so that agents that lost the
    master together (a restart) do not all come back in the same instant."""
    return backoff * (0.5 + rng.random())


TOKEN_HINT = "check --token-file (or the token given with --rdzv-conf token=...)"


class MasterClient:
    """One keep-alive connection to the master; not shared between threads."""

    def __init__(self, host: str, port: int, token: str, give_up_after_s: float = 30.0, tls_ca: str = "") -> None:
        """``tls_ca``: speak TLS, and trust the master's certificate only if this CA (a PEM file) signed it."""
        self.host, self.port, self.token = host, port, token
        self.give_up_after_s = give_up_after_s
        self._tls: ssl.SSLContext | None = None
        if tls_ca:
            self._tls = client_tls(tls_ca)
        self._rng = random.Random()
        self._conn: http.client.HTTPConnection | None = None
        self._key_prefix = secrets.token_hex(8)
        self._calls = 0
        """Each call carries ``Idempotency-Key: <prefix>-<count>``, the same on every retry of it."""
        self.ended: Callable[[], bool] = lambda: False
        """Asked before each retry: True once the caller has heard the job end (its master is on its way out), when
        a call that cannot reach the master raises ``JobEndedError`` at once instead of retrying to the deadline."""

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def call(self, path: str, request: BaseModel, reply: type[Reply], wait_s: float = 0.0) -> Reply:
        """POST ``request`` to ``path``; retry on connection faults until ``give_up_after_s``.

        A retry carries the same idempotency key, so a call whose reply was lost is handled once.
        """
        body = request.model_dump_json().encode()
        self._calls += 1
        headers = {"Content-Type": "application/json", p.TOKEN_HEADER: f"Bearer {self.token}",
                   p.IDEMPOTENCY_HEADER: f"{self._key_prefix}-{self._calls}"}
        deadline = time.monotonic() + self.give_up_after_s
        backoff = FIRST_BACKOFF_S
        while True:
            pause = jittered(backoff, self._rng)
            try:
                status, data = self._post(p.API_PREFIX + path, body, headers, wait_s + REPLY_GRACE_S)
            except ssl.SSLError as exc:
                self.close()
                if isinstance(exc, (ssl.SSLEOFError, ssl.SSLZeroReturnError)):  # cut off (a master restarting)
                    self._unless_ended(path, exc)
                    if time.monotonic() + pause > deadline:
                        raise MasterUnreachableError(f"master at {self.host}:{self.port} unreachable for "
                                                     f"{self.give_up_after_s:.0f} s ({exc})") from exc
                    time.sleep(pause)
                    backoff = min(backoff * 2, MAX_BACKOFF_S)
                    continue
                raise MasterUnreachableError(f"TLS with the master at {self.host}:{self.port} failed: "
                                             f"{getattr(exc, 'verify_message', '') or exc.reason}; check --tls-ca "
                                             "and that the master serves TLS") from exc
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                self._unless_ended(path, exc)
                if time.monotonic() + pause > deadline:
                    raise MasterUnreachableError(
                        f"master at {self.host}:{self.port} unreachable for {self.give_up_after_s:.0f} s ({exc})"
                    ) from exc
                time.sleep(pause)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
                continue
            if status == 200:
                return reply.model_validate_json(data)
            if status == 503 and time.monotonic() + pause <= deadline:  # handled, not yet on disk: ask again
                time.sleep(pause)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
                continue
            if status == 503:
                raise StateWriteError(f"master at {self.host}:{self.port}: {_error_text(data)}")
            if status == 401:
                raise AuthError(f"master at {self.host}:{self.port} rejected the token: {TOKEN_HINT}")
            if status == 409:  # refused for the job's state: the caller may act on it (a forwarded shard call)
                reason = _error_text(data)
                raise ConflictError(f"master answered 409 to {path}: {reason}", reason)
            if status == 400:  # a value of the request is wrong; the master's text names it
                raise ConfigError(f"master answered 400 to {path}: {_error_text(data)}")
            raise ConvoyError(f"master answered {status} to {path}: {data.decode(errors='replace')}")

    def _unless_ended(self, path: str, exc: BaseException) -> None:
        if self.ended():
            raise JobEndedError(f"{path}: the master at {self.host}:{self.port} is gone after the job ended ({exc})")

    def get(self, path: str) -> dict[str, Any]:
        """GET ``path`` (with its query) once: the JSON answer; a ConvoyError says why there is none."""
        headers = {p.TOKEN_HEADER: f"Bearer {self.token}"}
        try:
            status, data = self._post(p.API_PREFIX + path, b"", headers, self.give_up_after_s, method="GET")
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            raise MasterUnreachableError(f"master at {self.host}:{self.port} unreachable: {exc}") from exc
        if status == 401:
            raise AuthError(f"master at {self.host}:{self.port} rejected the token: {TOKEN_HINT}")
        if status != 200:
            raise (ConfigError if status == 400 else ConvoyError)(f"master answered {status} to {path}: "
                                                                  f"{_error_text(data)}")
        return json.loads(data)  # type: ignore[no-any-return]

    def _post(self, path: str, body: bytes, headers: dict[str, str], timeout: float,
              method: str = "POST") -> tuple[int, bytes]:
        if self._conn is None:
            if self._tls is not None:
                self._conn = http.client.HTTPSConnection(self.host, self.port, timeout=timeout, context=self._tls)
            else:
                self._conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
            self._conn.connect()
            self._conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no wait for a delayed ACK
        self._conn.timeout = timeout
        if self._conn.sock is not None:
            self._conn.sock.settimeout(timeout)
        self._conn.request(method, path, body=body, headers={**headers, "Accept-Encoding": "gzip"})
        response = self._conn.getresponse()
        data = response.read()
        if (response.getheader("Content-Encoding") or "").lower() == "gzip":
            data = inflated(data, MAX_REPLY_BYTES)
        return response.status, data


def inflated(data: bytes, bound: int) -> bytes:
    """A gzip body, inflated to at most ``bound`` bytes (an http.client.HTTPException past it, or if corrupt)."""
    inflater = zlib.decompressobj(wbits=31)
    try:
        out = inflater.decompress(data, bound)
    except zlib.error as exc:
        raise http.client.HTTPException(f"a gzip reply that does not inflate: {exc}") from exc
    if inflater.unconsumed_tail:
        raise http.client.HTTPException(f"a reply that inflates past {bound} bytes")
    return out


def client_tls(ca: str) -> ssl.SSLContext:
    """An agent's TLS context: the master's certificate must chain to ``ca`` and name the host dialled."""
    try:
        return ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"--tls-ca {ca!r} cannot be loaded: {exc}; give the PEM certificate that signed the "
                          "master's") from exc


def _error_text(data: bytes) -> str:
    try:
        return str(p.ErrorBody.model_validate_json(data).error)
    except ValueError:
        return data.decode(errors="replace")
