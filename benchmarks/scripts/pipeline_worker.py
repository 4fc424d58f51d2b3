"""One rank of the pipeline benchmark: convoy's schedules against torch.distributed.pipelining.

    python pipeline_worker.py --mode emulated|real|overhead --microbatches M --reps N --out FILE
    (RANK, WORLD_SIZE, MASTER_ADDR/PORT in env)

Every configuration gets the same 8-block MLP (same seed) and the same batches. Each rep runs
one step of every configuration, in a rotated order; a step is timed between two barriers.
convoy's runtime records its action spans (for the measured bubble) and both sides run inside an
ActivationMeter (saved-for-backward bytes). First, a calibration step of convoy's 1F1B gives the
per-action costs and a ping-pong the message time, from which bubble fills are planned. Rank 0
writes the JSON that benchmarks/pipeline.py reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

import convoy
from convoy.parallel.pipeline import schedule as plans
from convoy.parallel.pipeline.fill import plan_fills
from convoy.parallel.pipeline.memory import ActivationMeter
from convoy.parallel.pipeline.runtime import PipelineRuntime, gather_spans, split_sequential
from convoy.parallel.pipeline.simulate import Costs
from convoy.parallel.pipeline.schedule import Action, Kind
from convoy.parallel.tensor.blocks import FILL_SHARE, Filler, MLPBlock

BLOCKS = 8
MODES = {  # width, hidden, micro-batch rows, forward ms and backward ms per block
    "emulated": (64, 128, 8, 10.0, 20.0),
    "real": (384, 1536, 32, 0.0, 0.0),
    "overhead": (16, 32, 2, 0.0, 0.0),
}


def make_model(mode: str) -> nn.Sequential:
    width, hidden, _, fwd, bwd = MODES[mode]
    torch.manual_seed(0)
    return nn.Sequential(*[MLPBlock(width, hidden, fwd, bwd) for _ in range(BLOCKS)])


def message_time(shape: tuple[int, ...], reps: int = 30) -> float:
    """One-way time of a message of ``shape`` floats between ranks 0 and 1 (median of ping-pongs)."""
    rank, buf, times = dist.get_rank(), torch.zeros(shape), []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        times.append((time.perf_counter() - start) / 2)
    result = [statistics.median(times)]
    dist.broadcast_object_list(result, src=0)
    return result[0]


class Convoy:
    def __init__(self, schedule: plans.Schedule, mode: str) -> None:
        rank = dist.get_rank()
        stages = dict(enumerate(split_sequential(make_model(mode), schedule.n_stages)))
        self.schedule = schedule
        self.runtime = PipelineRuntime(schedule, {s: stages[s] for s in schedule.stages_of(rank)},
                                       nn.functional.mse_loss)
        self.runtime.meter = ActivationMeter(self.runtime.params())
        self.name = f"convoy {schedule.name}"

    def step(self, x: torch.Tensor, y: torch.Tensor) -> list[float] | None:
        return self.runtime.step(x, y, record=True)


class Torch:
    KINDS = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}

    def __init__(self, kind: str, mode: str, microbatches: int) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        chunks = 2 if kind == "interleaved" else 1
        n_stages = world * chunks
        parts = split_sequential(make_model(mode), n_stages)
        self.mine = [r * world + rank for r in range(chunks)] if chunks > 1 else [rank]
        stages = [PipelineStage(parts[s], s, n_stages, torch.device("cpu")) for s in self.mine]
        cls = self.KINDS[kind]
        self.schedule = cls(stages if chunks > 1 else stages[0], microbatches, loss_fn=nn.functional.mse_loss)
        self.params = [p for s in self.mine for p in parts[s].parameters()]
        self.meter = ActivationMeter(self.params)
        self.first, self.last = 0 in self.mine, n_stages - 1 in self.mine
        self.name = f"torch {cls.__name__}"

    def step(self, x: torch.Tensor, y: torch.Tensor) -> list[float] | None:
        losses: list[torch.Tensor] = []
        with self.meter:
            args = (x,) if self.first else ()
            self.schedule.step(*args, target=y if self.last else None, losses=losses if self.last else None)
        return [float(loss) for loss in losses] if self.last else None


def calibrate(mode: str, m: int, x: torch.Tensor, y: torch.Tensor) -> dict:
    """Per-stage F and B times of 1F1B, and message times: the simulator's costs."""
    probe = Convoy(plans.one_f_one_b(dist.get_world_size(), m), mode)
    for _ in range(3):
        probe.step(x, y)
        spans = gather_spans(probe.runtime)
    width, hidden, rows, _, _ = MODES[mode]
    costs = [None]
    if dist.get_rank() == 0:
        fwd = statistics.median(s.end - s.start for s in spans if s.action.kind.value == "F")
        bwd = statistics.median(s.end - s.start for s in spans if s.action.kind.value == "B")
        costs = [{"forward": fwd * probe.schedule.n_stages, "backward": bwd * probe.schedule.n_stages}]
    dist.broadcast_object_list(costs, src=0)
    found = costs[0]
    found["comm"] = message_time((rows, width))
    found.update(split_costs(mode, rows, found["forward"] / probe.schedule.n_stages))
    return found


