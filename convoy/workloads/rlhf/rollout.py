"""A rollout process: it holds the policy twice (the model it generates with and a shadow), leases prompts from the
store (``rollout_batch`` at a time, as many as the store grants), makes one group per prompt, all of a batch in one
call with the weights of one version, and puts each with that version.

Weights: a thread copies each newer version from the host's weight board into the shadow while generation goes on
with the live model, and checks the copy's digest against the one the trainer wrote with it. Between two batches (a
token boundary: no group mixes versions) the main loop swaps the two models; that swap is all the pause a sync costs
generation (``pauses_ms``). Each version a rollout takes is an event of the job, ``weights_synced``, with both
digests (the job's record keeps 20 events per node per 10 s: past that they are counted, and the process's last
line says how many versions it took, each checked).

Leases: another thread renews this process's leases every quarter of ``lease_s`` on a connection of its own. A
process that is stopped (SIGSTOP) renews nothing, so the store gives its prompts to the others; one that dies has
them given back when its lease runs out. A reward function that raises drops that prompt's group (``drop``, counted
by the store and here); the process goes on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from convoy.errors import ConfigError
from convoy.parallel.transport import ConnectionLost, Credentials
from convoy.parallel.transport.errors import Refused
from convoy.worker.events import emit
from convoy.worker.report import report
from convoy.workloads.rlhf.config import GRPOConfig
from convoy.workloads.rlhf.generate import RewardFailed, Sampling, sample_groups
from convoy.workloads.rlhf.store_client import StoreClient
from convoy.workloads.rlhf.task import Arithmetic, reward
from convoy.workloads.rlhf.weight_board import WeightBoard
from convoy.workloads.rlhf.weight_service import RemoteBoard

LOOK_S = 0.05
"""How often the weight thread looks at the board for a newer version."""
IDLE_S = 0.05
"""How long the main loop sleeps when the store has no prompt for it (the trainers are behind)."""
BOARD_WAIT_S = 600.0
"""How long a rollout waits for the trainer's first version (the trainer loads its models first)."""
CLOSE_JOIN_S = 10.0
RELOCATE_S = 1.0
"""While no newer version comes, how often the weight thread asks the store whether trainer 0's board moved."""


def parameters(model: Any) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


Locate = Callable[[], dict[str, Any]]
"""Where trainer 0's newest weights are, as the store heard it: ``board`` (its path), ``board_id``, ``weights_at``
(its weight service's address); empty before the first publication."""


class WeightFetcher(threading.Thread):
    """Copies each newer version into the shadow model, from trainer 0's board where this process can map it (the
    same host), else through trainer 0's weight service; ``ready`` holds its version once the copy is checked,
    until the main loop swaps and hands the other model back (``take``, which sets ``handed``). ``transport``: never
    the board (hosts whose processes share a path but not the memory behind it)."""

    def __init__(self, board_path: Path, shadow: Any, locate: Locate, transport: bool = False,
                 say: Callable[[str], None] = print, credentials: Credentials | None = None) -> None:
        super().__init__(name="rollout-weights", daemon=True)
        self.board_path, self.shadow, self.locate, self.transport, self.say = board_path, shadow, locate, transport, say
        self.have = -1
        self.ready: tuple[int, str, str] | None = None
        """(version, the trainer's digest, the shadow's own digest) of a copy waiting for its swap."""
        self.handed = threading.Event()
        self.stopping = threading.Event()
        self.failure: BaseException | None = None
        self.source: WeightBoard | RemoteBoard | None = None
        self.credentials = credentials
        """For the weight service (the process's own by default)."""

    def run(self) -> None:
        try:
            board_id = self._open()
            looked = time.monotonic()
            while not self.stopping.is_set():
                assert self.source is not None
                version = self.source.read_into(parameters(self.shadow), self.have)
                if version is None:
                    if time.monotonic() - looked > RELOCATE_S:  # a trainer group that came back on another node
                        looked = time.monotonic()
                        if self.locate().get("board_id", board_id) != board_id:
                            board_id = self._open()
                    self.stopping.wait(LOOK_S)
                    continue
                theirs, mine = self.source.read_digest, self.source.digest_of(parameters(self.shadow))
                self.have = version
                self.handed.clear()
                self.ready = (version, theirs, mine)
                while not self.handed.wait(LOOK_S):  # the main loop swaps at its next boundary
                    if self.stopping.is_set():
                        return
        except BaseException as exc:  # noqa: BLE001 (the main loop raises it: a rollout without weights stops)
            self.failure = exc

    def _open(self) -> str:
        """The source of the weights trainer 0 publishes now (waiting for its first publication); its board's id."""
        deadline = time.monotonic() + BOARD_WAIT_S
        where = self.locate()
        while not where.get("board_id"):
            if time.monotonic() > deadline or self.stopping.is_set():
                raise ConfigError(f"trainer 0 published no weights in {BOARD_WAIT_S:.0f} s")
            time.sleep(LOOK_S)
            where = self.locate()
        if self.source is not None:
            self.source.close()
        self.source = None if self.transport else self._board_if_mine(where["board_id"])
        if self.source is not None:
            self.say(f"weights from trainer 0's board {self.board_path} (this host's shared memory)")
        else:
            self.source = RemoteBoard(lambda: str(self.locate().get("weights_at", "")), self.credentials,
                                      stopping=self.stopping.is_set)
            why = "weights = transport" if self.transport else "its board is not on this host"
            self.say(f"weights from trainer 0's weight service at {where.get('weights_at')} ({why})")
        return str(where["board_id"])

    def _board_if_mine(self, board_id: str) -> WeightBoard | None:
        """Trainer 0's board if this host maps it (the path holds the board of that id), else None."""
        try:
            board = WeightBoard.open(self.board_path)
        except ConfigError:
            return None  # no board at that path here: another host
        if board.board_id == board_id:
            return board
        board.close()
        return None

    def take(self, live: Any) -> tuple[Any, int, str, str] | None:
        """(model, version, the trainer's digest, its own) of a checked copy, if one is ready; ``live`` becomes the
        shadow the next version is copied into."""
        if self.failure is not None:
            raise ConfigError(f"the rollout's weight copy failed: {self.failure}") from self.failure
        ready = self.ready
        if ready is None:
            return None
        fresh = self.shadow
        self.ready, self.shadow = None, live
        self.handed.set()
        return (fresh, *ready)


