"""Group-wise local SGD on a character-level language model: n model groups x m pipeline stages.

    convoy run --nnodes 2 --nproc-per-node 2 examples/train_local_sgd.py --shards 2 --every 8

Text: the Python standard library's own ``.py`` files (every Python ships them), read in sorted
order, one byte per token; every 20th block of 8 KB is held out. Model: a small causal transformer cut into
``--shards`` pipeline stages, run with 1F1B over micro-batches inside each model group (text and model are
in ``lm_model.py``). Each
group reads its own stream of windows. ``--sync``:

- ``local``: convoy's ``LocalSGD``: each shard syncs over its shard group every ``--every``
  steps, by plain averaging or Nesterov momentum on the averaged delta (``--outer``), at
  staggered times with ``--stagger``;
- ``ddp``: synchronous data parallelism: every step each shard's gradients are averaged over its
  shard group in one allreduce (what DDP does with one bucket; DDP's own hooks would fire once
  per micro-batch of the pipeline);
- ``torch-averager``: torch's ``PeriodicModelAverager`` on each shard group every ``--every`` steps.

Every ``--log-every`` steps the last stage of group 0 prints the loss and the bytes this rank sent
to other groups. Rank 0 ends with the held-out loss of the final model and, with ``--out``, writes
the per-step curve (each group's losses), bytes and wall time as JSON. Under convoy with
``--nproc-per-node`` equal to ``--shards`` (a node is a group), every step is snapshotted in
memory: a node that fails leaves the next sync to the others, one that joins copies its shards
from a peer.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from lm_model import build_model, corpus, held_out_loss, lm_loss, split_corpus, windows
from torch import nn

import convoy
from convoy.errors import ConvoyError
from convoy.parallel.local_sgd import OUTERS, Groups, Layout, LocalSGD, make_groups, outer_from_name, shard_model
from convoy.parallel.pipeline import schedule as plans
from convoy.parallel.pipeline.runtime import PipelineRuntime


def lr_factor(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up over ``--warmup`` steps, then cosine decay to ``--final-lr`` at the last step."""
    if step < args.warmup:
        return (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - 1 - args.warmup))
    return args.final_lr + (1 - args.final_lr) * 0.5 * (1 + math.cos(math.pi * progress))


def average_gradients(params: list[nn.Parameter], group: dist.ProcessGroup, n: int) -> None:
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat.div_(n)
    torch.nn.utils.vector_to_parameters(flat, grads)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=2, help="ranks per model group (pipeline stages)")
    parser.add_argument("--every", type=int, default=8, help="inner steps between syncs (H)")
    parser.add_argument("--sync", choices=["local", "ddp", "torch-averager"], default="local")
    parser.add_argument("--outer", choices=OUTERS, default="average",
                        help="average (best at small H) or nesterov (DiLoCo's, for H in the hundreds)")
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--stagger", action="store_true", help="shards sync at staggered steps")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64, help="windows per group per step")
    parser.add_argument("--micro", type=int, default=4, help="micro-batches per step in the pipeline")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1.2e-2, help="inner AdamW learning rate")
    parser.add_argument("--warmup", type=int, default=20, help="steps of linear LR warm-up, then cosine decay")
    parser.add_argument("--final-lr", type=float, default=1.0,
                        help="the LR at the last step, as a fraction of --lr (1: constant after warm-up)")
    parser.add_argument("--seed", type=int, default=0, help="initial weights and data streams")
    parser.add_argument("--corpus-bytes", type=int, default=4_000_000)
    parser.add_argument("--eval-batches", type=int, default=50)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (to slow it down)")
    parser.add_argument("--out", default="", help="rank 0 writes the curve, bytes and wall time here (JSON)")
    args = parser.parse_args()
    if args.steps < 1 or args.batch < 1 or args.micro < 1 or args.batch % args.micro:
        parser.error("--steps and --micro must be >= 1 and --batch a multiple of --micro")
    return args


