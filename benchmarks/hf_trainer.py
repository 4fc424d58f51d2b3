"""Benchmark: a Hugging Face Trainer under convoy with ConvoyCallback against the Trainer's own checkpointing.

    python benchmarks/hf_trainer.py [--seed 0] [--kills 3] [--steps 160] [--overhead-steps 96] [--tmp DIR]

1. Steps redone. A tiny GPT-2 trains ``--steps`` optimizer steps on two ranks (``convoy run --nproc-per-node 2``,
   DDP on gloo); rank 1 SIGKILLs itself as a step drawn at random (``--seed``; ``--kills`` of them, each run
   both ways) begins, and convoy restarts the round. With ConvoyCallback the Trainer resumes from the newest
   in-memory snapshot; the peer is the same script without the callback, ``save_steps=50`` and
   ``trainer.train(resume_from_checkpoint=True)`` once a checkpoint exists (what a Trainer user does today).
   Each rank logs every optimizer step it ran; steps redone = steps run minus distinct steps. The callback's
   final weights are compared with an uninterrupted run.
2. Snapshot overhead. One process (``--nproc-per-node 1``) trains a GPT-2 of 23M parameters (batches of 2 x 64
   and of 8 x 128 tokens) with ConvoyCallback taking a snapshot after the steps of every other block of 4
   (snapshots on, off, on, ...), so both are measured in the same run; a step's time is the interval between
   two ``on_step_end`` calls, and the first step of each block is left out (it carries the previous block's
   background copy or lack of it).
3. Overhead budget. The small overhead job again with ``ConvoyCallback(max_overhead=0.02)``, against the same job
   with no callback at all, in turn (plain, budget, plain, budget): the mean step time of each side (the budget's
   cost falls on every k-th step, so the mean, not the median), over the whole run and after the budget's first
   11 steps (its warm-up and measuring); k and the steps a failure may cost, as the callback said them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SAVE_STEPS = 50
BLOCK = 4
BUDGET = 0.02
MEASURING = 11
"""The budget's warm-up and measuring calls (``convoy.runtime.snapshot_budget``: WARMUP + MEASURE)."""


def tiny_setup(samples: int, seed: int = 7):  # noqa: ANN201
    """The resume job's model and data: a 2-layer GPT-2 and generated token sequences."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    tokens = torch.randint(0, 64, (samples, 16), generator=torch.Generator().manual_seed(seed))
    return GPT2LMHeadModel(config), [{"input_ids": row, "labels": row} for row in tokens]


def large_setup(samples: int, sequence: int):  # noqa: ANN201
    """The overhead job's model (GPT-2, 6 layers of width 512, vocab 8192: about 23M parameters) and data."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=8192, n_positions=sequence, n_embd=512, n_layer=6, n_head=8)
    tokens = torch.randint(0, 8192, (samples, sequence), generator=torch.Generator().manual_seed(7))
    return GPT2LMHeadModel(config), [{"input_ids": row, "labels": row} for row in tokens]


