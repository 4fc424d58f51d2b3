"""One small DDP training loop for benchmarks/ray_scheduler.py, under convoy and under Ray Train's TorchTrainer.

    python ray_ddp.py --out DIR [--steps N] [--sleep S]                        (a convoy job's script)
    python ray_ddp.py --ray ADDRESS --out DIR --storage DIR [--steps N] ...   (the Ray Train driver)

Every finished step each rank appends ``rank step pid time round`` to DIR/rank{RANK}.txt (``steplog.StepLog``
reads them). convoy keeps its state in in-memory snapshots (``convoy.Checkpointer``); Ray Train as its users do:
rank 0 reports a checkpoint to local storage after every step, ``FailureConfig(max_failures=1)``, an elastic
``ScalingConfig(num_workers=(MIN, MAX))``, one CPU and one ``convoy_node`` per worker (the nodes convoy uses).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    return net, torch.optim.Adam(net.parameters(), lr=0.01)


def one_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: torch.Generator) -> None:
    inputs = torch.randn(32, 16, generator=data)
    loss = torch.nn.functional.mse_loss(model(inputs), inputs.sum(dim=1, keepdim=True))
    optimizer.zero_grad()
    loss.backward()  # DDP's allreduce: a step finishes only when every rank takes part
    optimizer.step()


def shared_round() -> int:
    """An id every rank of this process group shares, larger for a later group: rank 0's clock, broadcast."""
    stamp = torch.tensor([int(time.time() * 1000) % 2**53], dtype=torch.float64)
    dist.broadcast(stamp, 0)
    return int(stamp.item())


def run_convoy(args: argparse.Namespace) -> None:
    import convoy
    from torch.nn.parallel import DistributedDataParallel

    ctx = convoy.init()
    net, optimizer = build()
    model = DistributedDataParallel(net)
    data = torch.Generator().manual_seed(ctx.rank)
    ckpt = convoy.Checkpointer(model, optimizer, state={"data": data}, persist_every=0, replicated=True)
    start = ckpt.restore()
    with open(os.path.join(args.out, f"rank{ctx.rank}.txt"), "a") as out:
        for step in range(start, args.steps):
            time.sleep(args.sleep)
            one_step(model, optimizer, data)
            ckpt.step(step)
            out.write(f"{ctx.rank} {step} {os.getpid()} {time.time():.6f} {ctx.round_id}\n")
            out.flush()
    ckpt.close()


def ray_loop(config: dict) -> None:
    """Ray Train's train_loop_per_worker: resumes from the reported checkpoint, reports one every step."""
    import ray.train
    import ray.train.torch

    context = ray.train.get_context()
    rank = context.get_world_rank()
    net, optimizer = build()
    model = ray.train.torch.prepare_model(net)
    data = torch.Generator().manual_seed(rank)
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            saved = torch.load(os.path.join(folder, "state.pt"), weights_only=False)
        net.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start = saved["step"] + 1
    round_id = shared_round()
    with open(os.path.join(config["out"], f"rank{rank}.txt"), "a") as out:
        for step in range(start, config["steps"]):
            time.sleep(config["sleep"])
            one_step(model, optimizer, data)
            with tempfile.TemporaryDirectory() as folder:
                reported = None
                if rank == 0:
                    torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                               os.path.join(folder, "state.pt"))
                    reported = ray.train.Checkpoint.from_directory(folder)
                ray.train.report({"step": step}, checkpoint=reported)
            out.write(f"{rank} {step} {os.getpid()} {time.time():.6f} {round_id}\n")
            out.flush()


def run_ray_train(args: argparse.Namespace) -> None:
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(address=args.ray, logging_level="ERROR")
    per_worker = {"CPU": 1, "convoy_node": 1, **({"GPU": 1} if args.gpu else {})}
    workers = (args.min_workers, args.max_workers) if args.min_workers != args.max_workers else args.max_workers
    trainer = TorchTrainer(
        ray_loop, train_loop_config={"out": args.out, "steps": args.steps, "sleep": args.sleep},
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=args.gpu,
                                     resources_per_worker=per_worker),
        run_config=RunConfig(storage_path=args.storage, name="ray_ddp",
                             failure_config=FailureConfig(max_failures=1),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)))
    trainer.fit()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=100000)
    parser.add_argument("--sleep", type=float, default=0.05)
    parser.add_argument("--ray", default="", metavar="ADDRESS", help="run under Ray Train on this cluster")
    parser.add_argument("--storage", default="", help="Ray Train's storage_path (local disk)")
    parser.add_argument("--min-workers", type=int, default=2)
    parser.add_argument("--max-workers", type=int, default=3)
    parser.add_argument("--gpu", action="store_true", help="each worker asks for a GPU (the infeasible request)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.ray:
        run_ray_train(args)
    else:
        run_convoy(args)


if __name__ == "__main__":
    main()
