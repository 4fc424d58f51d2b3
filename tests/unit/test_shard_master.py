"""The master's shard endpoints over real HTTP, the queues' position kept in the state file across a master
rebuilt from it, and RoleMaster's exits giving a process's unfinished shard back (an old incarnation's late
report counting nothing)."""

from __future__ import annotations

from pathlib import Path

import pytest

from convoy.config import MasterConfig, RendezvousConfig
from convoy.control.job import Job
from convoy.control.master import JobMaster
from convoy.control.protocol import messages as p
from convoy.control.protocol import shards as sp
from convoy.control.protocol.client import MasterClient
from convoy.control.rendezvous import Rendezvous
from convoy.control.roles.master import RoleMaster
from convoy.control.shards.master import STATE_PART, ShardMaster
from convoy.control.store import read_part, read_status
from convoy.errors import ConfigError, ConflictError
from convoy.roles_config import RoleSpec, parse_count


def start_master(run_dir: Path, resume: bool = False) -> JobMaster:
    config = MasterConfig(host="127.0.0.1", port=0, run_dir=run_dir, rendezvous=RendezvousConfig(1, 1, 0, 60))
    config.validate(resume=resume)
    master = JobMaster(config, console=lambda line: None, resume=resume)
    master.start()
    return master


def client_of(master: JobMaster) -> MasterClient:
    host, port = master.api.address
    return MasterClient(host, port, master.token, 5.0)


def who(rank: int, incarnation: int = 1, name: str = "train") -> dict[str, object]:
    return {"name": name, "role": "default", "rank": rank, "incarnation": incarnation}


def declare(client: MasterClient, rank: int, size: int = 100, num_shards: int = 4) -> sp.ShardDeclared:
    request = sp.ShardDeclare(**who(rank), dataset=sp.DatasetSpec(kind="range", size=size), num_shards=num_shards)
    return client.call("/shards/declare", request, sp.ShardDeclared)


def request(client: MasterClient, rank: int) -> sp.ShardGrant:
    return client.call("/shards/request", sp.ShardRequest(**who(rank)), sp.ShardGrant)


def progress(client: MasterClient, rank: int, grant: sp.ShardGrant, through: int) -> sp.ShardAck:
    return client.call("/shards/progress", sp.ShardProgress(**who(rank), grant_id=grant.grant_id,
                                                            trained_through=through), sp.ShardAck)


def test_declare_is_idempotent_and_a_different_declaration_names_both(tmp_path: Path) -> None:
    master = start_master(tmp_path / "run")
    try:
        client = client_of(master)
        assert declare(client, 0) == sp.ShardDeclared(name="train", declared_by="default:0:1", first=True)
        assert declare(client, 1) == sp.ShardDeclared(name="train", declared_by="default:0:1", first=False)
        with pytest.raises(ConflictError, match=r"declared by default:0:1 as 100 sample indices in 4 shards.*but "
                                                r"default:1:1 declares it as 100 sample indices in 5 shards"):
            declare(client, 1, num_shards=5)
        with pytest.raises(ConflictError, match="cannot cut 3 range items into 4 shards"):
            client.call("/shards/declare", sp.ShardDeclare(**who(0, name="small"), num_shards=4,
                                                           dataset=sp.DatasetSpec(kind="range", size=3)),
                        sp.ShardDeclared)
        kinds = [e["kind"] for e in read_status(tmp_path / "run", recent=100)["events"]]
        assert kinds.count("shards_declared") == 1 and "shards_conflict" in kinds
    finally:
        master.stop()


