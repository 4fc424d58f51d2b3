"""``convoy scale --run-dir D ROLE=COUNT``: ask a running job's master to run COUNT processes of a role."""

from __future__ import annotations

import argparse
import json

from convoy.errors import ConfigError, ConvoyError


def scale_roles(args: argparse.Namespace) -> int:
    """Ask the running job's master (its address in the run dir's state, its token beside it) to scale roles."""
    from convoy.agent.client import MasterClient
    from convoy.config import MasterConfig
    from convoy.control import protocol as p
    from convoy.control.store import read_status
    from convoy.control.token import TOKEN_FILE, read_token

    requests = []
    for spec in args.counts:
        role, sep, count = spec.partition("=")
        if not sep or not role.strip() or not count.strip().isdigit():
            raise ConfigError(f"{spec!r} is not ROLE=COUNT with a whole number, e.g. worker=4")
        requests.append(p.ScaleRequest(role=role.strip(), count=int(count)))
    job = read_status(args.run_dir, recent=0)["job"]
    if job is None or job["status"] != "running":
        state = "has no job state yet" if job is None else f"holds a job that has {job['status']}"
        raise ConfigError(f"run dir {str(args.run_dir)!r} {state}: only a running job can be scaled")
    host, _, port = job["master_url"].rpartition(":")
    tls_ca = args.tls_ca if args.tls_ca is not None else MasterConfig.from_json(job["config"]).tls_cert
    client = MasterClient(host, int(port), read_token(args.run_dir / TOKEN_FILE), give_up_after_s=5.0,
                          tls_ca=tls_ca)
    for request in requests:
        try:
            client.call("/scale", request, p.Ack)
        except ConvoyError as exc:  # a 409 carries the master's reason as {"error": ...}: say just that
            _, _, body = str(exc).partition("to /scale: ")
            try:
                reason = json.loads(body)["error"]
            except (ValueError, KeyError, TypeError):
                raise exc from None
            raise ConfigError(f"cannot scale role {request.role} to {request.count}: {reason}") from None
        print(f"convoy: role {request.role} of job {job['job_id']} scaled to {request.count}", flush=True)
    return 0