def split_costs(mode: str, rows: int, stage_forward: float, reps: int = 9) -> dict:
    """Time real split forwards of stage 0 (owner rank 0, helper rank 1) and fit the simulator's
    fill costs to them: ``fill_comm`` is what makes an exchange take as long as it did (the
    split forwards after the first of a step); the parameter shard costs what the first split
    of a step takes over the others, and at least its time as one message."""
    rank, world = dist.get_rank(), dist.get_world_size()
    stage = split_sequential(make_model(mode), world)[0]
    filler = Filler(rank, 3, lambda r: r, None)
    x = torch.randn(rows, MODES[mode][0], requires_grad=True)
    first, later = [], []
    token = torch.zeros(1)
    for _ in range(reps):
        filler.begin()
        dist.barrier()
        if rank == 0:  # a ping-pong, so that both start together (a barrier lets them leave apart)
            dist.send(token, 1)
            dist.recv(token, 1)
        elif rank == 1:
            dist.recv(token, 0)
            dist.send(token, 0)
        for mb in range(3):
            start = time.perf_counter()
            if rank == 0:
                filler.forward(Action(Kind.F, 0, mb, 1), stage, x)
            elif rank == 1:
                filler.help(Action(Kind.H, 0, mb, 0))
            (later if mb else first).append(time.perf_counter() - start)
        filler.finish()
    rounds = len(list(stage.children()))
    found = [None]
    if rank == 0:
        split = statistics.median(later)
        theirs = stage_forward * FILL_SHARE / rounds
        per_step = [a - statistics.median(later[2 * i:2 * i + 2]) for i, a in enumerate(first)]  # same step
        found = [{"fill_comm": max(0.0, (split / rounds - theirs) / 2), "split_forward": split,
                  "first_extra": statistics.median(per_step)}]
    dist.broadcast_object_list(found, src=0)
    width, hidden = MODES[mode][:2]
    shard = rounds * (hidden - hidden // 2) * (2 * width + 1)
    found[0]["fill_params"] = max(message_time((shard,)), found[0].pop("first_extra"))
    return found[0]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=sorted(MODES), default="emulated")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--reps", type=int, default=10, help="timed steps per configuration (x4 for overhead)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world, m = dist.get_rank(), dist.get_world_size(), args.microbatches
    width, _, rows, _, _ = MODES[args.mode]
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(rows * m, width, generator=gen), torch.randn(rows * m, width, generator=gen)
    found = calibrate(args.mode, m, x, y)
    costs = Costs(**{k: v for k, v in found.items() if k != "split_forward"})
    configs: list[Convoy | Torch] = []
    for name in ("gpipe", "1f1b", "interleaved", "two-group"):
        schedule = plans.build(name, world, m)
        configs.append(Convoy(schedule, args.mode))
        filled, _ = plan_fills(schedule, dataclasses.replace(costs, fill_rounds=BLOCKS // schedule.n_stages))
        if filled.name != schedule.name:
            configs.append(Convoy(filled, args.mode))
        if name in Torch.KINDS:
            configs.append(Torch(name, args.mode, m))
    record: dict[str, dict] = {c.name: {"times": [], "makespans": [], "losses": None}
                               for c in configs}
    for config in configs:  # warm-up: shapes, gloo pairs, allocator
        losses = config.step(x, y)
        record[config.name]["losses"] = losses
    for rep in range(args.reps * (4 if args.mode == "overhead" else 1)):  # short steps: more of them
        shift = rep % len(configs)
        for config in configs[shift:] + configs[:shift]:
            dist.barrier()
            start = time.perf_counter()
            config.step(x, y)
            dist.barrier()
            record[config.name]["times"].append(time.perf_counter() - start)
            if isinstance(config, Convoy):
                spans = gather_spans(config.runtime)
                if rank == 0:
                    record[config.name]["makespans"].append(max(s.end for s in spans))
                    record[config.name]["spans"] = [(s.rank, s.action.kind.value, s.action.stage, s.action.mb,
                                                     s.action.peer, s.start, s.end) for s in spans]
    peaks = [None] * world
    dist.all_gather_object(peaks, {c.name: (c.runtime.meter if isinstance(c, Convoy) else c.meter).peak
                                   for c in configs})
    last_losses = [None] * world
    dist.all_gather_object(last_losses, {c.name: record[c.name]["losses"] for c in configs})
    if rank == 0:
        for config in configs:
            entry = record[config.name]
            entry["peak_bytes"] = [peaks[r][config.name] for r in range(world)]
            entry["losses"] = next((part[config.name] for part in last_losses if part[config.name]), None)
            if isinstance(config, Convoy):
                entry["schedule"] = {"name": config.schedule.name, "microbatches": m}
        args.out.write_text(json.dumps({"mode": args.mode, "world": world, "microbatches": m, "costs": found,
                                        "configs": record}))
    dist.barrier()
    convoy.exit_without_teardown()


if __name__ == "__main__":
    sys.exit(main())
