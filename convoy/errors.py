"""One exception hierarchy for everything a user can get wrong or a job can hit; each workload adds its own
subclasses in its package (``workloads/*/errors.py``)."""

from __future__ import annotations


class ConvoyError(Exception):
    """Base class: the CLI prints the message on one line and exits with code 2."""


class ConfigError(ConvoyError, ValueError):
    """A job setting, argument or command-line value is invalid (also a ``ValueError``, as callers of a library
    expect from a bad argument)."""


class RendezvousError(ConvoyError):
    """Nodes could not agree on a membership."""


class MasterUnreachableError(ConvoyError):
    """An agent could not reach the master for longer than it may wait."""


class JobEndedError(MasterUnreachableError):
    """A call to a master that went away after the caller had heard the job end: no answer is needed any more."""


class AuthError(ConvoyError):
    """A request to the master did not carry the job's token."""


class WorkerStartError(ConvoyError):
    """A worker process could not be started at all (not a failure of the script)."""


class CheckpointError(ConvoyError):
    """A checkpoint could not be saved or restored as asked."""


class ConflictError(ConvoyError):
    """A request clashes with the job's state (e.g. a node id already in use); HTTP 409. ``reason``: the master's
    own words, without who answered (what the agent passes on to the process that asked)."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message


class ScheduleError(ConvoyError):
    """A pipeline schedule or stage split is invalid; the message names the first offending action."""


class StateWriteError(ConvoyError):
    """The master cannot write the job's state to its run dir (e.g. the disk is full); HTTP 503."""
