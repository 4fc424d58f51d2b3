"""One rank of the sequence-parallel attention benchmark (or a single-device peer with --single).

    python sequence_worker.py --scheme S --length L [--heads H] --kv-heads K [--causal] --reps N --out FILE
    (RANK, WORLD_SIZE, MASTER_ADDR/PORT in env; with --single: one process, no env, and S is
    sdpa, torch's scaled_dot_product_attention on the whole sequence (its fused flash kernels,
    grouped K/V heads taken as they are), or naive, plain autograd attention holding the L x L scores)

A fresh process per configuration, so its peak memory is its own: after a tiny warm-up call
(libraries, communication buffers) and one forward and backward at full size (what a first pass
alone allocates for good), the kernel's high-water mark of the resident size is reset; the peak is
the most that the measured forward and backward then added to what the process held before it
(reported too, as the process's bytes). Then the timed reps: forward alone, and forward plus
backward, and the bytes this rank sent in each.
With ``--check`` the outputs and gradients are compared with single-device attention on the
whole sequence, computed in float64 on every rank. ``--scheme A,B`` times several schemes in the
same processes, their reps interleaved (A B, B A, A B, ...) so that both see the same machine
(a shared, noisy one) and a ratio of their medians is fair; the memory and the check are then
those of the first scheme.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
import torch.nn.functional as F

import convoy
from convoy.parallel.sequence import attention
from convoy.parallel.sequence.query_broadcast import sequence_attention

B, HEAD_DIM = 1, 64
HEADS = 8
"""Query heads (``--heads``)."""


def inputs(length: int, kv_heads: int, parts: range) -> tuple[torch.Tensor, ...]:
    """q, k, v and the output gradient for the given parts of the sequence (each part its own
    seed), so a rank makes only its own part and a check can make them all."""
    def make(index: int, heads: int) -> torch.Tensor:
        chunks = [torch.randn(B, heads, length, HEAD_DIM, generator=torch.Generator().manual_seed(index * 1000 + p))
                  for p in parts]
        return torch.cat(chunks, dim=2)
    return make(0, HEADS), make(1, kv_heads), make(2, kv_heads), make(3, HEADS)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scheme", default="query_broadcast", help="a scheme, or several comma-separated")
    parser.add_argument("--length", type=int, required=True)
    parser.add_argument("--heads", type=int, default=HEADS)
    parser.add_argument("--kv-heads", type=int, default=HEADS)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--micro", default="auto", help="query micro-sequences per rank, or auto (auto_chunks)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--single", action="store_true", help="single-device attention (sdpa or naive), one process")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    globals()["HEADS"] = args.heads
    torch.set_num_threads(1)
    rank, world = 0, 1
    if not args.single:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    local = args.length // world
    q, k, v, grad = inputs(local, args.kv_heads, range(rank, rank + 1) if world > 1 else range(1))
    q.requires_grad_(True)
    k.requires_grad_(True)
    v.requires_grad_(True)

    schemes = args.scheme.split(",")

    def run(scheme: str, *tensors: torch.Tensor) -> torch.Tensor:
        if args.single:
            return single(scheme, *tensors, causal=args.causal)
        micro = None if args.micro == "auto" else min(int(args.micro), tensors[0].shape[2])  # warm-up: 8 positions
        return sequence_attention(*tensors, scheme, causal=args.causal, micro=micro, check=False)

    warm = inputs(8, args.kv_heads, range(1))  # libraries and buffers first, so the peak is attention's
    warm = [t.requires_grad_(True) for t in warm[:3]]
    for scheme in schemes:
        run(scheme, *warm).sum().backward()
    run(schemes[0], q, k, v).backward(grad)  # once at full size: what the first pass alone allocates for good
    q.grad = k.grad = v.grad = None
    reset_peak()
    before = psutil.Process().memory_info().rss
    out = run(schemes[0], q, k, v)
    out.backward(grad)
    peak = high_water() - before
    result = {"peak_bytes": peak, "process_bytes": before}
    if args.check:
        result["errors"] = check(q, k, v, grad, out, args, rank, world)
    times = {scheme: {"forward": [], "forward_backward": []} for scheme in schemes}
    traffic = {scheme: {"forward": 0, "forward_backward": 0} for scheme in schemes}
    for rep in range(args.reps):
        for scheme in schemes if rep % 2 == 0 else schemes[::-1]:
            for what in ("forward", "forward_backward"):
                q.grad = k.grad = v.grad = None
                if not args.single:
                    dist.barrier()
                attention.TRAFFIC.reset()
                start = time.perf_counter()
                out = run(scheme, q, k, v)
                if what == "forward_backward":
                    out.backward(grad)
                if not args.single:
                    dist.barrier()
                times[scheme][what].append(time.perf_counter() - start)
                traffic[scheme][what] = attention.TRAFFIC.reset()
    result["schemes"] = {scheme: {f"{what}_s": statistics.median(t) for what, t in times[scheme].items()}
                         for scheme in schemes if args.reps}
    for scheme, row in result["schemes"].items():
        row["bytes_forward"] = traffic[scheme]["forward"]
        row["bytes_backward"] = traffic[scheme]["forward_backward"] - traffic[scheme]["forward"]
    result.update(result["schemes"].get(schemes[0], {}))
    everyone = [result]
    if not args.single:
        everyone = [None] * world
        dist.all_gather_object(everyone, result)
    if rank == 0:
        args.out.write_text(json.dumps(everyone))
    convoy.exit_without_teardown()


def reset_peak() -> None:
    """Start the kernel's high-water mark of this process's resident size afresh (Linux: clear_refs 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def high_water() -> int:
    """The most bytes this process has held resident since ``reset_peak`` (VmHWM)."""
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) * 1024


def single(scheme: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """The whole sequence on one device: ``sdpa`` or ``naive`` (``attention.reference``)."""
    if scheme == "naive":
        return attention.reference(q, k, v, causal=causal)
    if scheme != "sdpa":
        raise SystemExit(f"--single runs sdpa or naive, not {scheme}")
    # query head h reads K/V head h // (heads / kv heads), as the reference's grouping does
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])


def check(q, k, v, grad, out, args, rank, world) -> dict:  # noqa: ANN001
    """Max abs error of this rank's output and gradients against float64 single-device attention."""
    local = args.length // world
    *full, full_grad = (t.double() for t in inputs(local, args.kv_heads, range(world)))
    full = [t.requires_grad_(True) for t in full]
    want = attention.reference(*full, causal=args.causal)
    want.backward(full_grad)
    part = slice(rank * local, (rank + 1) * local)
    pairs = {"out": (out, want), "dq": (q.grad, full[0].grad), "dk": (k.grad, full[1].grad),
             "dv": (v.grad, full[2].grad)}
    return {name: float((a.detach().double() - b[:, :, part].detach()).abs().max()) for name, (a, b) in pairs.items()}


if __name__ == "__main__":
    sys.exit(main())
