"""The worker's side of parameter-server training: pull what a batch needs (the dense tensors and only the rows
of the batch's ids), push gradients without waiting for them to be applied, and wait only when a staleness bound
says so: a pull returns once each server has applied all but ``staleness`` of this worker's pushes (0: every
push, so one worker trains as one process would). Given ``follow``, a worker goes on through a server's kill and
restore: it waits for the server's next incarnation and resends the pushes that server had not kept (resume.py)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from convoy.errors import ConfigError, ConvoyError
from convoy.parallel.ps.optimizers import OptimizerSpec
from convoy.parallel.ps.placement import Placement
from convoy.parallel.ps.resume import FOLLOW_S, SERVICE, Follow, Found, Unkept, find_server
from convoy.parallel.ps.server import shard_of
from convoy.parallel.transport import Connection, ConnectionLost, Credentials, Message


@dataclass
class Pulled:
    """What one pull brought: whole dense tensors, and per table the distinct ids asked for with their rows."""

    dense: dict[str, torch.Tensor]
    ids: dict[str, torch.Tensor]
    """Per table, the batch's distinct row ids, sorted; ``rows[table][i]`` is row ``ids[table][i]``."""
    rows: dict[str, torch.Tensor]
    versions: list[int]
    """Each server's version (pushes applied from all workers) when it answered."""
    applied: list[int]
    """This worker's pushes each server had applied when it answered."""
    pushed: list[int]
    """This worker's pushes sent (or queued) to each server when it pulled; ``pushed[s] - applied[s] <= staleness``."""


@dataclass(frozen=True)
class Tally:
    """One server's count of tagged pushes (``PSClient.tally``)."""

    tags: list[int]
    """The tags applied, ascending: a run that trains each batch once has every batch's index here once."""
    duplicates: int
    """Pushes skipped because their tag was applied already (data trained again after a shard was given back)."""
    version: int

    def exactly_once(self, expected: int) -> tuple[list[int], list[int]]:
        """(the tags in 0..expected-1 missing, the tags outside that range) against an epoch of ``expected``."""
        held = set(self.tags)
        return [t for t in range(expected) if t not in held], [t for t in self.tags if not 0 <= t < expected]


