"""``convoy config set|show|history|proposals --run-dir D``: the live training config of a running job.

Each command reads the master's address from the run dir's state and its token beside it, and speaks to the
master's API (``PUT``/``GET /v1/config``, ``POST /v1/config/proposals``); a bad field or value is one line and
exit 2, with nothing changed on any rank.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from convoy.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="config_command", required=True)
    put = commands.add_parser("set", help="set fields of the training config: hot ones in place at one step on "
                                          "every rank, restart ones by a restart from that step's snapshot")
    put.add_argument("values", metavar="KEY=VALUE", nargs="+", help="e.g. lr=0.05")
    put.add_argument("--at-step", type=int, default=None, metavar="S",
                     help="the first step to run with it (default: the first every rank can still reach)")
    put.add_argument("--reason", default="", help="why (kept with the version)")
    put.add_argument("--author", default="", help="who (default: the user's login name)")
    commands.add_parser("show", help="the config in use: each field, its kind, its value")
    commands.add_parser("history", help="every version: when, by whom, why, from which step")
    proposals = commands.add_parser("proposals", help="what the status rules propose, with their evidence")
    action = proposals.add_mutually_exclusive_group()
    action.add_argument("--apply", type=int, default=None, metavar="N", help="apply proposal N")
    action.add_argument("--dismiss", type=int, default=None, metavar="N", help="dismiss proposal N")
    for command in commands.choices.values():
        command.add_argument("--run-dir", type=Path, required=True, help="the job's run directory")
        command.add_argument("--json", action="store_true", help="print the master's answer as JSON")


def job_client(run_dir: Path, tls_ca: str | None = None, running: bool = True) -> tuple[Any, dict[str, Any]]:
    """A client of the master of the job in ``run_dir`` (its address from the state, its token beside it)."""
    from convoy.config import MasterConfig
    from convoy.control.protocol.client import MasterClient
    from convoy.control.store import read_status
    from convoy.control.token import TOKEN_FILE, read_token

    job = read_status(run_dir, recent=0)["job"]
    if job is None or (running and job["status"] != "running"):
        state = "has no job state yet" if job is None else f"holds a job that has {job['status']}"
        raise ConfigError(f"run dir {str(run_dir)!r} {state}: only a running job can be asked")
    host, _, port = job["master_url"].rpartition(":")
    ca = tls_ca if tls_ca is not None else MasterConfig.from_json(job["config"]).tls_cert
    return MasterClient(host, int(port), read_token(Path(run_dir) / TOKEN_FILE), give_up_after_s=5.0,
                        tls_ca=ca), job


def run(args: argparse.Namespace) -> int:
    from convoy.control.protocol import training as tp
    from convoy.control.training.versions import parse_assignments

    if args.config_command == "set":
        values = parse_assignments(args.values)
        client, job = job_client(args.run_dir)
        request = tp.ConfigSet(values=values, reason=args.reason, author=args.author or _login(),
                               at_step=args.at_step)
        version = _refusal(lambda: client.call("/config", request, tp.VersionInfo), "the config was not set")
        if args.json:
            print(version.model_dump_json())
            return 0
        how = "by a restart of the round" if version.apply == "restart" else "in place"
        print(f"convoy: config version {version.number} of job {job['job_id']}: {_words(version.changed)}, applied "
              f"{how} from step {version.at_step}", flush=True)
        return 0
    acting = args.config_command == "proposals" and (args.apply is not None or args.dismiss is not None)
    client, job = job_client(args.run_dir, running=acting)
    if acting:
        action = tp.ProposalAction(proposal=args.apply or args.dismiss, action="apply" if args.apply else "dismiss",
                                   author=_login())
        version = _refusal(lambda: client.call("/config/proposals", action, tp.VersionInfo),
                           f"proposal {action.proposal} was not {action.action}ed")
        print(f"convoy: proposal {action.proposal} {action.action}ed" +
              (f": config version {version.number}, {_words(version.changed)} from step {version.at_step}"
               if version.number else ""), flush=True)
        return 0
    state = _refusal(lambda: client.get("/config"), "the master did not answer") if job["status"] == "running" \
        else ended_state(args.run_dir, job)  # an ended job's config is read from its state file
    if args.json:
        print(json.dumps(state, indent=2))
        return 0
    print("\n".join({"show": format_show, "history": format_history,
                     "proposals": format_proposals}[args.config_command](state)))
    return 0


def ended_state(run_dir: Path, job: dict[str, Any]) -> dict[str, Any]:
    """What ``GET /v1/config`` answered, from the state an ended job's master left."""
    from convoy.control.store import read_part
    from convoy.control.training.master import PROPOSALS_PART, STATE_PART

    saved = json.loads(read_part(run_dir, STATE_PART) or "{}")
    proposals = json.loads(read_part(run_dir, PROPOSALS_PART) or "[]")
    versions = saved.get("versions") or []
    return {"version": versions[-1]["number"] if versions else 0, "schema": saved.get("schema"),
            "overrides": saved.get("overrides") or {}, "versions": versions, "proposals": proposals,
            "job_status": job["status"]}


def _refusal(call: Any, what: str) -> Any:
    """The call's answer; a refusal of the master (409, 400) becomes one line naming its reason."""
    from convoy.errors import ConflictError

    try:
        return call()
    except ConflictError as exc:
        raise ConfigError(f"{what}: {exc.reason}") from None
    except ConfigError as exc:  # "master answered 400 to PATH: REASON (naming the field)"
        raise ConfigError(str(exc).split(": ", 1)[-1]) from None


def format_show(state: dict[str, Any]) -> list[str]:
    schema, versions = state.get("schema"), state.get("versions") or []
    if not schema or not versions:
        return ["the script has not declared a training config yet (convoy.train_config)"]
    current = versions[-1]
    lines = [f"training config version {current['number']} ({current['status']}, from step {current['at_step']}):"]
    for spec in schema["fields"]:
        bounds = "".join(f" {word} {spec[key]:g}" for word, key in (("min", "minimum"), ("max", "maximum"))
                         if spec[key] is not None)
        value = current["values"].get(spec["name"])
        lines.append(f"  {spec['name']:<20} {value!r:<14} {spec['kind']:<8} {spec['type']}{bounds}"
                     + (f"  {spec['doc']}" if spec["doc"] else ""))
    return lines


def format_history(state: dict[str, Any]) -> list[str]:
    lines = []
    for v in state.get("versions") or []:
        when = time.strftime("%H:%M:%S", time.localtime(v["created_at"]))
        lines.append(f"v{v['number']:<3} {when} step {v['at_step']:<7} {v['kind']:<8} {v['apply']:<8} "
                     f"{v['status']:<10} {v['author']}: {_words(v['changed'])}" + (f" ({v['reason']})"
                                                                                  if v["reason"] else ""))
    return lines or ["no versions yet"]


def format_proposals(state: dict[str, Any]) -> list[str]:
    lines = []
    for item in state.get("proposals") or []:
        roll = f", roll back to step {item['rollback_to']}" if item.get("rollback_to") is not None else ""
        lines.append(f"#{item['id']} {item['status']:<9} {item['rule']} at step {item['step']}: {item['evidence']}"
                     f" -> {_words(item['values']) or 'no change suggested'}{roll}")
    return lines or ["no proposals"]


def _words(values: dict[str, Any]) -> str:
    return ", ".join(f"{name}={value!r}" for name, value in values.items())


def _login() -> str:
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "user"
