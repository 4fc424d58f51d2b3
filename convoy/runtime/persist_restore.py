"""Resuming from a persistent (DCP) checkpoint, in a world of any size.

Model and optimizer state are resharded by DCP. The per-rank parts (``rank<N>``: data position,
RNG, ``model_state``) follow the rank number: rank r of the new world loads rank r's part where
the checkpoint has one; a rank without one keeps its freshly constructed data position and RNG
and takes ``model_state`` from the lowest saved rank of its own set of peers (if any). Parts of
saved ranks the new world lacks are not used. Each choice is named in the log line.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from convoy.errors import CheckpointError
from convoy.runtime import persist
from convoy.runtime.checkpoint_state import extra_state, load_extra, rng_state, set_rng_state


def rank_part_keys(path: Path) -> list[str]:
    """The saved keys of the checkpoint's per-rank parts (``rank<N>.…``), from DCP's metadata."""
    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return sorted(key for key in keys if key.startswith("rank"))


def saved_ranks(keys: list[str]) -> list[int]:
    return sorted({int(key.split(".", 1)[0][4:]) for key in keys if key.split(".", 1)[0][4:].isdigit()})


def prune_to_saved(state: Any, path: str, keys: set[str]) -> Any:
    """The part of ``state`` (nested mappings) that the checkpoint holds under ``path``; None if none."""
    if isinstance(state, Mapping):
        kept = {name: part for name, value in state.items()
                if (part := prune_to_saved(value, f"{path}.{name}", keys)) is not None}
        return kept or None
    prefix = path + "."
    return state if path in keys or any(key.startswith(prefix) for key in keys) else None


class PersistentRestore:
    """The persistent half of ``Checkpointer.restore`` (mixed into it; uses its model and groups)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    extra: dict[str, Any]
    shared: dict[str, Any]
    rank: int
    world_size: int
    root: Path
    restored_from: str
    log: Callable[[str], None]
    _group: dist.ProcessGroup
    _peers: tuple[int, ...]

    def _newest_persistent(self) -> int | None:
        """Step of the newest complete-looking checkpoint (not yet verified), or None."""
        found = persist.complete_checkpoints(self.root)
        return found[0][0] if found else None

    def _restore_persistent(self) -> int | None:
        if self.rank == 0:
            persist.remove_stale_tmp(self.root)
        listing = [persist.complete_checkpoints(self.root) if self.rank == 0 else None]
        dist.broadcast_object_list(listing, src=0, group=self._group)
        mismatches = []
        for step, path in listing[0] or []:
            checked = [self._check(path) if self.rank == 0 else None]
            dist.broadcast_object_list(checked, src=0, group=self._group)
            problem, keys = checked[0]  # type: ignore[misc]
            if problem is not None:
                self.log(f"skipping checkpoint {path}: {problem}")
                continue
            state, own, donor = self._load_target(step, keys)
            try:
                persist.load(state, path, self._group)
            except (Exception, CheckpointException) as exc:  # every rank gets the same error from DCP
                mismatches.append(f"{path.name}: {persist.reason(exc)}")
                self.log(f"skipping checkpoint {path}: cannot be loaded into this model ({mismatches[-1]})")
                continue
            set_state_dict(self.model, self.optimizer or [], model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
            donated = state.get(donor, {}) if donor is not None else {}
            self._apply_rank_part(state.get(own, {}), donated)
            self.restored_from = f"persistent checkpoint {path}"
            self.log(f"resumed from persistent checkpoint {path} (step {step}){self._describe_parts(keys)}")
            return step
        if mismatches:
            raise CheckpointError(f"no checkpoint under {self.root} fits this model ({'; '.join(mismatches)}); "
                                  "use a new run dir or restore the model definition")
        return None

    @staticmethod
    def _check(path: Path) -> tuple[str | None, list[str]]:
        """Rank 0: why the checkpoint cannot be used (or None), and its per-rank keys."""
        problem = persist.verify(path)
        if problem is not None:
            return problem, []
        try:
            return None, rank_part_keys(path)
        except (OSError, ValueError, EOFError, pickle.UnpicklingError, CheckpointException) as exc:
            return f"metadata unreadable: {persist.reason(exc)}", []

    def _load_target(self, step: int, keys: list[str]) -> tuple[dict[str, Any], str, str | None]:
        """The state to load in place: model and optimizer (resharded), and only the per-rank parts the
        checkpoint holds: this rank's own, else ``model_state`` from a saved peer (the donor)."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer or [])
        state: dict[str, Any] = {"step": step, "model": model_sd, "optim": optim_sd}
        live = {"extra": {n: extra_state(o) for n, o in self.extra.items()},
                "shared": {n: extra_state(o) for n, o in self.shared.items()}, "rng": rng_state()}
        saved, key_set, own = saved_ranks(keys), set(keys), f"rank{self.rank}"
        if self.rank in saved:
            part = prune_to_saved(live, own, key_set)
            if part:
                state[own] = part
            return state, own, None
        donor_rank = next((rank for rank in self._peers if rank in saved), None)
        if donor_rank is None or not self.shared:
            return state, own, None
        donor = f"rank{donor_rank}"
        part = prune_to_saved({"shared": live["shared"]}, donor, key_set)
        if part:
            state[donor] = part
        return state, own, donor

    def _apply_rank_part(self, mine: dict[str, Any], donated: dict[str, Any]) -> None:
        for name, value in (mine.get("shared") or donated.get("shared") or {}).items():
            load_extra(self.shared[name], value)
        for name, value in (mine.get("extra") or {}).items():
            load_extra(self.extra[name], value)
        if mine.get("rng"):
            set_rng_state(mine["rng"])

    def _describe_parts(self, keys: list[str]) -> str:
        """How the per-rank parts of a checkpoint from another world size were given out."""
        saved = saved_ranks(keys)
        if saved == list(range(self.world_size)):
            return ""
        fresh = [rank for rank in range(self.world_size) if rank not in saved]
        unused = [rank for rank in saved if rank >= self.world_size]
        said = [f"saved by ranks {saved}, restored on {self.world_size}"]
        if fresh:
            said.append(f"ranks {fresh} have no saved data position or RNG and keep their fresh ones"
                        + (" (model_state from the lowest saved rank of their peers)" if self.shared else ""))
        if unused:
            said.append(f"the data position and RNG saved by ranks {unused} are not used")
        return "; " + "; ".join(said)
