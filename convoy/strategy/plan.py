"""A training strategy as data: what ``convoy.accelerate`` applies, and the file ``convoy plan`` writes (pure).

A strategy names how the model is distributed (``kind``), how DDP's gradients are reduced, whether
blocks recompute their activations, the precision, and how a rank's batch is split into micro-batches.
The file also names the model it was planned for, so a strategy is never applied to another model.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from convoy.errors import ConfigError

KINDS = ("ddp", "zero", "fsdp", "local", "pipeline", "sequence")
"""``ddp``: every rank holds everything, gradients allreduced. ``zero``: DDP gradients, optimizer state
sharded over the ranks (``ZeroRedundancyOptimizer``). ``fsdp``: FSDP2 ``fully_shard`` per block and the
root (parameters, gradients and optimizer state sharded, ZeRO-3). ``local``: local SGD for slow links
between nodes: a node's ranks train one replica under DDP (gradients allreduced within the node every
step), and every ``sync_every`` steps the parameters are averaged over all ranks, so the links between
nodes carry 1/``sync_every`` of DDP's traffic (``parallel/local_sgd.py``). It is not the same
optimization as DDP's: the replicas drift apart between averagings. ``pipeline``: the model's layers cut
into ``stages`` contiguous stages run by ``schedule`` (``parallel/pipeline``) over groups of ``stages``
consecutive ranks; a group trains on its ranks' batches together, and the groups (where there are several)
allreduce each stage's gradients like DDP. ``sequence``: each sample's sequence cut over groups of ``sequence``
consecutive ranks, whose attention runs by query broadcast (the model calls ``convoy.attention`` and
``convoy.positions``, ``parallel/sequence/shard.py``); a group trains on its ranks' batches together, every rank
holds the whole model, and DDP averages the gradients over all ranks."""
SCHEDULES = ("1f1b", "interleaved", "gpipe")
"""Pipeline schedules a strategy may name (``parallel/pipeline/schedule.py``): ``interleaved`` holds two
stages per rank."""
ALLREDUCES = ("gloo", "leader", "reduce_scatter")
"""``gloo``: DDP's own allreduce (one flat ring). ``leader`` and ``reduce_scatter``: convoy's hierarchical
allreduce (``parallel/allreduce``) as DDP's communication hook, for ranks grouped by node."""
FORMAT = 1


