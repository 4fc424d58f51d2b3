"""RL fine-tuning of language models (issue 52): the targets measured so far, each against its peer in the same run.

    python benchmarks/rlhf.py [--only sync,learning,async,faults,trl] [--repeats N] [--minutes M] [--steps S]

1. sync: SmolLM2-135M-Instruct's weights (540 MB fp32) from the trainer to 2 rollout processes on this host, through
   convoy's weight board (each version packed into a /dev/shm slot, each rollout copying it into its own model), and
   the same model cut into 1,200 tensors (MoE-shaped). Peer: one raw ``dist.broadcast`` (gloo) of all the bytes as a
   single flat tensor, in the same processes, alternating with the board. Targets: board / broadcast <= 1.3x;
   1,200 tensors / dense <= 1.25x; every rollout bit for bit the trainer's (digests). ``scripts/rlhf_sync.py``.
   Also timed, in turn with both: the transport (trainer 0's weight service on the role transport, the path of
   rollouts on another host), here over loopback TCP.
2. learning: ``convoy run examples/grpo.toml`` for ``--minutes`` of training (``rlhf_learning.py``); target: the
   held-out reward rises >= 30 points over the base model's within 30 minutes of wall-clock time.
3. async: k = 1 against k = 0 for ``--steps`` steps each with long responses (``rlhf_async.py``); targets: >= 1.8x
   the samples/s, the reward within 5 points, nothing trained beyond k.
4. faults: a rollout SIGSTOPped mid-run (``rlhf_faults.py``; ``--minutes`` of training); targets: detected and its
   prompts reassigned <= 10 s, the trainer never blocked > 10 s.
5. trl: the job (k = 1) against TRL's ``GRPOTrainer`` for ``--steps`` steps each (``rlhf_trl.py``; TRL from
   ``pip install trl torch==2.13.0``); targets: >= 1.5x the samples/s, the held-out reward not lower.
Exits 0 whether the targets are met or missed.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from rlhf_async import bench_async  # noqa: E402
from rlhf_faults import bench_faults  # noqa: E402
from rlhf_learning import bench_learning  # noqa: E402
from rlhf_trl import bench_trl  # noqa: E402
ROLLOUTS = 2


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_sync(shape: str, repeats: int) -> dict[str, object]:
    script = REPO / "benchmarks" / "scripts" / "rlhf_sync.py"
    port, world = free_port(), ROLLOUTS + 1
    board = f"/dev/shm/convoy-bench{uuid.uuid4().hex[:8]}-weights"
    secret = os.urandom(32).hex()
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), str(world), str(port), shape, str(repeats),
                               board, secret], stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
             for rank in range(world)]
    try:
        out, _ = procs[0].communicate(timeout=900)
        for proc in procs[1:]:
            proc.wait(120)
    finally:
        Path(board).unlink(missing_ok=True)  # rank 0 removes it, unless the ranks failed before
    if procs[0].returncode:
        raise RuntimeError(f"the sync ranks failed (exit {procs[0].returncode}):\n{out}")
    return {"broadcast": [float(x) for x in re.findall(r"broadcast ([\d.]+)", out)],
            "board": [float(x) for x in re.findall(r"board ([\d.]+)", out)],
            "transport": [float(x) for x in re.findall(r"transport ([\d.]+)", out)],
            "exact": "bit for bit True" in out, "described": re.search(r"tensors (\d+) bytes (\d+)", out).groups()}


def bench_sync(repeats: int) -> list[str]:
    print(f"\n## sync: weights from the trainer to {ROLLOUTS} rollouts on this host ({repeats} repeats each, median)")
    results = {}
    for shape in ("dense", "moe"):
        got = run_sync(shape, repeats)
        results[shape] = got
        tensors, size = got["described"]
        board, cast = statistics.median(got["board"]), statistics.median(got["broadcast"])
        wire = statistics.median(got["transport"])
        print(f"  {shape:<6} {tensors} tensors, {int(size) / 2**20:.0f} MiB: board {board:.3f} s, "
              f"dist.broadcast {cast:.3f} s ({board / cast:.2f}x); transport {wire:.3f} s ({wire / cast:.2f}x); "
              f"bit for bit: {got['exact']}")
        print(f"         board runs {', '.join(f'{x:.3f}' for x in got['board'])}; broadcast runs "
              f"{', '.join(f'{x:.3f}' for x in got['broadcast'])}; transport runs "
              f"{', '.join(f'{x:.3f}' for x in got['transport'])}")
    dense = results["dense"]
    ratio = statistics.median(dense["board"]) / statistics.median(dense["broadcast"])
    shaped = statistics.median(results["moe"]["board"]) / statistics.median(dense["board"])
    exact = all(r["exact"] for r in results.values())
    wire = statistics.median(dense["transport"]) / statistics.median(dense["broadcast"])
    return [f"target weight sync to {ROLLOUTS} rollouts, board / one dist.broadcast: {ratio:.2f}x (goal <= 1.3x) "
            f"{'met' if ratio <= 1.3 else 'missed'}",
            f"target weight sync to {ROLLOUTS} rollouts over the transport (another host's path) / one "
            f"dist.broadcast: {wire:.2f}x (goal <= 1.3x) {'met' if wire <= 1.3 else 'missed'}",
            f"target 1,200 tensors / dense, same bytes: {shaped:.2f}x (goal <= 1.25x) "
            f"{'met' if shaped <= 1.25 else 'missed'}",
            f"target rollouts bit for bit the trainer's after each sync: {exact} {'met' if exact else 'missed'}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="sync")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--minutes", type=float, default=25.0, help="minutes of training in the learning section")
    parser.add_argument("--set", action="append", default=[], help="a [train] setting for the learning and TRL runs")
    parser.add_argument("--steps", type=int, default=12, help="trainer steps of each run in the async section")
    args = parser.parse_args()
    parts = {"sync": lambda: bench_sync(args.repeats), "learning": lambda: bench_learning(args.minutes, args.set),
             "async": lambda: bench_async(args.steps), "faults": lambda: bench_faults(args.minutes),
             "trl": lambda: bench_trl(args.steps, args.set)}
    lines = []
    for name in args.only.split(","):
        lines += parts[name]()
    print()
    for line in lines:
        print(line)


if __name__ == "__main__":
    main()
