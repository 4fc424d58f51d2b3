"""What the strategy search measures of the links between the ranks, all ranks together: an allreduce over all
of them and within a node, each timed at two sizes and fitted as a line; convoy's hierarchical allreduces from
their own cost model; FSDP's collectives on the model's units."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from convoy.parallel.topology import Link, Topology
from convoy.strategy import candidates as cands
from convoy.strategy.apply import node_groups
from convoy.strategy.memory import ModelFeatures
from convoy.strategy.search import CommCosts


def shared(value: Any) -> Any:
    """Rank 0's ``value``, on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def allreduce_line(group: Any = None) -> Link:
    """An allreduce over ``group`` (all ranks: None) timed at 1 and 16 MB, as a line."""
    points = []
    for nbytes in (1 << 20, 16 << 20):
        buffer = torch.ones(nbytes // 4)
        dist.all_reduce(buffer, group=group)
        times = []
        for _ in range(3):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buffer, group=group)
            times.append(time.perf_counter() - start)
        points.append((float(nbytes), statistics.median(times)))
    return Link.fit_line(points[0], points[1])


def fsdp_pass(features: ModelFeatures, timed: int = 2) -> float:
    """Seconds FSDP's collectives take in one micro-step on this model's units (``fully_shard`` per block and the
    root), on the slowest rank, the mean of ``timed`` passes after one untimed: in the forward the root's and then
    each block's parameters gathered into a fresh buffer and copied out (a block's freed after its forward, the
    root's kept to the end), in the backward each block's gathered again, then every unit's gradient reduce-scattered
    from a fresh copy. Timed, not modelled: on CPU the fresh buffers' page faults cost more than the bytes moved
    (0.57 s a micro-step on benchmark case b's 54 MB over 4 ranks, 8x an allreduce of them)."""
    world = dist.get_world_size()
    blocks = [int(b) for b in features.block_param_bytes]
    units = [max(4, int(features.param_bytes) - sum(blocks))] + blocks
    shards = [torch.ones(-(-size // 4 // world)) for size in units]

    def gather(unit: int) -> torch.Tensor:
        whole = torch.empty(shards[unit].numel() * world)
        dist.all_gather_into_tensor(whole, shards[unit])
        return whole.clone()  # FSDP copies each parameter out of the gathered buffer

    def one_pass() -> None:
        root = gather(0)
        for unit in range(1, len(units)):
            gather(unit)  # the block's forward uses it, then it is freed
        for unit in reversed(range(len(units))):
            parameters = gather(unit) if unit else root
            gradient = torch.ones_like(parameters)
            dist.reduce_scatter_tensor(torch.empty_like(shards[unit]), gradient.clone())
            del parameters, gradient
        del root

    one_pass()
    times = []
    for _ in range(timed):
        dist.barrier()
        start = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - start)
    slowest = torch.tensor([statistics.mean(times)], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest)


def measure_comm(topology: Topology, comm: Any, per_node: int, features: ModelFeatures) -> CommCosts:
    """DDP's flat allreduce and, where nodes hold several ranks, one within a node, each timed at two
    sizes; convoy's hierarchical ones from its own cost model; FSDP's collectives on ``features``' units
    (``fsdp_pass``) where FSDP is a candidate."""
    fsdp = fsdp_pass(features) if features.has_blocks and dist.get_world_size() > 1 else None
    lines = {"gloo": allreduce_line()}
    world = dist.get_world_size()
    if per_node > 1 and world > per_node:
        lines["node"] = allreduce_line(node_groups(per_node)[0])
    if comm is not None:
        model = comm.cost_model()
        for algorithm in ("leader", "reduce_scatter"):
            small = model.predict(topology, algorithm, 1 << 20)
            large = model.predict(topology, algorithm, 16 << 20)
            lines[algorithm] = Link.fit_line((float(1 << 20), small), (float(16 << 20), large))
    return CommCosts(lines, fsdp)


def measured_links(hardware: cands.Hardware, features: ModelFeatures,
                   notes: list[str]) -> tuple[Any, CommCosts, list[str]]:
    """The allreduce the candidates use across hosts (None: torch's own), the links' costs as every rank measured
    them together, and the notes with FSDP's timed collectives added."""
    topology = Topology.uniform(hardware.world_size, hardware.nproc_per_node)
    comm = None
    if hardware.nodes > 1 and hardware.nproc_per_node > 1:
        from convoy.parallel.allreduce.collectives import HierarchicalAllreduce

        comm = HierarchicalAllreduce(topology, host_memory=False, tune=False, compress=False)  # weighs plain ones
    costs = CommCosts.from_dict(shared(measure_comm(topology, comm, hardware.nproc_per_node, features).to_dict()))
    if costs.fsdp_pass_s is not None:
        units = len(features.block_param_bytes) + 1
        notes = notes + [f"FSDP's gathers and reduce-scatters timed on the model's {units} units: "
                         f"{costs.fsdp_pass_s:.3f} s a micro-step"]
    return comm, costs, notes
