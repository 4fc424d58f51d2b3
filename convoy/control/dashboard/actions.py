"""The dashboard's actions (abort the job, apply or dismiss a proposal, scale a role) as the API's own calls: on the
master in the same process, or through the job's master at its address with its token (``convoy dashboard``).
Each names who did it; the master records it in the job's events."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, ValidationError

from convoy.control.protocol import messages as p
from convoy.control.protocol import training as tp
from convoy.errors import ConfigError, ConflictError, ConvoyError

Call = Callable[[str, BaseModel], Any]
"""``(api path, request) -> reply``: raises ConflictError (409) or ConfigError (400) with the master's reason."""


class ActionError(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code, self.reason = code, reason


def request_of(action: str, body: dict[str, Any], who: str, proposal: int = 0) -> tuple[str, BaseModel]:
    """The API call an action is: its path and request (a 400 ActionError when the body is wrong)."""
    try:
        if action == "abort":
            reason = str(body.get("reason") or "no reason given")[:500]
            return "/abort", p.AbortRequest(reason=f"aborted from the dashboard by {who}: {reason}")
        if action in ("apply", "dismiss"):
            return "/config/proposals", tp.ProposalAction(proposal=proposal, action=action, author=who)
        if action == "scale":
            count = body.get("count")
            if not isinstance(count, int) or isinstance(count, bool):
                raise ActionError(400, f"scale: count must be a whole number (got {count!r})")
            return "/scale", p.ScaleRequest(role=str(body.get("role", "")), count=count, author=who)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ActionError(400, f"{action}: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    raise ActionError(404, f"no such action {action!r}: abort, apply, dismiss or scale")


def run_action(call: Call, path: str, request: BaseModel) -> Any:
    try:
        return call(path, request)
    except ConflictError as exc:
        raise ActionError(409, str(exc)) from None
    except ConfigError as exc:
        raise ActionError(400, str(exc)) from None
    except ConvoyError as exc:  # the master is gone (a finished job) or refused the token
        raise ActionError(502, f"the job's master cannot be asked: {exc}") from None


def in_process(routes: dict[str, tuple[Any, Callable[[Any], Any]]]) -> Call:
    """Actions on the master serving the dashboard: its API's routes, called directly."""
    def call(path: str, request: BaseModel) -> Any:
        return routes[path][1](request)
    return call


def through_api(run_dir: Path) -> Call:
    """Actions on the job of a run dir, through its master's API (only a running job has one)."""
    def call(path: str, request: BaseModel) -> Any:
        from convoy.config import MasterConfig
        from convoy.control.protocol.client import MasterClient
        from convoy.control.store import read_status
        from convoy.control.token import TOKEN_FILE, read_token

        job = read_status(run_dir, recent=0)["job"]
        if job is None or job["status"] != "running":
            raise ConflictError(f"the job in {str(run_dir)!r} is not running "
                                f"({job['status'] if job else 'no job yet'}): it takes no actions")
        host, _, port = job["master_url"].rpartition(":")
        ca = MasterConfig.from_json(job["config"]).tls_cert
        client = MasterClient(host, int(port), read_token(Path(run_dir) / TOKEN_FILE), give_up_after_s=5.0, tls_ca=ca)
        try:
            reply = {"/abort": p.Ack, "/scale": p.Ack, "/config/proposals": tp.VersionInfo}[path]
            return client.call(path, request, reply)
        finally:
            client.close()
    return call