def main() -> int:
    args = parse()
    torch.set_num_threads(int(os.environ.get("CONVOY_THREADS", "1")))
    ctx = convoy.init()
    layout = Layout.from_world(ctx.world_size, args.shards)
    groups = make_groups(layout)
    group, shard = groups.group_index, groups.shard_index
    stage = shard_model(build_model(args.width, args.layers, args.heads, args.context, args.seed), layout, shard)
    params = list(stage.parameters())
    inner = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(inner, lambda step: lr_factor(step, args))
    runtime = PipelineRuntime(plans.one_f_one_b(args.shards, args.micro), {shard: stage}, lm_loss, group=groups.model)
    train, held = split_corpus(corpus(args.corpus_bytes))
    # one stream per group; its position is checkpointed
    stream = torch.Generator().manual_seed(1000 * (args.seed + 1) + group)
    lsgd = LocalSGD(params, groups, args.every, outer_from_name(args.outer, args.outer_lr, args.outer_momentum),
                    stagger=args.stagger) if args.sync == "local" else None
    averager = None
    if args.sync == "torch-averager":
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

        averager = PeriodicModelAverager(period=args.every, warmup_steps=0, process_group=groups.shard)
    sent = [0.0]  # bytes this rank sent to other groups, for the ddp and torch-averager modes

    class Counter:
        def state_dict(self) -> dict:
            return {"sent": sent[0]}

        def load_state_dict(self, state: dict) -> None:
            sent[0] = state["sent"]

    shared = {"local_sgd": lsgd} if lsgd is not None else {"sent": Counter()}
    shared["lr"] = schedule
    ckpt = convoy.Checkpointer(stage, inner, state={"data": stream}, model_state=shared,
                               replicated=layout.shard_groups())
    start = ckpt.restore()
    last = shard == args.shards - 1
    if ctx.rank == 0:
        print(f"{layout.n_groups} groups x {layout.n_shards} shards, sync {args.sync}"
              + (f" ({args.outer}, every {args.every}{', staggered' if args.stagger else ''})"
                 if args.sync == "local" else "")
              + f"; starting at step {start} (round {ctx.round_id}, {ckpt.restored_from})", flush=True)
    losses: list[tuple[int, float]] = []
    dist.barrier()
    began = time.perf_counter()
    for step in range(start, args.steps):
        x, y = windows(train, args.batch, args.context, stream)
        inner.zero_grad()
        mb_losses = runtime.step(x if shard == 0 else None, y if last else None)
        if args.sync == "ddp":
            average_gradients(params, groups.shard, layout.n_groups)
            sent[0] += layout.cross_bytes(sum(p.numel() * p.element_size() for p in params))
        inner.step()
        schedule.step()
        if lsgd is not None:
            synced = lsgd.step(step)
            if synced and ctx.rank == 0:
                print(f"step {step}: shard {shard} synced over {layout.n_groups} group(s)", flush=True)
        elif averager is not None:
            if (averager.step - averager.warmup_steps) % averager.period == 0:
                sent[0] += layout.cross_bytes(sum(p.numel() * p.element_size() for p in params))
            averager.average_parameters(params)
        ckpt.step(step)
        if args.step_time:
            time.sleep(args.step_time)
        if mb_losses is not None:
            loss = sum(mb_losses) / len(mb_losses)
            losses.append((step, loss))
            if group == 0 and (step % args.log_every == 0 or step == args.steps - 1):
                done = lsgd.bytes_sent if lsgd is not None else sent[0]
                print(f"step {step} loss {loss:.4f}, sent to other groups {done / (step + 1) / 1e3:.1f} kB/step",
                      flush=True)
    if lsgd is not None:
        lsgd.finish()  # every shard synced once more: the replicas end identical
    wall = time.perf_counter() - began
    ckpt.close()
    identical = replicas_identical(params, groups)
    curves: list = [None] * ctx.world_size
    dist.all_gather_object(curves, losses)
    pieces: list = [None] * layout.n_shards
    dist.all_gather_object(pieces, stage.state_dict() if group == 0 else None, group=groups.model)
    if ctx.rank == 0:
        model = build_model(args.width, args.layers, args.heads, args.context, args.seed)
        for index, piece in enumerate(pieces):
            shard_model(model, layout, index).load_state_dict(piece)
        held_loss = held_out_loss(model, held, args.context, args.eval_batches)
        sent_bytes = lsgd.bytes_sent if lsgd is not None else sent[0]
        print(f"replicas identical after the last step: {'yes' if identical else 'NO'}", flush=True)
        print(f"held-out loss {held_loss:.4f} ({held_loss / math.log(2):.3f} bits/byte); sent to other groups "
              f"{sent_bytes / 1e6:.2f} MB by rank 0 ({sent_bytes / args.steps / 1e3:.1f} kB/step); "
              f"{wall:.1f} s for steps {start}..{args.steps - 1}", flush=True)
        if args.out:
            by_group = {g: curves[layout.rank(g, args.shards - 1)] for g in range(layout.n_groups)}
            Path(args.out).write_text(json.dumps({
                "sync": args.sync, "outer": args.outer, "seed": args.seed, "every": args.every, "stagger": args.stagger,
                "groups": layout.n_groups, "shards": layout.n_shards, "steps": args.steps,
                "params": sum(p.numel() for p in model.parameters()), "held_out_loss": held_loss,
                "cross_bytes_rank0": sent_bytes, "wall_s": wall, "identical": identical, "curves": by_group}))
    dist.barrier()
    convoy.exit_without_teardown()


@torch.no_grad()
def replicas_identical(params: list[nn.Parameter], groups: Groups) -> bool:
    """Whether every rank of each shard group holds the same shard, bit for bit (by digest, so
    the check itself adds almost nothing to the traffic between groups)."""
    digest = hashlib.sha256(torch.cat([p.detach().reshape(-1) for p in params]).numpy().tobytes()).hexdigest()
    digests: list = [None] * groups.layout.n_groups
    dist.all_gather_object(digests, digest, group=groups.shard)
    verdict = torch.tensor([int(len(set(digests)) == 1)])
    dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
    return bool(verdict.item())


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConvoyError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