def worker(args: argparse.Namespace) -> None:
    """One rank of a benchmark job (runs under ``convoy run``)."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_utils import get_last_checkpoint

    from convoy.integrations.transformers import ConvoyCallback

    out, rank = Path(args.out), int(os.environ.get("RANK", "0"))
    first_round = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    ends: list[float] = []

    class Probe(TrainerCallback):
        """Logs each step run, kills rank 1 where asked, and times steps."""

        def on_step_begin(self, targs, state, control, **kwargs):  # noqa: ANN001, ANN201
            if first_round and rank == 1 and state.global_step == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

        def on_step_end(self, targs, state, control, **kwargs):  # noqa: ANN001, ANN201
            ends.append(time.perf_counter())
            with open(out / f"steps.rank{rank}.txt", "a") as log:
                log.write(f"{state.global_step} {os.environ.get('CONVOY_ROUND', '0')}\n")

    class Blocks(ConvoyCallback):
        """Snapshots after the steps of every other block only (the rest: the same loop without them)."""

        def on_step_end(self, targs, state, control, **kwargs):  # noqa: ANN001, ANN201
            if (state.global_step - 1) // BLOCK % 2 == 0:
                super().on_step_end(targs, state, control, **kwargs)

    overhead = args.worker == "overhead"
    large = args.worker in ("overhead", "plain", "budget")
    batch = args.batch if large else 2
    model, data = large_setup(args.steps * batch, args.sequence) if large else tiny_setup(args.steps * 4)
    callbacks: list = {"overhead": [Blocks()], "callback": [ConvoyCallback()],
                       "budget": [ConvoyCallback(max_overhead=BUDGET)]}.get(args.worker, [])
    checkpoints = out / "trainer"
    training = TrainingArguments(
        output_dir=str(checkpoints), use_cpu=True, ddp_backend="gloo", per_device_train_batch_size=batch,
        num_train_epochs=1, learning_rate=3e-3, warmup_steps=5, seed=0, report_to="none", disable_tqdm=True,
        save_strategy="steps" if args.worker == "save_steps" else "no", save_steps=SAVE_STEPS, logging_steps=1000)
    trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=[*callbacks, Probe()])
    last = get_last_checkpoint(str(checkpoints)) if checkpoints.is_dir() else None
    trainer.train(resume_from_checkpoint=True if last else None)
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, out / "weights.pt")
    if overhead:
        write_overhead(out, ends, sum(p.numel() for p in model.parameters()))
    if args.worker in ("plain", "budget"):
        write_times(out, ends, callbacks[0] if callbacks else None)


def write_times(out: Path, ends: list[float], callback: object) -> None:
    """A budget job's step intervals, and what its callback's budget decided last (None without one)."""
    budget = getattr(callback, "budget", None)
    decision = budget.decision if budget is not None else None
    (out / "times.json").write_text(json.dumps({
        "intervals": [later - earlier for earlier, later in zip(ends, ends[1:], strict=False)],
        "decision": decision.describe() if decision else None}))


def budget_runs(script: str, root: Path, steps: int, extra: list[str], what: str, rounds: int = 2) -> None:
    """Jobs with ``ConvoyCallback(max_overhead=BUDGET)`` and with no callback, in turn: the budget's measured
    overhead (mean step times) over the whole run and after its measuring steps; prints the target."""
    got: dict[str, list[list[float]]] = {"plain": [], "budget": []}
    said = []
    for index in range(rounds):
        for mode in got:
            out = root / f"{mode}-{index}"
            launch(mode, out, steps, -1, 1, *extra, script=script)
            timed = json.loads((out / "times.json").read_text())
            got[mode].append(timed["intervals"])
            said += [timed["decision"]] if timed["decision"] else []
    print(f"# overhead budget: {what}, {steps} steps a job; ConvoyCallback(max_overhead={BUDGET}) against no "
          f"callback, {rounds} jobs each in turn; mean step time")
    shares = {}
    for span, first in (("whole run", 1), (f"after the budget's first {MEASURING} steps", MEASURING)):
        means = {mode: statistics.mean(x for run in runs for x in run[first:]) for mode, runs in got.items()}
        shares[span] = means["budget"] / means["plain"] - 1
        print(f"{span}: budget {means['budget'] * 1000:.1f} ms, no callback {means['plain'] * 1000:.1f} ms "
              f"({shares[span] * 100:+.2f}%)")
    for line in said:
        print(f"the callback said: {line}")
    steady = shares[f"after the budget's first {MEASURING} steps"]
    print(f"target budget_overhead ({what}): {steady * 100:+.2f}% <= {BUDGET * 100:.0f}% "
          f"{'met' if steady <= BUDGET else 'missed'} (whole run, its measuring included: "
          f"{shares['whole run'] * 100:+.2f}%)")


def write_overhead(out: Path, ends: list[float], parameters: int) -> None:
    """The step times of an overhead job, split into blocks of ``BLOCK`` steps with snapshots (on) and without
    (off), each block's first step left out (it pays the switch)."""
    steps = [(index + 2, ends[index + 1] - ends[index]) for index in range(len(ends) - 1)]
    kept = [(step, seconds) for step, seconds in steps if (step - 1) % BLOCK != 0]
    timed = {"on": [s for step, s in kept if (step - 1) // BLOCK % 2 == 0],
             "off": [s for step, s in kept if (step - 1) // BLOCK % 2 == 1], "parameters": parameters}
    (out / "overhead.json").write_text(json.dumps(timed))


def launch(mode: str, out: Path, steps: int, kill_at: int, nproc: int, *extra: str, script: str = __file__) -> float:
    """One convoy job of ``script`` (its ``--worker`` side) in ``mode``; returns its wall time. Fails loudly on a
    non-zero exit."""
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "convoy", "run", "--nnodes", "1", "--nproc-per-node", str(nproc),
               "--run-dir", str(out / "run"), "--stop-grace", "2", script, "--worker", mode, "--out", str(out),
               "--steps", str(steps), "--kill-at", str(kill_at), *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1" if nproc > 1 else "2"}
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        sys.exit(f"{mode} job failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return time.perf_counter() - started


def redone(out: Path, rank: int) -> tuple[int, int, int]:
    """(steps run, steps run more than once, rounds) of one rank, from its step log."""
    lines = [line.split() for line in (out / f"steps.rank{rank}.txt").read_text().splitlines() if line]
    counts = Counter(int(step) for step, _ in lines)
    return sum(counts.values()), sum(count - 1 for count in counts.values()), len({round_id for _, round_id in lines})


def identical(a: Path, b: Path) -> bool:
    import torch

    first, second = torch.load(a / "weights.pt"), torch.load(b / "weights.pt")
    return sorted(first) == sorted(second) and all(torch.equal(first[k], second[k]) for k in first)


def kill_runs(script: str, root: Path, steps: int, kills: list[int], peer: str) -> None:
    """An uninterrupted job, then at each kill point a job with the callback and one with the ``peer``'s own
    checkpointing: the steps each redid and whether its final weights are bit-identical; prints both targets."""
    launch("clean", root / "clean", steps, -1, 2, script=script)
    totals = {"callback": 0, peer: 0}
    all_same = True
    for kill_at in kills:
        for mode in totals:
            out = root / f"{mode}-{kill_at}"
            seconds = launch(mode, out, steps, kill_at, 2, script=script)
            run, twice, rounds = redone(out, 1)
            totals[mode] += twice
            same = identical(root / "clean", out)
            all_same &= same or mode != "callback"
            print(f"K={kill_at:>3} {mode:>10}: rank 1 ran {run} optimizer steps for {steps} in {rounds} rounds, "
                  f"{twice} redone (since the last save: {kill_at % SAVE_STEPS}); final weights "
                  f"{'bit-identical to' if same else 'differ from'} the uninterrupted run's; job {seconds:.1f} s")
    print(f"target steps_redone: callback {totals['callback']} == 0 over {len(kills)} kills (peer: "
          f"{totals[peer]}) {'met' if totals['callback'] == 0 else 'missed'}")
    print(f"target bit_identical: callback runs {'all' if all_same else 'not all'} bit-identical "
          f"{'met' if all_same else 'missed'}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=160, help="optimizer steps of the resume jobs")
    parser.add_argument("--overhead-steps", type=int, default=96,
                        help="steps of the small overhead job (the large one: half)")
    parser.add_argument("--kills", type=int, default=3, help="kill points drawn, each run with both")
    parser.add_argument("--tmp", default="")
    parser.add_argument("--batch", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--sequence", type=int, default=64, help=argparse.SUPPRESS)
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--kill-at", type=int, default=-1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    root = Path(args.tmp or tempfile.mkdtemp(prefix="convoy-hf-bench-"))
    kills = random.Random(args.seed).sample(range(SAVE_STEPS + 1, args.steps - 10), args.kills)
    print(f"# 2 ranks (convoy run --nproc-per-node 2, DDP on gloo), {args.steps} steps; rank 1 SIGKILLed as step K+1 "
          f"begins, K drawn at random (seed {args.seed}): {kills}; peer: save_steps={SAVE_STEPS}, "
          "resume_from_checkpoint=True")
    kill_runs(__file__, root, args.steps, kills, "save_steps")

    for batch, sequence, steps in ((2, 64, args.overhead_steps), (8, 128, args.overhead_steps // 2)):
        out = root / f"overhead-{batch}x{sequence}"
        launch("overhead", out, steps, -1, 1, "--batch", str(batch), "--sequence", str(sequence))
        timed = json.loads((out / "overhead.json").read_text())
        on, off = statistics.median(timed["on"]), statistics.median(timed["off"])
        share = (on - off) / off
        print(f"# overhead: GPT-2 of {timed['parameters'] / 1e6:.1f}M parameters, 1 process, batch {batch} x "
              f"{sequence} tokens, {steps} steps in blocks of {BLOCK} with and without snapshots "
              f"({len(timed['on'])} and {len(timed['off'])} timed)")
        print(f"step time: with snapshots median {on * 1000:.1f} ms, without {off * 1000:.1f} ms")
        print(f"target snapshot_overhead ({batch * sequence} tokens a step): {share * 100:+.1f}% < 5% "
              f"{'met' if share < 0.05 else 'missed'}")
    budget_runs(__file__, root, args.overhead_steps, ["--batch", "2", "--sequence", "64"],
                "GPT-2 of 23M parameters, batch 2 x 64 tokens")

if __name__ == "__main__":
    main()
