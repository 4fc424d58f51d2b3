"""HTTP client for the master's API: persistent connection, retries with backoff."""

from __future__ import annotations

import http.client
import secrets
import time
from typing import TypeVar

from pydantic import BaseModel

from convoy.control import protocol as p
from convoy.errors import AuthError, ConflictError, ConvoyError, MasterUnreachableError, StateWriteError

Reply = TypeVar("Reply", bound=BaseModel)
REPLY_GRACE_S = 3.0
"""How much longer than its long-poll wait a request may take before it counts as lost."""


class MasterClient:
    """One keep-alive connection to the master; not shared between threads."""

    def __init__(self, host: str, port: int, token: str, give_up_after_s: float = 30.0) -> None:
        self.host, self.port, self.token = host, port, token
        self.give_up_after_s = give_up_after_s
        self._conn: http.client.HTTPConnection | None = None
        self._key_prefix = secrets.token_hex(8)
        self._calls = 0
        """Each call carries ``Idempotency-Key: <prefix>-<count>``, the same on every retry of it."""

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
        backoff = 0.05
        while True:
            try:
                status, data = self._post(p.API_PREFIX + path, body, headers, wait_s + REPLY_GRACE_S)
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                if time.monotonic() + backoff > deadline:
                    raise MasterUnreachableError(
                        f"master at {self.host}:{self.port} unreachable for {self.give_up_after_s:.0f} s ({exc})"
                    ) from exc
                time.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
                continue
            if status == 200:
                return reply.model_validate_json(data)
            if status == 503 and time.monotonic() + backoff <= deadline:  # handled, not yet on disk: ask again
                time.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
                continue
            if status == 503:
                raise StateWriteError(f"master at {self.host}:{self.port}: {_error_text(data)}")
            if status == 401:
                raise AuthError(f"master at {self.host}:{self.port} rejected the token: check --token-file")
            if status == 409:  # refused for the job's state: the caller may act on it (a forwarded shard call)
                raise ConflictError(f"master answered 409 to {path}: {_error_text(data)}")
            raise ConvoyError(f"master answered {status} to {path}: {data.decode(errors='replace')}")

    def _post(self, path: str, body: bytes, headers: dict[str, str], timeout: float) -> tuple[int, bytes]:
        if self._conn is None:
            self._conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        self._conn.timeout = timeout
        if self._conn.sock is not None:
            self._conn.sock.settimeout(timeout)
        self._conn.request("POST", path, body=body, headers=headers)
        response = self._conn.getresponse()
        return response.status, response.read()


def _error_text(data: bytes) -> str:
    try:
        return str(p.ErrorBody.model_validate_json(data).error)
    except ValueError:
        return data.decode(errors="replace")
