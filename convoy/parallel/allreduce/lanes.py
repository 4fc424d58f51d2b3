"""The process groups a thread's hierarchical allreduce runs on (``collectives.py``), one ``Lane`` per thread.

Collectives on one group must come in the same order on every rank. The DDP hook reduces buckets
on a thread of its own while the main thread goes on (and may call collectives of its own), so the
two threads' calls interleave differently on each rank: each thread gets its own lane, a private copy
of the world group and of every sub-group, and its own shared-memory segment and ``auto`` trials.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from convoy.parallel.allreduce.autotune import Trial
from convoy.parallel.allreduce.host_memory import HostSegment, device_backend, open_segment
from convoy.parallel.topology import Topology


@dataclass
class Lane:
    """The groups one thread's collectives run on, with that thread's shared-memory segment and ``auto``
    trials: one thread's calls on a lane come in the same order on every rank, two threads' do not."""

    world: Any
    """The whole job's group (None: the default group)."""
    intra: Any
    """This rank's group: the ranks it shares fast links with."""
    leaders: Any | None
    """The groups' leaders, on a leader; None on the others."""
    shard: Any | None
    """The ring of this rank's local index across the groups (uniform topologies only)."""
    segment: HostSegment | None
    """The group's shared-memory file (``host_memory.py``), where it has one."""
    decided: dict[int, str] = field(default_factory=dict)
    """Size class -> what ``auto`` runs, once a trial (or the cost model alone) settled it."""
    trials: dict[int, Trial] = field(default_factory=dict)


def open_lane(topology: Topology, rank: int, private: bool, host_memory: bool, slot_bytes: int) -> Lane:
    """Make the sub-groups of ``topology`` (collective over the default group: every rank, in the same
    order), and a private copy of the world group where ``private`` (else the lane uses the default
    group); a shared-memory segment of ``slot_bytes`` slots where ``host_memory`` and gloo reduces CPU
    tensors (``host_memory.reduce_path``)."""
    world = dist.new_group(list(range(topology.world_size))) if private else None
    members = topology.groups[topology.group_of(rank)]
    intra = [dist.new_group(list(group)) for group in topology.groups][topology.group_of(rank)]
    leaders = dist.new_group(list(topology.leaders))
    shard = None
    if topology.is_uniform:
        shards = [dist.new_group(list(ring)) for ring in topology.shard_groups()]
        shard = shards[topology.local_index(rank)]
    segment = None
    if host_memory and device_backend(dist.get_backend(), "cpu") == "gloo":
        segment = open_segment(intra, members[0], members, rank, slot_bytes, world=world)
    return Lane(world, intra, leaders if rank in topology.leaders else None, shard, segment)


def own_device() -> torch.device:
    """Where the allreduce's own small tensors go: the CPU where the default group reduces CPU tensors,
    else this process's GPU."""
    if device_backend(dist.get_backend(), "cpu") is not None:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())
