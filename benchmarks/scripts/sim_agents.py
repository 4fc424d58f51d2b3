"""Simulated agents for measuring the control plane at scale (``benchmarks/scale.py``): N agents as coroutines of
one event loop, each speaking the agent's protocol to a real master over real HTTP with the job's token on a
keep-alive connection of its own, as ``MasterClient`` does: join, long-poll ``/wait`` until its round is ready,
then heartbeat (a long poll of the agent's ``heartbeat_s``) until told to go silent or to stop. The master cannot
tell them from agents on other hosts; they start no workers. As the agent, each offers a port for the next round
in its ``/wait`` (``next_port``; nothing listens on it here, as no worker connects) and, told of a new round,
waits for it at once, joining only where the master answers "rejoin".

What is measured, per agent: when it held each round, and each heartbeat's round trip less the time the master was
asked to hold it (``late``: what a heartbeat waited beyond its long poll, the master's queue and work). Each
heartbeat polls as long as the master's last reply asked (``poll_s``), as the agent does.

Each agent accepts gzip, as ``MasterClient`` does. A round's membership (0.35 MB at 4096 nodes, 34 KB compressed) is
not decoded here: a real agent inflates and decodes its one copy on its own host, while 4096 decodes in this process
would be the simulator's time on the master's two cores. The bytes are still all received; the round and its state
are read from the reply's head. For the same reason the roles' addresses that end a job of roles' heartbeat replies
(the same bytes for every agent behind by the same waves) are decoded once for all the agents that get them and
shared, read-only (``_whole``); every reply is still inflated whole, and its own head decoded.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import re
import zlib
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from convoy.control.protocol import messages as p

HEARTBEAT_S = 1.0
"""The agent's default long poll (``AgentConfig.heartbeat_s``)."""
GIVE_UP_S = 30.0
FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.05, 1.0
"""As ``MasterClient``: how long a call is tried again on new connections, and its pauses."""
REPLY_BOUND = 1 << 20
"""The most a reply may hold (a round of 4096 members is about 0.5 MB)."""
DECODED_BOUND = 64 << 10
"""Replies longer than this are a round's membership: only their head is read."""
LOOK_S = 0.1
"""How often ``wait_for`` looks at the agents."""
SHARED_TAILS = (b',"address_changes":', b',"addresses":')
"""Where the roles' addresses begin in a heartbeat reply (the last members of its object, after the node's own)."""
KEPT_TAILS = 32
READY_HEAD = re.compile(rb'^\{"state":"(\w+)","job_status":"(\w+)","round":\{"job_id":"[^"]*","round_id":(\d+),')


