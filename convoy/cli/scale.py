"""``convoy scale --run-dir D ROLE=COUNT``: ask a running job's master to run COUNT processes of a role."""

from __future__ import annotations

import argparse

from convoy.errors import ConfigError, ConflictError


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
        except ConflictError as exc:  # the master's reason, without who answered
            raise ConfigError(f"cannot scale role {request.role} to {request.count}: {exc.reason}") from None
        print(f"convoy: role {request.role} of job {job['job_id']} scaled to {request.count}", flush=True)
    return 0