class _Pusher:
    """Sends one server's pushes in order from a background thread, so that ``push`` returns at once; trims
    ``unkept`` (if given) by what each reply says the server has kept."""

    def __init__(self, address: str, credentials: Credentials, unkept: Unkept | None = None) -> None:
        self.connection = Connection(address, credentials=credentials, service=SERVICE)
        self.unkept = unkept
        self.pending: queue.Queue[Message | None] = queue.Queue()
        self.failure: Exception | None = None
        self.thread = threading.Thread(target=self._run, name="ps-push", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            message = self.pending.get()
            try:
                if message is None:
                    return
                if self.failure is None:
                    reply = self.connection.request(message)
                    if self.unkept is not None and "kept" in reply.meta:
                        self.unkept.trim(int(reply.meta["kept"]))
            except ConvoyError as exc:  # lost, refused (a stale worker), or an error reply: raised on the next call
                self.failure = exc
            finally:
                self.pending.task_done()

    def stop(self) -> None:
        self.pending.put(None)
        self.thread.join()
        self.connection.close()


class PSClient:
    """One worker's links to every parameter server of ``placement`` (``addresses[s]`` is server ``s``). With
    ``follow`` (the servers' current addresses), a lost server is waited for (``follow_s``) and its unkept pushes
    resent; ``resent``, ``lost`` (per server) and ``moves`` ((server, old, new) addresses) count what happened.
    ``credentials``: what the servers must see (default: this process's, from its agent)."""

    def __init__(self, placement: Placement, addresses: list[str], worker: str, staleness: int = 0,
                 follow: Follow | None = None, follow_s: float = FOLLOW_S,
                 credentials: Credentials | None = None) -> None:
        if staleness < 0:
            raise ConfigError(f"parameter-server staleness bound must be >= 0 (got {staleness}); use 0 for "
                              f"synchronous training or s > 0 to let a worker run s pushes ahead")
        if len(addresses) != placement.num_servers:
            raise ConfigError(f"the placement has {placement.num_servers} parameter servers but "
                              f"{len(addresses)} addresses were given; pass one address per server")
        self.placement, self.worker, self.staleness = placement, worker, staleness
        self.addresses = list(addresses)
        self.credentials = credentials or Credentials.from_env()
        self.requests = [Connection(address, credentials=self.credentials, service=SERVICE) for address in addresses]
        self.pushed = 0
        self.pushed_to = [0] * placement.num_servers
        """Pushes each server should have from this worker (a restored server may have fewer than ``pushed``)."""
        self.pool = ThreadPoolExecutor(max_workers=placement.num_servers, thread_name_prefix="ps-pull")
        self.follow, self.follow_s = follow, follow_s
        self.unkept = [Unkept() for _ in addresses]
        self.resent = [0] * placement.num_servers
        self.lost = [0] * placement.num_servers
        self.moves: list[tuple[int, str, str]] = []
        self.pushers = [_Pusher(address, self.credentials, self._log(s)) for s, address in enumerate(addresses)]
        # a worker started again under its predecessor's id goes on from the count that one left on each server,
        # so that its staleness bound and its resends after a server's restore count from there
        self.pushed_to = self.applied()

    def _log(self, server: int) -> Unkept | None:
        return self.unkept[server] if self.follow is not None else None

    def _all(self, messages: list[Message] | Callable[[int], Message]) -> list[Message]:
        """Send ``messages[s]`` (or ``messages(s)``, built again after a server was found anew) to server ``s``,
        all at once, and return the replies in order."""
        make = messages if callable(messages) else messages.__getitem__
        self._raise_push_failure()
        replies: list[Message | None] = [None] * len(self.requests)
        todo = list(range(len(self.requests)))
        while todo:
            answers = list(self.pool.map(lambda s: self._ask(s, make(s)), todo))
            lost = []
            for server, answer in zip(todo, answers, strict=True):
                if isinstance(answer, ConnectionLost):
                    lost.append(server)
                else:
                    replies[server] = answer
            for server in lost:
                self._find_again(server)
            todo = lost
        return [reply for reply in replies if reply is not None]

    def _ask(self, server: int, message: Message) -> Message | ConnectionLost:
        try:
            return self.requests[server].request(message)
        except ConnectionLost as exc:
            if self.follow is None:
                raise
            return exc

    def _raise_push_failure(self) -> None:
        for server, pusher in enumerate(self.pushers):
            if isinstance(pusher.failure, ConnectionLost) and self.follow is not None:
                self._find_again(server)
            elif pusher.failure is not None:
                raise pusher.failure

    def _find_again(self, server: int) -> None:
        """Server ``server`` went away: wait for its next incarnation, then resend what it had not kept."""
        self.requests[server].close()
        self.pushers[server].stop()
        assert self.follow is not None
        found = find_server(self.follow, server, self.worker, self.addresses[server], self.credentials, self.follow_s)
        if found.address != self.addresses[server]:
            self.moves.append((server, self.addresses[server], found.address))
        self._resume(server, found)

    def _resume(self, server: int, found: Found) -> None:
        self.addresses[server], self.requests[server] = found.address, found.connection
        resend, lost = self.unkept[server].resume(found.applied, self.pushed_to[server])
        self.pushed_to[server] = found.applied + len(resend)
        self.resent[server] += len(resend)
        self.lost[server] += lost
        self.pushers[server] = _Pusher(found.address, self.credentials, self._log(server))
        for message in resend:
            self.pushers[server].pending.put(message)

    def setup(self, optimizer: OptimizerSpec, dense: Mapping[str, torch.Tensor],
              tables: Mapping[str, torch.Tensor]) -> None:
        """Give every server its shard of a whole model (the chief does this once, before training)."""
        optimizer.validate()
        messages = []
        for index in range(self.placement.num_servers):
            mine, rows = shard_of(self.placement, index, dense, tables)
            tensors = {f"dense/{n}": t for n, t in mine.items()} | {f"rows/{n}": t for n, t in rows.items()}
            messages.append(Message("setup", {"index": index, "placement": self.placement.to_dict(),
                                              "optimizer": optimizer.to_dict()}, tensors))
        self.flush()  # what this worker pushed to the shards being replaced is done with
        self._all(messages)
        for server in range(self.placement.num_servers):  # a new shard holds no one's pushes: count from 0
            self.unkept[server].trim(self.pushed_to[server])
            self.pushed_to[server] = 0

    def pull(self, ids: Mapping[str, torch.Tensor]) -> Pulled:
        """The dense tensors and the rows of ``ids`` (per table, any shape, repeats allowed)."""
        unique = {}
        for table, wanted in ids.items():
            spec = self.placement.check_table(table)
            flat = wanted.reshape(-1).to(torch.int64)
            if len(flat) and (int(flat.min()) < 0 or int(flat.max()) >= spec.num_rows):
                bad = flat[(flat < 0) | (flat >= spec.num_rows)][0]
                raise ConfigError(f"row id {int(bad)} of table {table!r} is outside 0..{spec.num_rows - 1}; "
                                  f"map the feature's values into the table first")
            unique[table] = torch.unique(flat)
        wanted = [{f"ids/{t}": self.placement.local_rows(u[self.placement.owner_of_rows(u) == server])
                   for t, u in unique.items()} for server in range(self.placement.num_servers)]
        replies = self._all(lambda server: Message(  # at_least read when sent: a restore may change it
            "pull", {"worker": self.worker, "at_least": self.pushed_to[server] - self.staleness}, wanted[server]))
        dense: dict[str, torch.Tensor] = {}
        rows = {t: torch.empty(len(u), self.placement.tables[t].dim) for t, u in unique.items()}
        for server, reply in enumerate(replies):
            for name, tensor in reply.tensors.items():
                kind, _, key = name.partition("/")
                if kind == "dense":
                    dense[key] = tensor
                else:
                    rows[key][self.placement.owner_of_rows(unique[key]) == server] = tensor
        return Pulled(dense, unique, rows, [r.meta["version"] for r in replies],
                      [r.meta["applied"] for r in replies], list(self.pushed_to))

    def push(self, dense_grads: Mapping[str, torch.Tensor],
             row_grads: Mapping[str, tuple[torch.Tensor, torch.Tensor]], tag: int | None = None) -> None:
        """Queue one step's gradients (dense by name; per table, row ids and one gradient row each) to every
        server and return without waiting for them to be applied. ``tag`` names the data they came from (a
        batch's index): a server applies each tag once (server.py)."""
        self._raise_push_failure()
        for name, grad in dense_grads.items():
            if name not in self.placement.dense:
                raise ConfigError(f"no dense tensor {name!r} on the parameter servers (they hold "
                                  f"{sorted(self.placement.dense)}); push gradients of placed tensors only")
            want = self.placement.dense[name].shape
            if tuple(grad.shape) != want:
                raise ConfigError(f"gradient of {name!r} has shape {list(grad.shape)}, the tensor is {list(want)};"
                                  f" push the gradient of that tensor")
        split: list[dict[str, torch.Tensor]] = [{} for _ in range(self.placement.num_servers)]
        for name, grad in dense_grads.items():
            split[self.placement.dense_owner[name]][f"dense/{name}"] = grad
        for table, (ids, grads) in row_grads.items():
            spec = self.placement.check_table(table)
            ids = ids.to(torch.int64)
            if tuple(grads.shape) != (len(ids), spec.dim):
                raise ConfigError(f"gradient rows of table {table!r} have shape {list(grads.shape)}, expected "
                                  f"[{len(ids)}, {spec.dim}] (one row of width {spec.dim} per id)")
            if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= spec.num_rows):
                raise ConfigError(f"a gradient row of table {table!r} names a row outside 0..{spec.num_rows - 1};"
                                  f" push gradients only for rows that were pulled")
            owner = self.placement.owner_of_rows(ids)
            for server in range(self.placement.num_servers):
                mask = owner == server
                split[server][f"ids/{table}"] = self.placement.local_rows(ids[mask])
                split[server][f"grads/{table}"] = grads[mask]
        for server, tensors in enumerate(split):
            tensors = {name: t.detach().clone() for name, t in tensors.items()}
            meta: dict[str, object] = {"worker": self.worker} if tag is None else {"worker": self.worker, "tag": tag}
            message = Message("push", meta, tensors)
            self.pushed_to[server] += 1
            if self.follow is not None:
                self.unkept[server].add(self.pushed_to[server], message)
            self.pushers[server].pending.put(message)
        self.pushed += 1

    def flush(self) -> None:
        """Wait until every queued push has been applied (resent to a server that came back, with ``follow``)."""
        while True:
            for pusher in self.pushers:
                pusher.pending.join()
            if all(pusher.failure is None for pusher in self.pushers):
                return
            self._raise_push_failure()

    def snapshot(self, persist: bool = False) -> list[int]:
        """Every server snapshots its shard in memory (``persist``: and saves it to its checkpoint directory);
        returns the versions they hold. The chief calls this every few steps; a worker, at its end, so that a
        server killed after it left keeps all of its pushes."""
        replies = self._all(lambda s: Message("snapshot", {"persist": persist, "worker": self.worker}))
        for server, reply in enumerate(replies):
            self.unkept[server].trim(int(reply.meta["kept"]))
        return [int(reply.meta["version"]) for reply in replies]

    def applied(self) -> list[int]:
        """This worker's pushes each server holds now."""
        return [int(reply.meta["applied"]) for reply in self._all(lambda s: Message("status", {"worker": self.worker}))]

    def ready(self) -> list[bool]:
        """Whether each server holds its shard (set up, or restored): a chief started again must not set it up anew."""
        return [bool(reply.meta["ready"]) for reply in self._all(lambda s: Message("status", {"worker": self.worker}))]

    def tally(self) -> list[Tally]:
        """What each server holds of the tagged pushes: the tags applied and the repeats it skipped."""
        return [Tally(reply.tensors["tags"].tolist(), int(reply.meta["duplicates"]), int(reply.meta["version"]))
                for reply in self._all(lambda s: Message("tags"))]

    def save(self, directory: Path) -> None:
        """Each server writes its shard to ``directory/ps-<index>.pt`` (after this worker's pushes so far)."""
        self.flush()
        self._all([Message("save", {"path": str(directory / f"ps-{index}.pt")})
                   for index in range(self.placement.num_servers)])

    def server_pids(self) -> list[int]:
        return [reply.meta["pid"] for reply in self._all([Message("status", {"worker": self.worker})
                                                           for _ in self.requests])]

    def reconnect(self, server: int, address: str, restore_from: Path | None = None) -> None:
        """Point at server ``server``'s new process (optionally telling it to load its shard file), and count
        this worker's pushes as the restored shard does."""
        self.requests[server].close()
        self.pushers[server].stop()
        connection = Connection(address, credentials=self.credentials, service=SERVICE)
        if restore_from is not None:
            connection.request(Message("restore", {"path": str(restore_from)}))
        status = connection.request(Message("status", {"worker": self.worker}))
        self._resume(server, Found(connection, address, int(status.meta["applied"]), int(status.meta.get("kept", 0))))

    def shutdown_servers(self) -> None:
        """Stop every server process (the last worker does this at the end of training)."""
        self.flush()
        self._all([Message("shutdown") for _ in self.requests])

    def close(self) -> None:
        for pusher in self.pushers:
            pusher.stop()
        for connection in self.requests:
            connection.close()
        self.pool.shutdown()