class Link:
    """One keep-alive HTTP/1.1 connection to the master, reopened when it closes."""

    def __init__(self, host: str, port: int, token: str, keep_alive: bool = True, source: str = "",
                 whole: bool = False) -> None:
        """``keep_alive`` False: a connection per request (``Connection: close``), to tell the master's cost of
        held connections from the rest; ``source``: the address connections come from (each simulated host its
        own, as agents on other hosts have: the master bounds what one client address may hold); ``whole``:
        every reply is decoded (a job of roles: heartbeat replies carry orders and addresses)."""
        self.host, self.port, self.token, self.keep_alive = host, port, token, keep_alive
        self.source, self.whole = source, whole
        self.key = secrets.token_hex(6)
        self.calls = 0
        self.retries = 0
        """Requests sent again on a new connection (the master closed or shed the one they went on)."""
        self.streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def call(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """POST ``body`` to ``/v1{path}``: (status, the JSON reply)."""
        self.calls += 1
        data = json.dumps(body).encode()
        head = (f"POST {p.API_PREFIX}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: "
                f"application/json\r\nAccept-Encoding: gzip\r\n{p.TOKEN_HEADER}: Bearer {self.token}\r\n"
                f"{p.IDEMPOTENCY_HEADER}: "
                f"{self.key}-{self.calls}\r\nContent-Length: {len(data)}\r\n"
                f"{'' if self.keep_alive else 'Connection: close' + chr(13) + chr(10)}\r\n").encode()
        deadline, backoff = time.monotonic() + GIVE_UP_S, FIRST_BACKOFF_S
        while True:  # as MasterClient: a lost connection is tried again, with backoff, until GIVE_UP_S
            try:
                if self.streams is None:
                    self.streams = await asyncio.open_connection(
                        self.host, self.port, local_addr=(self.source, 0) if self.source else None)
                reader, writer = self.streams
                writer.write(head + data)
                await writer.drain()
                return await self._reply(reader)
            except (OSError, asyncio.IncompleteReadError, EOFError):
                self.close()
                self.retries += 1
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(backoff * (0.5 + random.random()))
                backoff = min(2 * backoff, MAX_BACKOFF_S)

    async def _reply(self, reader: asyncio.StreamReader) -> tuple[int, dict[str, Any]]:
        status_line = await reader.readline()
        if not status_line:
            raise EOFError("the master closed the connection")
        status = int(status_line.split()[1])
        length, closing, gzipped = 0, False, False
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
            elif name.strip().lower() == "connection" and value.strip().lower() == "close":
                closing = True
            elif name.strip().lower() == "content-encoding":
                gzipped = value.strip().lower() == "gzip"
        if length > REPLY_BOUND:
            raise ValueError(f"a reply of {length} bytes is past {REPLY_BOUND}")
        raw = await reader.readexactly(length) if length else b""
        if closing:
            self.close()
        return status, _decoded(raw, gzipped, self.whole)

    def close(self) -> None:
        if self.streams is not None:
            self.streams[1].close()
            self.streams = None


def _decoded(raw: bytes, gzipped: bool, whole: bool = False) -> dict[str, Any]:
    """The reply; of a round's membership, only its head. ``whole``: any other large reply is decoded whole (a job
    of roles' heartbeat replies may carry every process's address), else it is refused."""
    if gzipped:
        inflater = zlib.decompressobj(wbits=31)
        head = inflater.decompress(raw, DECODED_BOUND + 1)
        if whole and not inflater.eof and READY_HEAD.match(head) is None:
            head += inflater.decompress(inflater.unconsumed_tail)
        raw = head if inflater.eof else head + b"..."  # (a head only: longer than DECODED_BOUND)
    if whole and raw and READY_HEAD.match(raw) is None:
        return _whole(raw)
    if len(raw) <= DECODED_BOUND or (whole and READY_HEAD.match(raw) is None):
        return json.loads(raw) if raw else {}
    head = READY_HEAD.match(raw)
    if head is None:
        raise ValueError(f"a reply of {len(raw)} bytes is not a round's membership: {raw[:200]!r}")
    return {"state": head[1].decode(), "job_status": head[2].decode(), "round": {"round_id": int(head[3])}}


_TAILS: collections.OrderedDict[bytes, dict[str, Any]] = collections.OrderedDict()


def _whole(raw: bytes) -> dict[str, Any]:
    """A reply of a job of roles decoded: its own head here, the roles' addresses that end it once for every agent
    that gets the same bytes (a dict they share and never change). A real agent decodes its copy on its own host;
    here 4096 decodes of a wave (0.5 ms each, 2 ms with applying the changes) were 8 s of the simulator's core,
    which then answered the master's orders seconds late. A reply that does not split there is decoded whole."""
    for marker in SHARED_TAILS:
        at = raw.rfind(marker)
        if at > 0:
            break
    else:
        return json.loads(raw)
    tail = raw[at + 1:]
    try:
        reply = json.loads(raw[:at] + b"}")
        shared = _TAILS.get(tail)
        if shared is None:
            shared = _TAILS[tail] = json.loads(b"{" + tail)
            while len(_TAILS) > KEPT_TAILS:
                _TAILS.popitem(last=False)
    except ValueError:  # the marker was inside the head (an assignment's addresses): no shared part
        return json.loads(raw)
    return {**reply, **shared}


@dataclass
class SimAgent:
    """One agent: its main flow (join, wait for the round, hold it until the heartbeats say it moved on) and, from
    its first join on, its heartbeat loop on a connection of its own, as the agent's heartbeat thread."""

    node_id: str
    link: Link
    beats: Link
    heartbeat_s: float = HEARTBEAT_S
    rounds: dict[int, float] = field(default_factory=dict)
    """Each round this agent held, and when (monotonic)."""
    told: dict[int, float] = field(default_factory=dict)
    """When a heartbeat's reply first named each round (the news that the last one ended)."""
    joined_at: float = 0.0
    late: list[tuple[float, float]] = field(default_factory=list)
    """(when it was sent, its round trip less its long poll, never below 0) of each heartbeat."""
    last_beat: float = 0.0
    """When this agent last sent a heartbeat the master answered (the master hears it then)."""
    silent: bool = False
    stopped: bool = False
    error: str = ""
    known_round: int = 0
    """The round the master named in its last heartbeat reply (the agent's ``latest.round_id``)."""
    poll_s: float = 0.0
    """The poll the master asked for in its last heartbeat reply."""
    moved: asyncio.Event = field(default_factory=asyncio.Event)
    next_port = 29501
    """What it offers for the next round in its ``/wait`` (nothing listens there: no worker connects)."""

    async def run(self) -> None:
        beating: asyncio.Task[None] | None = None
        try:
            while not self.stopped:
                round_id = await self._rendezvous(max(self.rounds, default=0))
                if round_id is None:
                    return
                if beating is None:
                    beating = asyncio.ensure_future(self._heartbeats())
                while self.known_round <= round_id and not self.stopped:  # the round holds until the master moves on
                    self.moved.clear()
                    await self.moved.wait()
                    if beating.done():
                        beating.result()
        except Exception as exc:  # noqa: BLE001 (recorded: the benchmark says which agents failed and why)
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.close(beating)

    def close(self, beating: asyncio.Task[None] | None) -> None:
        """The end of ``run``: its heartbeat loop and both connections."""
        if beating is not None:
            beating.cancel()
        self.link.close()
        self.beats.close()

    async def _rendezvous(self, last_round: int) -> int | None:
        """Wait for the round after ``last_round`` if this agent was told of it (it offered a port for it), else
        join; long-poll until the round is ready; its id (None: the job ended)."""
        round_id = self.known_round if last_round and self.known_round > last_round else 0
        if not round_id:
            status, joined = await self.link.call("/join", {"node_id": self.node_id, "host": "127.0.0.1",
                                                            "nproc": 1, "port": 29500, "instance": self.link.key})
            if status != 200:
                raise RuntimeError(f"join answered {status}: {joined}")
            round_id = joined["round_id"]
        self.joined_at = self.joined_at or time.monotonic()
        while not self.stopped:
            asked = time.monotonic()
            poll = self.poll_s or self.heartbeat_s  # as the agent: as long as the master asks of heartbeats
            status, reply = await self.link.call("/wait", {"node_id": self.node_id, "round_id": round_id,
                                                           "timeout_s": poll, "next_port": self.next_port})
            if status != 200:
                raise RuntimeError(f"wait answered {status}: {reply}")
            if reply["state"] == "waiting":  # as the agent: an early answer, the rest of the poll waited here
                await asyncio.sleep(max(0.0, poll - (time.monotonic() - asked)))
            if reply["state"] == "ready":
                self.rounds[reply["round"]["round_id"]] = time.monotonic()
                return int(reply["round"]["round_id"])
            if reply["state"] == "ended":
                return None
            if reply["state"] == "rejoin":
                return await self._rendezvous(0)
        return None

    async def _heartbeats(self) -> None:
        """The heartbeat loop: long polls naming the round last heard of, until the job ends or this stops."""
        try:
            await self._beat()
        except Exception as exc:  # noqa: BLE001 (recorded, and the main flow ends)
            self.error = f"heartbeats: {type(exc).__name__}: {exc}"
            self.stopped = True
            self.moved.set()

    async def _beat(self) -> None:
        while not self.stopped:
            if self.silent:
                await asyncio.sleep(0.05)
                continue
            sent, wait_s = time.monotonic(), self.poll_s or self.heartbeat_s
            status, reply = await self.beats.call("/heartbeat", self.beat_body(wait_s))
            took = time.monotonic() - sent
            self.last_beat = sent
            if status != 200:
                raise RuntimeError(f"heartbeat answered {status}: {reply}")
            moved = reply["round_id"] != self.known_round or reply["job_status"] != "running"
            news = self.heard(reply) or moved
            self.late.append((sent, max(0.0, took - (0.0 if news else wait_s))))
            self.known_round, self.poll_s = int(reply["round_id"]), float(reply.get("poll_s", 0.0))
            if moved:
                self.told.setdefault(self.known_round, time.monotonic())
                self.moved.set()
            if reply["job_status"] != "running":
                self.stopped = True
                self.moved.set()
            elif not news:  # as the agent: an early answer without news, the rest of the poll waited here
                await asyncio.sleep(max(0.0, wait_s - took))

    def beat_body(self, wait_s: float) -> dict[str, Any]:
        return {"node_id": self.node_id, "round_id": self.known_round, "wait_s": wait_s}

    def heard(self, reply: dict[str, Any]) -> bool:
        """What a heartbeat reply pushed beyond the round and the job's status: whether it had news (none here)."""
        return False


def source_address(index: int) -> str:
    """A loopback address of its own for simulated host ``index`` (127.1.0.1, 127.1.0.2, ...: all of 127/8 is
    this machine's)."""
    return f"127.1.{index // 250}.{index % 250 + 1}"


class SimulatedAgents:
    """``count`` simulated agents on an event loop of their own thread; ``start`` joins them all at once."""

    def __init__(self, host: str, port: int, token: str, count: int, heartbeat_s: float = HEARTBEAT_S,
                 prefix: str = "sim", keep_alive: bool = True, kind: type[SimAgent] = SimAgent) -> None:
        whole = kind is not SimAgent
        self.agents = [kind(f"{prefix}{index:05d}", Link(host, port, token, keep_alive, source_address(index), whole),
                            Link(host, port, token, keep_alive, source_address(index), whole), heartbeat_s)
                       for index in range(count)]
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="sim-agents", daemon=True)
        self.tasks: list[asyncio.Future[None]] = []

    def start(self) -> None:
        self.thread.start()
        for agent in self.agents:
            self.tasks.append(asyncio.run_coroutine_threadsafe(agent.run(), self.loop))  # type: ignore[arg-type]

    def wait_for(self, done: Callable[[], bool], timeout_s: float, what: str) -> float:
        """Seconds until ``done()``; a TimeoutError naming ``what`` (and the agents' errors) after ``timeout_s``.
        What is measured the agents time themselves; a look is O(agents) and takes the simulator's lock of the
        interpreter, so it looks every ``LOOK_S`` (every 10 ms was a fifth of the simulator's core at 4096)."""
        began = time.monotonic()
        while not done():
            errors = self.errors()
            if errors or time.monotonic() - began > timeout_s:
                raise TimeoutError(f"{what}: not within {timeout_s:.0f} s; agents' errors: {errors[:3]}")
            time.sleep(LOOK_S)
        return time.monotonic() - began

    def holding(self, round_id: int) -> list[SimAgent]:
        return [agent for agent in self.agents if round_id in agent.rounds]

    def errors(self) -> list[str]:
        return [f"{agent.node_id}: {agent.error}" for agent in self.agents if agent.error]

    def stop(self) -> None:
        """Every agent stops where it is (its connection closed on the loop's thread), then the loop ends."""
        async def close_all() -> None:
            for agent in self.agents:
                agent.stopped = True
                agent.moved.set()
                agent.link.close()
                agent.beats.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        if self.thread.is_alive():
            asyncio.run_coroutine_threadsafe(close_all(), self.loop).result(10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
        self.loop.close()
