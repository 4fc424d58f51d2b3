"""An agent leaving a job that goes on removes its own node's segments only; the job's end removes them all."""

from __future__ import annotations

import secrets

from convoy.shm import SHM_DIR, remove_segments


def test_a_node_leaving_takes_only_its_own_segments_and_lease() -> None:
    job = f"t{secrets.token_hex(4)}"
    names = ["ray-a-local0", "ray-a-trainer1", "lease-ray-a", "ray-ab-local0", "ray-b-local0", "lease-ray-b", "ps0"]
    for name in names:
        (SHM_DIR / f"convoy-{job}-{name}").write_bytes(b"x")
    try:
        removed = {path.name.removeprefix(f"convoy-{job}-") for path in remove_segments(job, "ray-a")}
        assert removed == {"ray-a-local0", "ray-a-trainer1", "lease-ray-a"}
        left = {path.name.removeprefix(f"convoy-{job}-") for path in remove_segments(job)}
        assert left == {"ray-ab-local0", "ray-b-local0", "lease-ray-b", "ps0"}
    finally:
        remove_segments(job)