class LeaseKeeper(threading.Thread):
    def __init__(self, store: StoreClient, every_s: float) -> None:
        super().__init__(name="rollout-leases", daemon=True)
        self.store, self.every_s = store, every_s
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(self.every_s):
            try:
                self.store.call("renew")
            except (ConfigError, ConnectionLost, Refused):
                return  # the store is gone for good, or refuses this process (a replaced incarnation: it stops):
                # the main loop finds out on its next call


class Rollout:
    def __init__(self, cfg: GRPOConfig, links: tuple[StoreClient, StoreClient, StoreClient], board_path: Path,
                 models: tuple[Any, Any, Any], name: str, say: Callable[[str], None] = print) -> None:
        """``links``: three connections to the store (the main loop's, the lease renewals', the weight thread's:
        one per thread); ``models``: (live, shadow, tokenizer), two loads of the same policy; ``name``: this
        process in lines."""
        store, renewals, weights = links
        self.cfg, self.store, self.say, self.name = cfg, store, say, name
        self.model, shadow, self.tokenizer = models
        self.task = Arithmetic(cfg.seed, cfg.low, cfg.high, cfg.ops)
        self.score = cfg.scorer() or reward
        self.sampling = Sampling(cfg.group_size, cfg.max_new_tokens, cfg.temperature)
        self.fetcher = WeightFetcher(board_path, shadow, lambda: dict(weights.call("weights").meta),
                                     cfg.weights == "transport", lambda line: say(f"{name}: {line}"))
        self.keeper = LeaseKeeper(renewals, cfg.lease_s / 4)
        self.version = -1
        self.groups = 0
        self.reward_failures = 0
        self.refused: dict[str, int] = {}
        """Groups the store did not keep, by why (stale, a lease that went to another rollout, ...)."""
        self.pauses_ms: list[float] = []
        """Generation's pause at each swap of the weights."""
        self.checked: list[int] = []
        """The versions taken, each with its digest equal to the trainer's (a copy that differs stops the process)."""

    def swap(self) -> bool:
        """Take a newer version if its copy is ready and checked (between groups); whether it did."""
        began = time.perf_counter()
        ready = self.fetcher.take(self.model)
        if ready is None:
            return False
        self.model, self.version, theirs, mine = ready
        self.pauses_ms.append((time.perf_counter() - began) * 1000)
        same = "equal" if theirs == mine else "DIFFERENT"
        emit("weights_synced", f"{self.name} holds version {self.version}: digest {mine}, the trainer's {theirs} "
                               f"({same})")
        if theirs != mine:
            raise ConfigError(f"{self.name}: version {self.version}'s copy has digest {mine}; the trainer wrote "
                              f"{theirs}")
        self.checked.append(self.version)
        return True

    def run(self, stopping: Callable[[], bool] = lambda: False) -> None:
        """Groups until ``stopping()`` (or the job stops this process)."""
        self.fetcher.start()
        self.keeper.start()
        while self.version < 0:  # nothing to generate with before the trainer's first version
            if not self.swap():
                if stopping():
                    return
                time.sleep(LOOK_S)
        self.say(f"{self.name}: generating with version {self.version}")
        while not stopping():
            self.swap()
            leased = self.store.call("lease", {"count": self.cfg.rollout_batch, "version": self.version})
            numbers = [int(number) for number in leased.meta["prompts"]]
            if not numbers:
                time.sleep(IDLE_S)  # the trainers have not caught up (k), or every prompt is out
                continue
            self._batch(numbers)

    def _batch(self, numbers: list[int]) -> None:
        """One group per leased prompt, generated together with this version, each put (or dropped) in turn."""
        prompts = [self.task.prompt(number) for number in numbers]
        scores = [lambda text, answer=prompt.answer: self.score(text, answer) for prompt in prompts]
        made = sample_groups(self.model, self.tokenizer, [prompt.text for prompt in prompts], scores, self.sampling)
        for number, outcome in zip(numbers, made, strict=True):
            if isinstance(outcome, RewardFailed):
                self.reward_failures += 1
                if self.reward_failures == 1:
                    self.say(f"{self.name}: prompt {number} dropped: {outcome} (counted; the job goes on)")
                self.store.call("drop", {"prompt": number, "why": "reward function raised"})
                continue
            answer = self.store.call("put", {"prompt": number, "version": self.version}, outcome.group)
            verdict = str(answer.meta["outcome"]) if answer.op == "put" else "late (its prompt went to another rollout)"
            if verdict == "kept":
                report(self.groups, reward=float(outcome.group["rewards"].mean()), version=self.version)
                self.groups += 1
            else:
                self.refused[verdict] = self.refused.get(verdict, 0) + 1

    def close(self) -> None:
        self.fetcher.stopping.set()
        self.keeper.stopping.set()
        self.store.close()
        if self.fetcher.is_alive():
            self.fetcher.join(CLOSE_JOIN_S)  # a copy under way ends first: its source is closed under it otherwise
        if self.fetcher.source is not None:
            self.fetcher.source.close()
