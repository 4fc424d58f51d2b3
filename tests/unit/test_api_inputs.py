"""Issue 25, item 6 and item 5 (the pure parts): what the control plane accepts from flags and the wire, and how
it prints what came over the wire."""

from __future__ import annotations

import os
import random
import stat
from pathlib import Path

import pytest
from pydantic import ValidationError

from convoy.config import MAX_NPROC_PER_NODE, MasterConfig, RendezvousConfig, WorkerConfig, check_run_dir, parse_address
from convoy.control.api import bearer_token
from convoy.control.protocol import messages as p
from convoy.control.protocol.client import FIRST_BACKOFF_S, jittered
from convoy.control.status import format_status
from convoy.control.token import write_token
from convoy.errors import ConfigError
from convoy.sanitize import printable

NOT_FINITE = [float("nan"), float("inf"), float("-inf")]


@pytest.mark.parametrize("value", NOT_FINITE)
@pytest.mark.parametrize("field", ["heartbeat_timeout_s", "rdzv_wait", "join_timeout", "stop_grace"])
def test_timeout_flags_refuse_nan_and_inf(tmp_path: Path, field: str, value: float) -> None:
    flag = {"heartbeat_timeout_s": "--heartbeat-timeout", "rdzv_wait": "--rdzv-wait", "join_timeout": "--join-timeout",
            "stop_grace": "--stop-grace"}[field]
    with pytest.raises(ConfigError, match=flag):
        if field == "stop_grace":
            WorkerConfig(entrypoint="x", stop_grace_s=value).validate(need_entrypoint=False)
        elif field == "heartbeat_timeout_s":
            MasterConfig(run_dir=tmp_path / "r", heartbeat_timeout_s=value).validate()
        else:
            rendezvous = RendezvousConfig(1, 1, **({"wait_s": value} if field == "rdzv_wait"
                                                   else {"join_timeout_s": value}))
            MasterConfig(run_dir=tmp_path / "r", rendezvous=rendezvous).validate()


def test_nproc_per_node_is_capped_and_the_error_says_the_cap() -> None:
    WorkerConfig(nproc_per_node=MAX_NPROC_PER_NODE).validate(need_entrypoint=False)
    with pytest.raises(ConfigError, match=f"1 to {MAX_NPROC_PER_NODE}"):
        WorkerConfig(nproc_per_node=1_000_000_000).validate(need_entrypoint=False)


@pytest.mark.parametrize("nproc", ["true", '"3"', "2.0"])
def test_the_wire_takes_no_coerced_integers(nproc: str) -> None:
    body = f'{{"node_id": "n1", "host": "h", "nproc": {nproc}, "port": 5}}'
    assert p.JoinRequest.model_validate_json(body.replace(nproc, "2")).nproc == 2
    with pytest.raises(ValidationError):
        p.JoinRequest.model_validate_json(body, strict=True)


@pytest.mark.parametrize("node_id", ["a\nconvoy: job succeeded", "x\x1b[2J", "tab\tid", "", " lead", "ü"])
def test_node_ids_outside_the_safe_charset_are_refused(node_id: str) -> None:
    with pytest.raises(ValidationError):
        p.JoinRequest(node_id=node_id, host="h", nproc=1, port=5)


@pytest.mark.parametrize("host", ["h\nforged", "h o", "a;b", "x\x00"])
def test_hosts_outside_the_safe_charset_are_refused(host: str) -> None:
    with pytest.raises(ValidationError):
        p.JoinRequest(node_id="n1", host=host, nproc=1, port=5)
    p.JoinRequest(node_id="gpu-7.rack_2@dc+1", host="[fe80::1%eth0]", nproc=1, port=5)


@pytest.mark.parametrize("spec", ["http://10.0.0.5:29400", "10.0.0.5:29400/x", "a b:1", "host:0", "host:"])
def test_a_malformed_master_address_is_a_config_error(spec: str) -> None:
    with pytest.raises(ConfigError, match="HOST:PORT"):
        parse_address(spec)
    assert parse_address("[::1]:29400") == ("::1", 29400)


def test_bearer_scheme_is_case_insensitive() -> None:
    assert bearer_token("bearer abc") == bearer_token("BEARER abc") == bearer_token("Bearer  abc ") == "abc"
    assert bearer_token("Basic abc") == bearer_token("abc") == ""


def test_status_escapes_what_came_from_the_wire() -> None:
    state = {"job": {"job_id": "j", "status": "running", "round_id": 1, "restart_count": 0, "max_restarts": 3,
                     "min_nodes": 1, "max_nodes": 1, "master_url": "127.0.0.1:1", "outcome": ""},
             "round": None,
             "nodes": [{"node_id": "n\x1b[31m", "node_rank": 0, "host": "h\rforged", "nproc": 1, "state": "alive",
                        "last_seen": None}],
             "events": [{"ts": None, "kind": "leave", "message": "left (\x1b]0;title\x07)"}]}
    text = format_status(state)
    assert "\x1b" not in text and "\r" not in text and "\x07" not in text
    assert "n\\x1b[31m" in text and "\\x07" in text
    assert printable("a\nb", keep_lines=True) == "a\nb" and printable("a\nb") == "a\\nb"


def test_retry_pauses_are_jittered_within_half_to_one_and_a_half_of_the_backoff() -> None:
    rng = random.Random(1)
    pauses = [jittered(FIRST_BACKOFF_S, rng) for _ in range(200)]
    assert all(0.5 * FIRST_BACKOFF_S <= pause < 1.5 * FIRST_BACKOFF_S for pause in pauses)
    assert len({round(pause, 6) for pause in pauses}) > 150  # agents that lost the master together spread out


def test_a_run_dir_others_can_write_is_refused_unless_sticky_and_ours(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ConfigError, match="writable by others"):
        check_run_dir(shared)
    shared.chmod(0o1777)  # sticky and owned by us (as /tmp is for root): others cannot replace our files
    check_run_dir(shared)
    fresh = tmp_path / "fresh" / "run"
    check_run_dir(fresh)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700


def test_the_token_is_never_written_through_a_link_or_over_a_file(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    link = tmp_path / "token"
    link.symlink_to(victim)
    with pytest.raises(ConfigError, match="already exists"):
        write_token(link)
    assert victim.read_text() == "precious\n" and link.is_symlink()
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nothing-here")
    with pytest.raises(ConfigError, match="already exists"):
        write_token(dangling)
    assert not (tmp_path / "nothing-here").exists()
    fresh = tmp_path / "fresh-token"
    token = write_token(fresh)
    assert fresh.read_text().strip() == token and stat.S_IMODE(os.stat(fresh).st_mode) == 0o600
