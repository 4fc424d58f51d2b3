"""The parameter servers' wire is the role services' transport (``convoy/parallel/transport/``); these names stay
importable from here for the callers written against this module before it moved."""

from __future__ import annotations

from convoy.parallel.transport import (REQUEST_S, Connection, ConnectionLost, Credentials, Listener, Message,
                                       TransportError)

__all__ = ["REQUEST_S", "Connection", "ConnectionLost", "Credentials", "Listener", "Message", "TransportError"]
