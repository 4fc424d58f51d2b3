"""One rank of the strategy search's dry runs: ``python -m convoy.strategy.worker SPEC.json`` (torchrun env).

Rank 0 profiles the model (trace + real micro-steps) while the others wait; every rank then
measures the allreduce lines and times FSDP's collectives on the model's units, calibrates FSDP's memory in two
real FSDP micro-steps (where FSDP is a candidate), generates and ranks the same candidates, and runs each measured
candidate for real (warm-up, then timed steps; the step time is the slowest rank's, local SGD's over
windows that hold one averaging; the memory the highest rank's peak above its baseline, taken once the allocator has
handed back what earlier runs freed), after one
unrecorded run per way of communicating. Rank 0 writes the results JSON the planner prints. Every rank ends with
``exit_without_teardown``: through Python's teardown a rank could abort after its work was done (a gloo thread
freeing a backward's collective needs the GIL of a finalizing interpreter), and the planner would call it failed.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from convoy.errors import ConfigError
from convoy.procs import exit_without_teardown
from convoy.runtime.devices import choose_backend
from convoy.strategy import candidates as cands
from convoy.strategy.apply import accelerate, train_step
from convoy.strategy.dryrun import CONFIG_ERROR
from convoy.strategy.features import call, profile
from convoy.strategy.links import measured_links
from convoy.strategy.links import shared as _shared
from convoy.strategy.memory import ModelFeatures, activation_bytes, predict
from convoy.strategy.plan import Strategy
from convoy.strategy.search import CommCosts, predict_time, successive_halving
from convoy.strategy.device import PeakMemory, autocast, memory_limit, on_device, timed_on
from convoy.strategy.workload import Workload, load_workload

WARMUP = 1
DEVICE = torch.device("cpu")
"""Where this rank's candidates train: its own GPU on a CUDA node (``main``), else the CPU."""


def run_candidate(workload: Workload, strategy: Strategy, steps: int, comm: Any,
                  warmup: int = WARMUP) -> tuple[list[float], float]:
    """(each timed step's seconds on the slowest rank, the highest rank's peak bytes above its baseline).

    The baseline is taken after the allocator hands back its free pages (``release_free``): what this run allocates
    counts whatever earlier runs left free, as in a process of its own; its timed steps still reuse what its warm-up
    step freed, as a training process's steps do."""
    rank = dist.get_rank()
    # local SGD's steps are timed in windows of sync_every (each holds one averaging); a window's mean
    # is one of its times
    window = strategy.sync_every if strategy.kind == "local" else 1
    gc.collect()
    memory = PeakMemory(DEVICE)
    memory.baseline()
    model = workload.model().to(DEVICE)
    model, optimizer = accelerate(model, workload.optimizer(model.parameters()), strategy, comm=comm)
    inputs, targets = on_device(workload.batch(strategy.batch, 100 + rank), DEVICE)
    for _ in range(warmup):
        train_step(model, optimizer, workload.loss, inputs, targets)
    gc.collect()
    dist.barrier()
    memory.reset()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        with timed_on(DEVICE):
            for _ in range(window):
                train_step(model, optimizer, workload.loss, inputs, targets)
        times.append((time.perf_counter() - start) / window)
    peak = float(memory.peak())
    per_step = torch.tensor([*times, peak], dtype=torch.float64)
    dist.all_reduce(per_step, op=dist.ReduceOp.MAX)
    del model, optimizer, inputs, targets
    gc.collect()
    torch.set_num_threads(1)
    dist.barrier()
    return per_step[:-1].tolist(), float(per_step[-1])


Way = tuple[str, str, str]


def _way(strategy: Strategy) -> Way:
    """How a strategy communicates, as ``prime`` tells them apart (a pipeline's schedule orders its messages)."""
    return strategy.kind, strategy.allreduce, strategy.schedule if strategy.kind == "pipeline" else ""


