"""``convoy scale --run-dir D ROLE=COUNT``: ask a running job's master to run COUNT processes of a role."""

from __future__ import annotations

import argparse
import json

from convoy.errors import ConfigError, ConvoyError


def scale_roles(args: argparse.Namespace) -> int:
    """Ask the running job's master (its address in the run dir's state, its token beside it) to scale roles."""
    from convoy.cli.live_config import job_client
    from convoy.control.protocol import messages as p

    requests = []
    for spec in args.counts:
        role, sep, count = spec.partition("=")
        if not sep or not role.strip() or not count.strip().isdigit():
            raise ConfigError(f"{spec!r} is not ROLE=COUNT with a whole number, e.g. worker=4")
        requests.append(p.ScaleRequest(role=role.strip(), count=int(count)))
    client, job = job_client(args.run_dir, args.tls_ca)
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
