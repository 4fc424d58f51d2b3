"""What the status rules propose for one job, kept with their evidence, and how a proposal is applied: a change of
the config (hot, or by a restart), with a rollback when it carries one: the round restarts from the newest
persistent checkpoint at or before the rollback step, with the proposed values from the step after it. Pure.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from convoy.control.job import Event
from convoy.control.training.versions import CHANGE, RESTART, REVERTED, ConfigHistory, Version
from convoy.control.training.rules import ConfigVersion, Point, Proposal, RuleConfig, Rules
from convoy.errors import ConflictError

OPEN, APPLIED, DISMISSED = "open", "applied", "dismissed"
MAX_PROPOSALS = 500
CHECKPOINT_DIR = re.compile(r"^step-(\d+)$")
CHECKPOINT_MANIFEST = "convoy-manifest.json"
"""How ``runtime/persist.py`` names a complete persistent checkpoint (read here without importing torch)."""


def checkpoint_steps(run_dir: Path) -> list[int]:
    """The steps of the complete persistent checkpoints in the run dir's default place, oldest first."""
    root = Path(run_dir) / "checkpoints"
    try:
        names = [path for path in root.iterdir() if (path / CHECKPOINT_MANIFEST).is_file()]
    except OSError:
        return []
    return sorted(int(match.group(1)) for match in (CHECKPOINT_DIR.match(p.name) for p in names) if match)


@dataclass
class Kept:
    """A proposal as the job keeps and shows it."""

    id: int
    rule: str
    step: int
    onset: int | None
    evidence: str
    values: dict[str, Any]
    rollback_to: int | None
    auto: bool
    status: str = OPEN
    version: int = 0
    created_at: float = 0.0
    decided_by: str = ""


class JobProposals:
    """One job's rules and proposals; ``judge`` feeds the rules, ``apply`` turns a proposal into a version."""

    def __init__(self, auto_apply: tuple[str, ...] = (), kept: list[dict[str, Any]] | None = None) -> None:
        self.rules = Rules(RuleConfig(auto_apply=frozenset(auto_apply)))
        self.kept = [Kept(**entry) for entry in kept or []]
        self._rank_of: dict[str, int] = {}
        self.rollback_step: int | None = None
        """Set by applying a proposal with a rollback: the master opens a round that restores at most this step."""

    def judge(self, task_id: str, points: list[Any], history: ConfigHistory,
              checkpoints: list[int]) -> list[Kept]:
        """New proposals from a rank's new points (``train_protocol.StatusPoint``)."""
        rank = self._rank_of.setdefault(task_id, len(self._rank_of))
        fed = [Point(rank, p.step, p.time, p.loss, p.step_time_s, p.samples_per_s, p.memory_bytes, p.grad_norm)
               for p in points]
        versions = [ConfigVersion(v.number, v.at_step, dict(v.values)) for v in history.versions
                    if v.status != REVERTED]
        new = [self._keep(proposal) for proposal in self.rules.observe(fed, versions, checkpoints)]
        del self.kept[:-MAX_PROPOSALS]
        return new

    def _keep(self, proposal: Proposal) -> Kept:
        kept = Kept(self.kept[-1].id + 1 if self.kept else 1, proposal.rule, proposal.step, proposal.onset,
                    proposal.evidence, dict(proposal.values), proposal.rollback_to, proposal.auto,
                    created_at=time.time())
        self.kept.append(kept)
        return kept

    def find(self, number: int) -> Kept:
        found = next((kept for kept in self.kept if kept.id == number), None)
        if found is None:
            raise ConflictError(f"no proposal {number} (there are {len(self.kept)}; see convoy config proposals)")
        if found.status != OPEN:
            raise ConflictError(f"proposal {number} is already {found.status}")
        return found

    def dismiss(self, number: int, author: str) -> list[Event]:
        kept = self.find(number)
        kept.status, kept.decided_by = DISMISSED, author
        return [Event("proposal_dismissed", f"proposal {number} ({kept.rule}) dismissed by {author}")]

    def rollback(self, kept: Kept, history: ConfigHistory, author: str) -> tuple[Version, list[Event]]:
        """A version that runs from the step after ``kept.rollback_to``, applied by a restart that restores that
        checkpoint (the steps after it run again)."""
        assert kept.rollback_to is not None
        current = history.current
        if current is None:
            raise ConflictError("the job's script has not declared its training config yet")
        if any(v.status == "pending" and v.apply == RESTART for v in history.versions):
            raise ConflictError("a version is being applied by a restart; apply the proposal once it is active")
        changed = {name: value for name, value in history.schema.parse(kept.values).items()  # type: ignore[union-attr]
                   if current.values.get(name) != value} if kept.values else {}
        version = history.add(changed, RESTART, kept.rollback_to + 1, author,
                              f"proposal {kept.id} ({kept.rule}): roll back to step {kept.rollback_to}", CHANGE,
                              rollback=True)
        for undone in history.versions[:-1]:  # versions from the steps that run again are undone with them
            if undone.at_step >= version.at_step and undone.number > 1:
                undone.status = REVERTED
        self.rules.reset_after(kept.rollback_to)
        self.rollback_step = kept.rollback_to
        what = ", ".join(f"{name}={value!r}" for name, value in changed.items()) or "the same config"
        return version, [Event("config_rollback", f"config version {version.number} by {author}: {what}; the job rolls "
                                                  f"back to the newest checkpoint at or before step {kept.rollback_to} "
                                                  f"and runs on from there (proposal {kept.id}, {kept.rule})",
                               console=True)]

    def state(self) -> list[dict[str, Any]]:
        return [asdict(kept) for kept in self.kept]

