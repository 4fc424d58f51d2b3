"""Benchmark: a Lightning Trainer under convoy with ConvoyCallback against Lightning's own checkpointing.

    python benchmarks/lightning_trainer.py [--seed 0] [--kills 3] [--steps 160] [--overhead-steps 48] [--tmp DIR]

1. Steps redone. A small MLP trains ``--steps`` optimizer steps on two ranks (``convoy run --nproc-per-node 2``,
   ``strategy="ddp"`` on gloo, ``devices`` = the local world size); rank 1 SIGKILLs itself as a step drawn at
   random (``--seed``; ``--kills`` of them, each run both ways) begins, and convoy restarts the round. With
   ConvoyCallback the fit resumes from the newest in-memory snapshot; the peer is the same script without the
   callback, ``ModelCheckpoint(every_n_train_steps=50, save_last=True)`` and ``trainer.fit(..., ckpt_path="last")``
   (what a Lightning user does today). Each rank logs every optimizer step it ran; steps redone = steps run minus
   distinct steps. Both ways' final weights are compared with an uninterrupted run.
2. Snapshot overhead. One process (``--nproc-per-node 1``) trains an MLP of 21M parameters (AdamW; batches of
   256 and 1024 rows) with
   ConvoyCallback taking a snapshot after the steps of every other block of 4 (snapshots on, off, on, ...), so
   both are measured in the same run; a step's time is the interval between two ``on_train_batch_end`` calls,
   and the first step of each block is left out (it carries the previous block's background copy or lack of it).
3. Overhead budget. The batch-256 overhead job again with ``ConvoyCallback(max_overhead=0.02)``, against the same
   job with no callback at all, in turn (``hf_trainer.budget_runs``): the mean step time of each side, over the
   whole run and after the budget's measuring steps; k and the steps a failure may cost, as the callback said them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_trainer import (BLOCK, BUDGET, SAVE_STEPS, budget_runs, kill_runs, launch, write_overhead,  # noqa: E402
                        write_times)  # (the same jobs and reports)

REPO = Path(__file__).resolve().parents[1]


def module(width: int, depth: int):  # noqa: ANN201
    """An MLP LightningModule: ``depth`` hidden layers of ``width`` on 64 features, dropout, AdamW."""
    import lightning.pytorch as pl
    import torch

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            layers: list[torch.nn.Module] = [torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Dropout(0.1)]
            for _ in range(depth - 1):
                layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
            self.net = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            features, target = batch
            return torch.nn.functional.mse_loss(self.net(features), target)

        def configure_optimizers(self):  # noqa: ANN201
            optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
            schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + 0.01 * step))
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    return Net()


def worker(args: argparse.Namespace) -> None:
    """One rank of a benchmark job (runs under ``convoy run``)."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from convoy.integrations.lightning import ConvoyCallback

    out, rank = Path(args.out), int(os.environ.get("RANK", "0"))
    first_round = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    ends: list[float] = []

    class Probe(pl.Callback):
        """Logs each step run, kills rank 1 where asked, and times steps."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001, ANN201
            if first_round and rank == 1 and trainer.global_step == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001, ANN201
            ends.append(time.perf_counter())
            with open(out / f"steps.rank{rank}.txt", "a") as log:
                log.write(f"{trainer.global_step} {os.environ.get('CONVOY_ROUND', '0')}\n")

    class Blocks(ConvoyCallback):
        """Snapshots after the steps of every other block only (the rest: the same loop without them)."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001, ANN201
            if (trainer.global_step - 1) // BLOCK % 2 == 0:
                super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    overhead = args.worker == "overhead"
    large = args.worker in ("overhead", "plain", "budget")
    pl.seed_everything(0, verbose=False)
    model = module(2048, 6) if large else module(32, 2)
    batch = args.batch if large else 2
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    nodes = int(os.environ.get("WORLD_SIZE", "1")) // devices
    samples = args.steps * batch * devices * nodes
    features = torch.randn(samples, 64, generator=torch.Generator().manual_seed(7))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(features, features.sum(1, keepdim=True).sin()),
                                       batch_size=batch, shuffle=True)
    checkpoints = out / "lightning"
    callbacks: list = {"overhead": [Blocks()], "callback": [ConvoyCallback()],
                       "budget": [ConvoyCallback(max_overhead=BUDGET)]}.get(args.worker, [])
    if args.worker == "checkpoint":
        callbacks.append(ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=SAVE_STEPS, save_last=True))
    trainer = pl.Trainer(
        accelerator="cpu", strategy="ddp" if devices * nodes > 1 else "auto", devices=devices, num_nodes=nodes,
        max_epochs=1, logger=False, enable_checkpointing=args.worker == "checkpoint", enable_progress_bar=False,
        enable_model_summary=False, callbacks=[*callbacks, Probe()])
    trainer.fit(model, data, ckpt_path="last" if args.worker == "checkpoint" else None)
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / "weights.pt")
    if overhead:
        write_overhead(out, ends, sum(p.numel() for p in model.parameters()))
    if args.worker in ("plain", "budget"):
        write_times(out, ends, callbacks[0] if callbacks else None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=160, help="optimizer steps of the resume jobs")
    parser.add_argument("--overhead-steps", type=int, default=48)
    parser.add_argument("--kills", type=int, default=3, help="kill points drawn, each run with both")
    parser.add_argument("--tmp", default="")
    parser.add_argument("--batch", type=int, default=256, help="rows a step in the first overhead job (the second: 4x)")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--kill-at", type=int, default=-1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    root = Path(args.tmp or tempfile.mkdtemp(prefix="convoy-lightning-bench-"))
    kills = random.Random(args.seed).sample(range(SAVE_STEPS + 1, args.steps - 10), args.kills)
    print(f"# 2 ranks (convoy run --nproc-per-node 2, strategy='ddp' on gloo), {args.steps} steps; rank 1 SIGKILLed "
          f"as step K+1 begins, K drawn at random (seed {args.seed}): {kills}; peer: ModelCheckpoint("
          f"every_n_train_steps={SAVE_STEPS}, save_last=True), fit(ckpt_path='last')")
    kill_runs(__file__, root, args.steps, kills, "checkpoint")

    for batch, steps in ((args.batch, args.overhead_steps), (args.batch * 4, args.overhead_steps // 2)):
        out = root / f"overhead-{batch}"
        launch("overhead", out, steps, -1, 1, "--batch", str(batch), script=__file__)
        timed = json.loads((out / "overhead.json").read_text())
        on, off = statistics.median(timed["on"]), statistics.median(timed["off"])
        share = (on - off) / off
        print(f"# overhead: MLP of {timed['parameters'] / 1e6:.1f}M parameters (AdamW), 1 process, batch {batch}, "
              f"{steps} steps in blocks of {BLOCK} with and without snapshots ({len(timed['on'])} and "
              f"{len(timed['off'])} timed)")
        print(f"step time: with snapshots median {on * 1000:.1f} ms, without {off * 1000:.1f} ms")
        verdict = "met" if share < 0.05 else "missed"
        print(f"target snapshot_overhead (batch {batch}): {share * 100:+.1f}% < 5% {verdict}")
    budget_runs(__file__, root, args.overhead_steps * 2, ["--batch", str(args.batch)],
                f"MLP of 21M parameters (AdamW), batch {args.batch}")


if __name__ == "__main__":
    main()
