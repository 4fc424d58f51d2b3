"""The peers of ``benchmarks/roles.py``, each as its own users run it.

``torchrun`` (``python roles_peers.py torchrun ...`` under ``torchrun --nproc-per-node 2 --max-restarts K``): the
training of ``roles_trainer.py`` as a plain DDP script that saves every rank's state after every step with
``torch.save`` (written aside, then renamed: a crash never leaves half a file), so that a restart loses no step
either; torchrun restarts the whole worker group on a failure.

``ray`` (``python roles_peers.py ray --out FILE --count N``): N actors created one at a time on a local Ray
cluster (``ray.init()``, as its users start one), each with 0.1 CPU (20 on a 2-CPU machine fit); an actor's
``__init__`` takes the wall time as it begins, then imports torch, as the convoy probe does; one latency per line.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def torchrun_trainer(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from roles_trainer import build, train

    dist.init_process_group("gloo")
    rank, restarts = dist.get_rank(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    run_dir = Path(args.run_dir)
    net, model, optimizer, data = build(rank)
    saved = run_dir / f"ckpt-rank{rank}.pt"
    start = 0
    if saved.exists():
        state = torch.load(saved, weights_only=False)
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        data.set_state(state["data"])
        start = state["step"] + 1
    starts = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size())]
    dist.all_gather(starts, torch.tensor([start]))
    start = min(int(s) for s in starts)  # a rank killed before its save of the last step: both redo it

    def save(step: int) -> None:
        aside = saved.with_suffix(".partial")
        torch.save({"model": net.state_dict(), "optim": optimizer.state_dict(), "data": data.get_state(),
                    "step": step}, aside)
        os.replace(aside, saved)

    train(run_dir, rank, restarts + 1, start, args, model, optimizer, data, save)
    dist.destroy_process_group()


def ray_actors(args: argparse.Namespace) -> None:
    import ray

    ray.init(include_dashboard=False, log_to_driver=False)

    @ray.remote(num_cpus=0.1)
    class Probe:
        def __init__(self) -> None:
            self.began = time.time()
            import torch  # noqa: F401 (what an actor of an RL job imports)

        def began_at(self) -> float:
            return self.began

    actors, out = [], Path(args.out)
    for _ in range(args.count):
        began = time.time()
        actor = Probe.remote()
        at = ray.get(actor.began_at.remote())
        actors.append(actor)
        with out.open("a") as log:
            log.write(f"{at - began:.4f}\n")
    ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("peer", choices=["torchrun", "ray"])
    parser.add_argument("--run-dir", default=".")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--step-time", type=float, default=0.01)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--kill-every", type=int, default=30)
    parser.add_argument("--out", default="ray-actors.txt")
    parser.add_argument("--count", type=int, default=20)
    args = parser.parse_args()
    if args.peer == "torchrun":
        torchrun_trainer(args)
    else:
        ray_actors(args)
    sys.exit(0)


if __name__ == "__main__":
    main()
