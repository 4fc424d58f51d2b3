"""Events from inside a worker to the job's record, through the output the agent already reads.

A worker prints one marked line on stderr (``emit``); the agent's log pump, which copies every
line of its workers' output, recognises the mark (``parse``) and sends the event to the master
(``POST /v1/event``), which records it beside its own. No new channel, no token in the worker,
and a worker with no agent (plain ``python``, torchrun) just prints the line. Torch-free.
"""

from __future__ import annotations

import json
import re
import sys

MARK = "convoy-event "
KIND = re.compile(r"^[a-z][a-z0-9_]{0,39}$")
MAX_MESSAGE = 2000


def emit(kind: str, message: str) -> None:
    """Record ``kind`` (lower_snake_case) with ``message`` as an event of this worker's job."""
    if not KIND.match(kind):
        raise ValueError(f"event kind {kind!r} must be lower_snake_case, at most 40 characters")
    line = MARK + json.dumps({"kind": kind, "message": message[:MAX_MESSAGE]})
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass  # no stderr to write to: the event is lost, training is not


def parse(line: str) -> tuple[str, str] | None:
    """``(kind, message)`` if ``line`` (as printed, maybe with a rank prefix) is an event, else None."""
    start = line.find(MARK)
    if start < 0 or start > 32:  # the mark opens the line, after at most a "[rankN]: " prefix
        return None
    try:
        body = json.loads(line[start + len(MARK):])
    except ValueError:
        return None
    if not isinstance(body, dict):
        return None
    kind, message = body.get("kind"), body.get("message")
    if not isinstance(kind, str) or not KIND.match(kind) or not isinstance(message, str):
        return None
    return kind, message[:MAX_MESSAGE]