@dataclass(frozen=True)
class Strategy:
    """One way to train: applied by ``convoy.accelerate``, written to a strategy file by ``convoy plan``."""

    kind: str = "ddp"
    """One of ``KINDS``."""
    allreduce: str = "gloo"
    """One of ``ALLREDUCES`` (``ddp`` and ``zero`` only; ``fsdp`` reduce-scatters on its own)."""
    checkpointing: bool = False
    """Recompute each block's activations in the backward pass instead of keeping them."""
    bf16: bool = False
    """Run the forward under ``torch.autocast`` with bfloat16."""
    micro_batch: int = 1
    """Samples per forward/backward on one rank."""
    accumulation: int = 1
    """Micro-batches per optimizer step (the rank's batch is ``micro_batch * accumulation``)."""
    bucket_mb: int = 25
    """DDP's gradient bucket size, MB (``ddp`` and ``zero``)."""
    threads: int = 1
    """``torch.set_num_threads`` for each rank."""
    sync_every: int = 1
    """``local`` only: optimizer steps between averagings of the parameters over all ranks (>= 2)."""
    stages: int = 1
    """``pipeline`` only: ranks in one pipeline (>= 2); its batch is the ``stages`` ranks' batches together,
    cut into ``stages * accumulation`` micro-batches of ``micro_batch``."""
    schedule: str = ""
    """``pipeline`` only: one of ``SCHEDULES``."""
    sequence: int = 1
    """``sequence`` only: ranks one sample's sequence is cut over (>= 2); their batch is the ``sequence`` ranks'
    batches together, cut into ``sequence * accumulation`` micro-batches of ``micro_batch``, each rank computing its
    part of every sample's positions."""

    def validate(self) -> Strategy:
        if self.kind not in KINDS:
            raise ConfigError(f"strategy kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.allreduce not in ALLREDUCES:
            raise ConfigError(f"strategy allreduce {self.allreduce!r} is not one of {', '.join(ALLREDUCES)}")
        if self.kind in ("fsdp", "local", "pipeline", "sequence") and self.allreduce != "gloo":
            raise ConfigError(f"strategy allreduce {self.allreduce!r} needs kind ddp or zero ({self.kind} "
                              "reduces on its own)")
        for name in ("micro_batch", "accumulation", "bucket_mb", "threads", "sync_every", "stages", "sequence"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"strategy {name} must be a whole number >= 1 (got {getattr(self, name)!r})")
        if self.kind == "local" and self.sync_every < 2:
            raise ConfigError(f"strategy kind local needs sync_every >= 2 steps between averagings (got "
                              f"{self.sync_every}); sync_every 1 is kind ddp")
        if self.kind != "local" and self.sync_every != 1:
            raise ConfigError(f"strategy sync_every {self.sync_every} is for kind local only (this is {self.kind})")
        if self.kind == "pipeline":
            if self.stages < 2 or self.schedule not in SCHEDULES:
                raise ConfigError(f"strategy kind pipeline needs stages >= 2 and a schedule of {', '.join(SCHEDULES)} "
                                  f"(got stages {self.stages!r}, schedule {self.schedule!r})")
            if self.checkpointing:
                raise ConfigError("strategy kind pipeline takes no checkpointing (a stage holds a share of the "
                                  "activations already)")
        elif self.stages != 1 or self.schedule:
            raise ConfigError(f"strategy stages {self.stages} and schedule {self.schedule!r} are for kind pipeline "
                              f"only (this is {self.kind})")
        if self.kind == "sequence":
            if self.sequence < 2:
                raise ConfigError(f"strategy kind sequence needs sequence >= 2 ranks a sample (got {self.sequence})")
            if self.checkpointing:
                raise ConfigError("strategy kind sequence takes no checkpointing (convoy does not combine them yet: a "
                                  "recomputed block would repeat its attention's exchanges inside the backward)")
        elif self.sequence != 1:
            raise ConfigError(f"strategy sequence {self.sequence} is for kind sequence only (this is {self.kind})")
        return self

    @property
    def batch(self) -> int:
        return self.micro_batch * self.accumulation

    def name(self) -> str:
        """A short label for tables: ``fsdp ckpt bf16 mb4x2 t1``."""
        parts = [self.kind if self.allreduce == "gloo" else f"{self.kind}/{self.allreduce}"]
        parts += [f"H{self.sync_every}"] * (self.kind == "local")
        parts += [f"p{self.stages}/{self.schedule}"] * (self.kind == "pipeline")
        parts += [f"s{self.sequence}"] * (self.kind == "sequence")
        parts += ["ckpt"] * self.checkpointing + ["bf16"] * self.bf16
        parts.append(f"mb{self.micro_batch}x{self.accumulation}")
        if self.kind in ("ddp", "zero", "local", "sequence") and self.bucket_mb != 25:
            parts.append(f"b{self.bucket_mb}")
        parts.append(f"t{self.threads}")
        return " ".join(parts)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Strategy:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"strategy has unknown fields {unknown}; known: {sorted(known)}")
        return cls(**data).validate()


def fingerprint(named_shapes: Iterable[tuple[str, tuple[int, ...], str]]) -> str:
    """A model's identity for strategy files: its parameters' and buffers' names, shapes and dtypes."""
    digest = hashlib.sha256()
    for name, shape, dtype in named_shapes:
        digest.update(f"{name}:{tuple(shape)}:{dtype};".encode())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class StrategyFile:
    """What ``convoy plan`` writes: the winner, for which model, ranks and per-rank batch."""

    strategy: Strategy
    model: str
    """``fingerprint`` of the model."""
    model_summary: str
    """For people: the model's class and parameter count."""
    world_size: int
    batch: int

    def save(self, path: str | Path) -> None:
        body = {"format": FORMAT, "strategy": self.strategy.to_dict(), "model": self.model,
                "model_summary": self.model_summary, "world_size": self.world_size, "batch": self.batch}
        Path(path).write_text(json.dumps(body, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> StrategyFile:
        try:
            body = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read strategy file {path}: {exc.strerror}; run convoy plan to write one"
                              ) from exc
        except json.JSONDecodeError as exc:
            raise ConfigError(f"strategy file {path} is not JSON ({exc.msg} at line {exc.lineno})") from exc
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            raise ConfigError(f"strategy file {path} is not a convoy strategy file of format {FORMAT}")
        try:
            return cls(Strategy.from_dict(body["strategy"]), str(body["model"]), str(body["model_summary"]),
                       int(body["world_size"]), int(body["batch"]))
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"strategy file {path} lacks or mangles field {exc}") from exc

    def check_model(self, model: str, summary: str, path: str | Path) -> None:
        """Refuse a file planned for another model, naming both."""
        if model != self.model:
            raise ConfigError(f"strategy file {path} was planned for another model ({self.model_summary}, "
                              f"fingerprint {self.model}); this model is {summary} (fingerprint {model}): "
                              "run convoy plan for this model")
