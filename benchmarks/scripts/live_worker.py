"""The job of benchmarks/live_config.py: the live-config example's DDP regression with knobs for measuring.

Same model, data, fixed-order all_reduce and log lines as examples/train_live_config.py (``step lr batch_size
loss round started``, one file per rank in ``--log-dir``), plus: ``--compute-reps`` square matmuls per step (a
step of real compute), ``--report off`` (no ``convoy.report``: the A/B of its cost), and ``--stats`` (per rank,
JSON: the seconds each ``convoy.report`` call took on the training thread, and the CPU time of convoy's
``convoy-report`` sender thread, read from /proc and from its thread CPU clock).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import convoy

COMPUTE_N = 192
"""The side of the matrices ``--compute-reps`` multiplies."""


@dataclass
class Config:
    lr: float = convoy.hot(0.01, min=0.0, max=100.0, doc="Adam's learning rate")
    steps: int = convoy.hot(300, min=1, doc="steps to train")
    batch_size: int = convoy.restart(32, min=1, max=4096, doc="samples per rank and step")


def sender_cpu() -> dict[str, float | None]:
    """CPU seconds of the ``convoy-report`` thread: utime+stime from /proc (clock ticks) and its CPU clock."""
    thread = next((t for t in threading.enumerate() if t.name == "convoy-report"), None)
    if thread is None or thread.native_id is None:
        return {"proc_s": None, "clock_s": None}
    try:
        stat = Path(f"/proc/self/task/{thread.native_id}/stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": field 3 onwards
        proc_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14, 15
    except (OSError, ValueError, IndexError):
        proc_s = None
    try:
        clock_s = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))  # type: ignore[arg-type]
    except (OSError, AttributeError, TypeError):
        clock_s = None
    return {"proc_s": proc_s, "clock_s": clock_s}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--step-time", type=float, default=0.0, help="seconds of sleep per step")
    parser.add_argument("--compute-reps", type=int, default=0, help="COMPUTE_N-square matmuls per step")
    parser.add_argument("--log-dir", default="")
    parser.add_argument("--out", default="", help="final parameters (rank 0)")
    parser.add_argument("--max-steps", type=int, default=0, help="stop here even if the config's steps is more")
    parser.add_argument("--report", choices=("on", "off"), default="on")
    parser.add_argument("--stats", default="", help="a directory: rank<N>.json with the report timings")
    args = parser.parse_args()

    torch.set_num_threads(1)
    ctx = convoy.init()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.Adam(net.parameters())
    data = torch.Generator().manual_seed(1000 + ctx.rank)
    true_weights = torch.linspace(-1, 1, 16)
    ckpt = convoy.Checkpointer(net, optimizer, state={"data": data}, replicated=True)
    start = ckpt.restore()
    cfg = convoy.train_config(Config, step=start)
    log = open(Path(args.log_dir) / f"rank{ctx.rank}.log", "a") if args.log_dir else None  # noqa: SIM115
    square = torch.randn(COMPUTE_N, COMPUTE_N, generator=torch.Generator().manual_seed(7)) / COMPUTE_N
    product = torch.empty_like(square)
    in_report: list[float] = []
    in_report_cpu: list[float] = []
    began = time.perf_counter()
    step = start
    while step < cfg.steps and not (args.max_steps and step >= args.max_steps):
        started = time.time()
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr
        for _ in range(args.compute_reps):
            torch.mm(square, square, out=product)
        inputs = torch.randn(cfg.batch_size, 16, generator=data)
        targets = (inputs @ true_weights).unsqueeze(1) + 0.01 * torch.randn(cfg.batch_size, 1, generator=data)
        loss = torch.nn.functional.mse_loss(net(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        grads = [p.grad for p in net.parameters()]
        flat = torch.cat([g.flatten() for g in grads])
        torch.distributed.all_reduce(flat)
        flat /= ctx.world_size
        torch.nn.utils.vector_to_parameters(flat, grads)
        optimizer.step()
        ckpt.step(step)
        value = loss.item()
        if log is not None:
            log.write(f"{step} {cfg.lr!r} {cfg.batch_size} {value!r} {ctx.round_id} {started!r}\n")
            log.flush()
        if args.report == "on":
            before, before_cpu = time.perf_counter(), time.thread_time()
            convoy.report(step, loss=value if math.isfinite(value) else float("nan"), samples=cfg.batch_size)
            in_report.append(time.perf_counter() - before)
            in_report_cpu.append(time.thread_time() - before_cpu)
        if args.step_time:
            time.sleep(args.step_time)
        step += 1
    wall = time.perf_counter() - began
    if args.stats:
        stats = {"rank": ctx.rank, "steps": step - start, "wall_s": wall, "in_report_s": in_report,
                 "in_report_cpu_s": in_report_cpu,
                 "sender": sender_cpu(), "train_cpu_s": time.thread_time()}
        Path(args.stats, f"rank{ctx.rank}.json").write_text(json.dumps(stats))
    ckpt.close()
    if args.out and ctx.rank == 0:
        torch.save({name: tensor.clone() for name, tensor in net.state_dict().items()}, args.out)
    if ctx.rank == 0:
        print(f"finished {step} steps, lr {cfg.lr}, batch {cfg.batch_size}", flush=True)


if __name__ == "__main__":
    main()
