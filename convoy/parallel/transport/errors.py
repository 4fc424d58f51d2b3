"""What can go wrong between a role service and its caller: the link (``TransportError``, ``ConnectionLost``) or
the service's verdict on the caller (``Refused`` and its kinds), which closes the connection and is never retried."""

from __future__ import annotations

from convoy.errors import ConvoyError


class TransportError(ConvoyError):
    """A role service or its caller went away mid-message, or answered with an error."""


class ConnectionLost(TransportError):
    """The peer cannot be reached or went away: a caller may find the service's next incarnation."""


class Refused(ConvoyError):
    """A role service turned this caller away (no handshake, a wrong secret, a service that could not prove it holds
    the job's): one reply names why, and the connection is closed."""


class BadMessage(Refused):
    """A message past the wire's bounds or not in its format, refused before anything was allocated for it."""


class StaleIncarnation(Refused):
    """The caller is a process of an incarnation that has ended: its rank was started again. It must stop."""


class OutsideRunDir(Refused):
    """A path a caller asked a service to read or write lies outside the job's run directory."""


REFUSALS: dict[str, type[Refused]] = {kind.__name__: kind for kind in (Refused, BadMessage, StaleIncarnation,
                                                                       OutsideRunDir)}
"""An ``error`` reply's ``kind`` -> the exception the caller raises (the service closes such a connection)."""