def test_the_position_survives_a_master_rebuilt_from_its_state_file(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    master = start_master(run_dir)
    client = client_of(master)
    declare(client, 0)
    first = request(client, 0)
    assert (first.status, first.shard_id, first.start, first.stop) == ("assigned", 0, 0, 25)
    progress(client, 0, first, 10)
    second = request(client, 1)
    client.call("/shards/done", sp.ShardDone(**who(1), grant_id=second.grant_id), sp.ShardAck)
    master.stop()
    assert '"pending": [[2, 50, 75], [3, 75, 100]]' in (read_part(run_dir, STATE_PART) or "")

    again = start_master(run_dir, resume=True)
    try:
        client = client_of(again)
        queue = again.shards.queues["train"].queue
        assert queue.samples_trained == 35 and queue.done_ids == {1}, "10 reported + shard 1 done"
        assert request(client, 0) == sp.ShardGrant(status="assigned", epoch=0, grant_id=first.grant_id, shard_id=0,
                                                   start=10, stop=25), "the holder keeps its shard and position"
        third = request(client, 2)
        assert (third.shard_id, third.start, third.grant_id) == (2, 50, 2), "the queue goes on where it was"
        progress(client, 0, first, 25)  # a report of the grant handed out before the restart counts
        assert queue.held["default:0:1"].shard.start == 25
    finally:
        again.stop()


def test_plain_workers_of_an_ended_round_give_their_shards_back() -> None:
    shard_master = ShardMaster()
    spec = sp.DatasetSpec(kind="seeds", size=6, first_seed=100)
    shard_master.call(sp.ShardDeclare(**who(0), dataset=spec, num_shards=3), plain_round=1)
    held = shard_master.call(sp.ShardRequest(**who(0)), plain_round=1).reply
    assert isinstance(held, sp.ShardGrant) and held.start == 0
    answer = shard_master.call(sp.ShardRequest(**who(0, incarnation=2)), plain_round=2)
    assert [e.kind for e in answer.events] == ["shard_requeued", "shard_assigned"]
    assert "default:0:1 ended with round 1" in answer.events[0].message
    assert isinstance(answer.reply, sp.ShardGrant) and (answer.reply.shard_id, answer.reply.start) == (0, 0)


def test_a_malformed_state_is_refused() -> None:
    with pytest.raises(ConfigError, match="malformed"):
        ShardMaster.from_state_json('{"train": {"queue": {}}}')
    assert ShardMaster.from_state_json(None).queues == {}


def role_job(count: str = "2") -> tuple[RoleMaster, ShardMaster, dict[int, p.RoleAssignment]]:
    """Two running workers of a role of ``count`` processes, its exits hooked to a ShardMaster."""
    job = Job("j1", Rendezvous(1, 1, 0.0, 0.0), max_restarts=3, join_timeout_s=60)
    job.join("n0", "127.0.0.1", 1, 1000, 0.0)
    roles = RoleMaster(job, (RoleSpec("worker", count=parse_count(count)),), max_restarts=3)
    shard_master = ShardMaster()
    roles.exit_hooks.append(shard_master.process_exited)
    roles.advance()
    if count != "2":
        roles.scale("worker", 2)
    assignments = {a.rank: a for a in roles.deliver("n0", 0.0)[0]}
    for a in assignments.values():
        roles.report(p.RoleReport(node_id="n0", role="worker", rank=a.rank, incarnation=a.incarnation,
                                  state="started", address="127.0.0.1:1"))
    return roles, shard_master, assignments


def as_worker(a: p.RoleAssignment) -> dict[str, object]:
    return {"name": "train", "role": a.role, "rank": a.rank, "incarnation": a.incarnation}


def test_a_killed_role_process_gives_back_the_rest_of_its_shard_and_its_late_report_counts_nothing() -> None:
    roles, shard_master, assignments = role_job()
    one = assignments[1]
    shard_master.declare(sp.ShardDeclare(**as_worker(one), dataset=sp.DatasetSpec(kind="range", size=20),
                                         num_shards=2))
    grant = shard_master.request(sp.ShardRequest(**as_worker(one))).reply
    assert isinstance(grant, sp.ShardGrant)
    shard_master.report(sp.ShardProgress(**as_worker(one), grant_id=grant.grant_id, trained_through=4))
    events = roles.report(p.RoleReport(node_id="n0", role="worker", rank=1, incarnation=one.incarnation,
                                       state="exited", signal="SIGKILL"))
    requeued = [e.message for e in events if e.kind == "shard_requeued"]
    assert requeued and f"worker:1:{one.incarnation} was killed by SIGKILL" in requeued[0] and "[4, 10)" in requeued[0]
    assert not roles.is_running("worker", 1, one.incarnation), "its calls no longer count"
    new = next(a for a in roles.deliver("n0", 10.0)[0] if a.rank == 1)
    assert new.incarnation != one.incarnation and roles.is_running("worker", 1, new.incarnation)
    regrant = shard_master.request(sp.ShardRequest(**as_worker(new))).reply
    assert isinstance(regrant, sp.ShardGrant) and (regrant.shard_id, regrant.start) == (0, 4)
    late = shard_master.report(sp.ShardDone(**as_worker(one), grant_id=grant.grant_id))
    assert late.reply is None and "holds no shard" in late.refusal, "the old incarnation's late done is refused"
    assert shard_master.queues["train"].queue.held[f"worker:1:{new.incarnation}"].shard.start == 4


def test_a_finished_or_scaled_away_process_gives_back_what_it_did_not_report() -> None:
    roles, shard_master, assignments = role_job("1:2")
    zero = assignments[0]
    shard_master.declare(sp.ShardDeclare(**as_worker(zero), dataset=sp.DatasetSpec(kind="range", size=20),
                                         num_shards=2))
    shard_master.request(sp.ShardRequest(**as_worker(zero)))
    events = roles.report(p.RoleReport(node_id="n0", role="worker", rank=0, incarnation=zero.incarnation,
                                       state="exited", exitcode=0))
    assert "shard_requeued" in [e.kind for e in events] and not roles.is_running("worker", 0, zero.incarnation)
    one = assignments[1]
    shard_master.request(sp.ShardRequest(**as_worker(one)))
    roles.scale("worker", 1)  # rank 1 is stopped; its exit report gives the shard back
    events = roles.report(p.RoleReport(node_id="n0", role="worker", rank=1, incarnation=one.incarnation,
                                       state="exited", signal="SIGTERM"))
    assert "shard_requeued" in [e.kind for e in events]
    assert [s.shard_id for s in shard_master.queues["train"].queue.pending] == [0, 1]
