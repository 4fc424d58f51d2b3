"""The one transport of every role service (a parameter server now; a replay buffer, a sample store, a weight sync
next): authenticated (a per-job secret, proven both ways on connect; TLS where the job speaks TLS), bounded (every
length checked before anything is allocated) and incarnation-aware (a caller of an ended incarnation is refused).
README.md here says how; a service is a ``Listener`` with a handler, a caller holds ``Connection``s."""

from __future__ import annotations

from convoy.parallel.transport.connection import REQUEST_S, Connection
from convoy.parallel.transport.errors import (BadMessage, ConnectionLost, OutsideRunDir, Refused, StaleIncarnation,
                                              TransportError)
from convoy.parallel.transport.fence import IncarnationFence
from convoy.parallel.transport.files import confined
from convoy.parallel.transport.handshake import Credentials, Identity
from convoy.parallel.transport.listener import Handler, Listener
from convoy.parallel.transport.wire import Limits, Message

__all__ = ["REQUEST_S", "BadMessage", "Connection", "ConnectionLost", "Credentials", "Handler", "Identity",
           "IncarnationFence", "Limits", "Listener", "Message", "OutsideRunDir", "Refused", "StaleIncarnation",
           "TransportError", "confined"]
