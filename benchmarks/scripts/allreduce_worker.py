"""One rank of benchmarks/allreduce.py: time flat, leader, reduce_scatter, their coded variants (the cross-group
phase losslessly coded: ``leader_coded``, ``reduce_scatter_coded``) and auto allreduce (which, between two hosts,
tries the coded ones too).

Groups are the ranks of each host (``LOCAL_WORLD_SIZE`` consecutive ranks). Reps of the
algorithms are interleaved, in a fresh random order each rep; each starts after a barrier and
counts the slowest rank; between reps the buffer is refilled (not timed) with the same gradient-like
values (normal, scaled by 1e-3: the coding depends on the values). The first rank of each
host reads its host link's sent bytes (``CONVOY_BENCH_LINK``, empty on loopback) around each rep.
Rank 0 writes the results as JSON to ``--out``.
Checks across ranks are off (``check=False``), as in the DDP hook, so each algorithm is timed alone.
``auto`` starts fresh at each size: where it holds a trial (``HierarchicalAllreduce.choose``), the
trial runs before the timed reps (as a job's first steps would), and its calls and time are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import convoy
from convoy.parallel.allreduce.collectives import HierarchicalAllreduce
from convoy.parallel.topology import Topology

ALGORITHMS = ("flat_torch", "leader", "reduce_scatter", "leader_coded", "reduce_scatter_coded", "auto")


def sent_bytes() -> int:
    link = os.environ.get("CONVOY_BENCH_LINK", "")
    if not link:
        return 0
    return int(Path(f"/sys/class/net/{link}/statistics/tx_bytes").read_text())


def run(comm: HierarchicalAllreduce, buffer: torch.Tensor, algorithm: str) -> str:
    if algorithm == "flat_torch":
        dist.all_reduce(buffer)
        return algorithm
    return comm.allreduce(buffer, "sum", algorithm, check=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes-mb", default="1,4,16,64")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", required=True)
    parser.add_argument("--uncoded-only", action="store_true",
                        help="time no coded variant on its own (auto may still run one)")
    args = parser.parse_args()
    algorithms = tuple(a for a in ALGORITHMS if not (args.uncoded_only and a.endswith("_coded")))
    ctx = convoy.init()
    topology = Topology.uniform(ctx.world_size, ctx.local_world_size)
    comm = HierarchicalAllreduce(topology)
    comm.choose(1)  # measure the links once, before anything is timed
    counts_bytes = ctx.local_rank == 0
    results = []
    for size_mb in [float(s) for s in args.sizes_mb.split(",")]:
        values = torch.randn(int(size_mb * (1 << 20)) // 4, generator=torch.Generator().manual_seed(ctx.rank)) * 1e-3
        expected = values.clone()
        dist.all_reduce(expected)
        buffer = values.clone()
        chosen = {algorithm: run(comm, buffer, algorithm) for algorithm in algorithms}  # warm
        trial_calls, trial_s = 1, 0.0  # auto's trial at this size, if it holds one: a one-time cost, reported
        while not comm.settled(buffer.numel() * 4):
            buffer.copy_(values)  # as before every timed rep
            dist.barrier()
            began = time.perf_counter()
            run(comm, buffer, "auto")
            trial_s += time.perf_counter() - began
            trial_calls += 1
        times: dict[str, list[float]] = {algorithm: [] for algorithm in algorithms}
        sent = dict.fromkeys(algorithms, 0)
        # small messages (runs spread by up to 40% with 8 ranks on 2 cores) and anything on loopback (10-20%) are
        # noisier; their reps are cheap
        reps = args.reps * (18 if size_mb <= 4 else 6 if not os.environ.get("CONVOY_BENCH_LINK") else 1)
        for rep in range(reps):  # interleaved, so a slow moment of the machine hits every algorithm alike, in an
            # order drawn anew each rep (the same on every rank), so no algorithm always runs right after another
            for algorithm in random.Random(rep).sample(algorithms, len(algorithms)):
                buffer.copy_(values)
                dist.barrier()
                before = sent_bytes() if counts_bytes else 0
                began = time.perf_counter()
                run(comm, buffer, algorithm)
                times[algorithm].append(time.perf_counter() - began)
                dist.barrier()  # every rank of the host is done sending before the counter is read
                sent[algorithm] += (sent_bytes() - before) if counts_bytes else 0
                if rep == 0:  # each algorithm's sum, once per size (a 64 MB check costs more than a loopback call)
                    assert torch.allclose(buffer, expected, rtol=1e-4, atol=1e-8), f"{algorithm} gave a wrong sum"
        chosen["auto"] = comm.choose(buffer.numel() * 4)  # what auto settled on (after its trial, if it held one)
        for algorithm in algorithms:
            slowest = torch.tensor(times[algorithm], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            total_sent = torch.tensor([sent[algorithm]], dtype=torch.int64)
            dist.all_reduce(total_sent)
            results.append({"size_mb": size_mb, "algorithm": algorithm, "chosen": chosen[algorithm],
                            "median_s": statistics.median(slowest.tolist()), "times_s": slowest.tolist(),
                            "cross_bytes": total_sent.item() / reps, "trial_calls": trial_calls, "trial_s": trial_s})
    if ctx.rank == 0:
        cost = comm.cost_model()
        Path(args.out).write_text(json.dumps({"results": results, "links": {
            "intra": [cost.intra.latency_s, cost.intra.s_per_byte],
            "inter": [cost.inter.latency_s, cost.inter.s_per_byte]}}))
    comm.close()
    convoy.exit_without_teardown()


if __name__ == "__main__":
    main()