def _bf16_samples(strategy: Strategy) -> int:
    """Samples of a whole-model micro-step whose matrix shapes a bfloat16 candidate's layers use (a sequence cut's
    layers see ``1/sequence`` of each sample's positions)."""
    return max(1, strategy.micro_batch // (strategy.sequence if strategy.kind == "sequence" else 1))


def prime(workload: Workload, strategies: list[Strategy], comm: Any, primed: set[Way]) -> None:
    """One run, not recorded, for each way of communicating among ``strategies`` not in ``primed`` yet: the
    process's one-time allocations (autograd's threads, gloo's pairs and buffers, the hierarchical allreduce's
    staging buffers, local SGD's groups, lazily loaded kernels) would otherwise count as the memory of the
    first candidate measured with each. Before them, one bfloat16 micro-step of the unwrapped model for each
    micro-batch size a bfloat16 candidate uses: autocast's kernels keep what they made for each new shape for the
    process's life (about 7 MB for each size on case d's transformer), which would count as the memory of whichever
    candidate first ran that size."""
    for samples in sorted({_bf16_samples(s) for s in strategies if s.bf16}):
        if ("bf16", str(samples), "") not in primed:
            primed.add(("bf16", str(samples), ""))
            model = workload.model().to(DEVICE)
            inputs, targets = on_device(workload.batch(samples, 100 + dist.get_rank()), DEVICE)
            with autocast(DEVICE, bf16=True):
                loss = workload.loss(call(model, inputs), targets)
            loss.backward()
            del model, loss
    for strategy in strategies:
        if _way(strategy) not in primed:
            primed.add(_way(strategy))
            run_candidate(workload, strategy, 0, comm)  # its warm-up step makes them


def exhaustive(workload: Workload, feasible: list[Strategy], steps: int, rounds: int, comm: Any,
               primed: set[Way]) -> list[dict]:
    """Every feasible candidate measured in ``rounds`` rounds of ``steps`` timed steps, each round in
    another order (a drift of the machine's speed falls on all alike): the median of all its steps. The
    ways of communicating the search did not run are primed first, as the search primes its own."""
    prime(workload, feasible, comm, primed)
    times: dict[Strategy, list[float]] = {s: [] for s in feasible}
    peaks: dict[Strategy, list[float]] = {s: [] for s in feasible}
    for round_index in range(rounds):
        shift = round_index * max(1, len(feasible) // rounds)
        for strategy in feasible[shift:] + feasible[:shift]:
            found, peak = run_candidate(workload, strategy, steps, comm)
            times[strategy] += found
            peaks[strategy].append(peak)
    return [{"strategy": s.to_dict(), "seconds": statistics.median(times[s]), "peak": max(peaks[s]),
             "peaks": peaks[s]} for s in feasible]


def calibrate_fsdp(workload: Workload, features: ModelFeatures, hardware: cands.Hardware, comm: Any,
                   primed: set[Way]) -> tuple[ModelFeatures, str | None, list[float]]:
    """FSDP's peak measured in real micro-steps of 1 sample and of the most of the rank's batch the traced model
    says fits, after one unrecorded run: a line in the micro-batch's
    activations, whose fixed part and slope ``predict`` then uses; also the note to print and the peaks (for the
    count of runs over the limit). Unchanged where FSDP is no candidate."""
    world = dist.get_world_size()
    if world == 1 or not features.has_blocks:
        return features, None, []
    limit = hardware.memory_limit * cands.HEADROOM
    sizes = [m for m in cands.micro_batches(features.batch)
             if m > 1 and predict(features, Strategy(kind="fsdp", micro_batch=m), world).peak <= limit]
    if not sizes:
        return features, "FSDP not calibrated: no micro-batch of 2 or more fits the limit by the traced model", []
    small, large = Strategy(kind="fsdp", micro_batch=1), Strategy(kind="fsdp", micro_batch=max(sizes))
    prime(workload, [small], comm, primed)
    peaks = [run_candidate(workload, s, 1, comm)[1] for s in (small, large)]
    acts = [activation_bytes(features, s) for s in (small, large)]
    share = min(max((peaks[1] - peaks[0]) / (acts[1] - acts[0]), 0.05), 1.5) if acts[1] > acts[0] else 1.0
    static = predict(features, small, world).static
    fixed = max(peaks[0] - static - share * acts[0], 0.0)
    note = (f"FSDP calibrated on real micro-steps of 1 and {large.micro_batch} sample(s): peaks {peaks[0] / 1e6:.1f} "
            f"and {peaks[1] / 1e6:.1f} MB, so {fixed / 1e6:.1f} MB beside the static share and {share:.2f} of the "
            "activations")
    return replace(features, fsdp_fixed=fixed, fsdp_activation_share=share), note, peaks


def fsdp_contends(rows: list[cands.Candidate], step_time: Any, keep: int) -> bool:
    """Whether an FSDP candidate could be among the ``keep`` the search measures, whatever calibrating its memory
    finds: fewer than ``keep`` others fit, or an FSDP combination (any micro-batch) is predicted faster than the
    ``keep``-th fastest of them. Where not, its calibration is skipped (FSDP's time does not depend on it)."""
    others = sorted(step_time(c.strategy) for c in cands.kept(rows) if c.strategy.kind != "fsdp")
    fsdp = [step_time(c.strategy) for c in rows if c.strategy.kind == "fsdp"]
    return bool(fsdp) and (len(others) < keep or min(fsdp) < others[keep - 1])


def _calibrated(workload: Workload, features: ModelFeatures, hardware: cands.Hardware, comm: Any, costs: CommCosts,
                primed: set[Way]) -> tuple[ModelFeatures, list[cands.Candidate], str | None, list[float]]:
    """FSDP calibrated (``calibrate_fsdp``), and the candidates generated again with its memory."""
    features, note, peaks = calibrate_fsdp(workload, features, hardware, comm, primed)
    rows = cands.generate(features, hardware, lambda s: predict_time(features, s, hardware, costs))
    return features, rows, note, peaks


def _table_rows(rows: list[cands.Candidate], predicted: dict[Strategy, float]) -> list[dict]:
    return [{"strategy": c.strategy.to_dict(), "name": c.strategy.name(), "memory": c.memory.peak,
             "predicted_s": predicted[c.strategy], "dropped": c.dropped} for c in rows]


def _preload() -> None:
    """Import what the strategies use now, so no candidate's memory counts loading code."""
    from torch.distributed._composable import checkpoint  # noqa: F401
    from torch.distributed.fsdp import fully_shard  # noqa: F401
    from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: F401
    from torch.nn.parallel import DistributedDataParallel  # noqa: F401

    from convoy.parallel.sequence import query_broadcast  # noqa: F401


def _profiled(workload: Workload, rank: int) -> tuple[ModelFeatures, list[str]]:
    """Rank 0 profiles the model and every rank takes its figures (one profile, the same on all)."""
    if rank == 0:
        features, notes = profile(workload)
        shared = _shared([features.to_dict(), notes])
    else:
        shared = _shared(None)
    return ModelFeatures.from_dict(shared[0]), shared[1]


def _search(workload: Any, ranked: list[Strategy], spec: dict[str, Any], comm: Any, primed: set[Way],
            phase: Callable[[str], None]) -> tuple[Strategy, dict[Strategy, list[dict]], dict[Strategy, float]]:
    """The measured search over the candidates ``ranked`` by predicted time: the winner, each candidate's runs,
    and each one's figure (the median of all its steps, from the last round it ran in)."""
    runs: dict[Strategy, list[dict]] = {}

    def measure(strategy: Strategy, steps: int) -> list[float]:
        times, peak = run_candidate(workload, strategy, steps, comm)
        runs.setdefault(strategy, []).append({"steps": steps, "seconds": statistics.median(times), "peak": peak})
        return times

    prime(workload, ranked[:spec["keep"]], comm, primed)  # among those to be measured
    phase("first runs")
    winner, rounds = successive_halving(ranked, measure, keep=spec["keep"], first_steps=spec["first_steps"])
    phase("halving")
    figure = {m.candidate: m.seconds for results in rounds for m in results}  # the last round's: all steps
    return winner, runs, figure


def _grid(workload: Any, spec: dict[str, Any], result: dict[str, Any], notes: list[str], features: ModelFeatures,
          feasible: list[Strategy], links: tuple[cands.Hardware, Any, CommCosts, set[Way]], calibrate: bool) -> None:
    """The exhaustive grid the benchmark compares the search with, into ``result``: every feasible candidate
    (``links``: hardware, comm, costs, the ways of communicating already warmed up); ``calibrate``: FSDP's
    calibration first, where the search did not run it."""
    hardware, comm, costs, primed = links
    if calibrate:
        start = time.perf_counter()
        features, rows, calibrated, result["calibration_peaks"] = _calibrated(workload, features, hardware, comm,
                                                                              costs, primed)
        notes.extend([f"{calibrated} (for the grid, after the search)"] if calibrated else [])
        predicted = {c.strategy: predict_time(features, c.strategy, hardware, costs) for c in rows}
        result["features"], result["rows"] = features.to_dict(), _table_rows(rows, predicted)
        feasible = [c.strategy for c in cands.kept(rows)]
        result["grid_calibration_s"] = time.perf_counter() - start
    start = time.perf_counter()
    result["exhaustive"] = exhaustive(workload, feasible, spec["exhaustive_steps"], spec.get("exhaustive_rounds", 1),
                                      comm, primed)
    result["exhaustive_s"] = time.perf_counter() - start


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    _preload()
    global DEVICE
    choice = choose_backend(None, torch.cuda.device_count(), int(os.environ.get("LOCAL_RANK", "0")),
                            os.environ.get("CUDA_VISIBLE_DEVICES"))
    if choice.device_index is not None:
        torch.cuda.set_device(choice.device_index)
    DEVICE = torch.device(choice.device)
    dist.init_process_group(choice.backend)
    rank = dist.get_rank()
    torch.set_num_threads(1)
    started = time.perf_counter()
    sys.argv = [spec["script"], *spec["args"]]
    workload = load_workload(spec["script"])
    hardware = cands.Hardware(spec["nodes"], spec["nproc_per_node"], memory_limit(DEVICE, spec["memory"]),
                              spec["cores"])
    phases: dict[str, float] = {}
    mark = [started]

    def phase(name: str) -> None:
        now = time.perf_counter()
        phases[name] = now - mark[0]
        mark[0] = now

    features, notes = _profiled(workload, rank)
    phase("profile")
    comm, costs, notes = measured_links(hardware, features, notes)
    phase("links")
    primed: set[Way] = set()
    rows = cands.generate(features, hardware, lambda s: predict_time(features, s, hardware, costs))
    calibration_peaks: list[float] = []
    contends = fsdp_contends(rows, lambda s: predict_time(features, s, hardware, costs), spec["keep"])
    if contends:
        features, rows, calibrated, calibration_peaks = _calibrated(workload, features, hardware, comm, costs, primed)
        notes = notes + [calibrated] if calibrated else notes
    elif any(c.strategy.kind == "fsdp" for c in rows):
        notes = notes + [f"FSDP not calibrated: no FSDP candidate is predicted among the {spec['keep']} fastest"]
    phase("FSDP calibration")
    predicted = {c.strategy: predict_time(features, c.strategy, hardware, costs) for c in rows}
    result: dict[str, Any] = {"features": features.to_dict(), "notes": notes, "comm": costs.to_dict(),
                              "rows": _table_rows(rows, predicted), "calibration_peaks": calibration_peaks}
    feasible = [c.strategy for c in cands.kept(rows)]
    if not feasible:
        result["error"] = "none fits"
    else:
        ranked = sorted(feasible, key=lambda s: predicted[s])
        winner, runs, figure = _search(workload, ranked, spec, comm, primed, phase)
        result["search_s"] = time.perf_counter() - started
        result["phases"] = phases
        notes.append(f"search {result['search_s']:.1f} s: " + ", ".join(f"{name} {seconds:.1f} s"
                                                                    for name, seconds in phases.items()))
        result["winner"] = winner.to_dict()
        result["measured"] = [{"strategy": s.to_dict(), "seconds": figure[s], "runs": found}
                              for s, found in runs.items()]
        if spec["exhaustive_steps"]:
            calibrate = not contends and any(c.strategy.kind == "fsdp" for c in rows)  # the grid runs FSDP
            _grid(workload, spec, result, notes, features, feasible, (hardware, comm, costs, primed), calibrate)
    if comm is not None:
        comm.close()
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps(result, indent=1))
    dist.barrier()  # every rank past its last collective
    return 0


if __name__ == "__main__":
    try:
        code = main(sys.argv[1])
    except ConfigError as exc:  # the script or the plan is wrong: one line the planner shows as it is
        print(f"{CONFIG_ERROR}{exc}", flush=True)
        code = 2
    exit_without_teardown(code)
