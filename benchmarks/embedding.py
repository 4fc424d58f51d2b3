"""Row-sharded embeddings against DDP with a replicated ``nn.EmbeddingBag``, 4 ranks.

    python benchmarks/embedding.py [--quick] [--rows 1000000,10000000] [--steps 12]

A click model of one large table (rows x 64, bags of 20 skewed ids per sample, 512 samples per
rank) and a small dense MLP (benchmarks/scripts/embedding_worker.py). convoy: the table sharded
by rows over the ranks, sparse SGD, the MLP under DDP. Peer: the table and the MLP together
under DDP (the table's dense gradient allreduced every step), SGD. Both start from the same
rows; per-rank table memory (rows, and rows plus gradient), peak RSS, and the median step time
(first 2 steps left out). The loss of every step is compared with one process training the
same model on all ranks' batches put together.

A replicated 10M x 64 table needs its rows, its gradient and a gradient being accumulated,
about 7.7 GB per rank: 4 ranks do not fit this 24 GB machine. Where the peer does not fit with
4 ranks it runs with 2 (``--peer-world``): each rank then sends less per allreduce (ring:
``2 (k-1)/k`` of the table), so its step time is a lower bound for 4 ranks and the speedup an
under-estimate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks" / "scripts"))
from convoy.ports import free_port  # noqa: E402
from ranks import rank_env, run_ranks  # noqa: E402

WORKER = REPO / "benchmarks" / "scripts" / "embedding_worker.py"
WORLD, DIM = 4, 64
MEMORY_GOAL, SPEED_GOAL, SPEED_AT, LOSS_TOL = 0.25, 2.0, 10_000_000, 1e-5
GB = 1e9


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def run(mode: str, rows: int, world: int, args: argparse.Namespace, out: Path) -> dict:
    argv = [sys.executable, str(WORKER), "--mode", mode, "--rows", str(rows), "--dim", str(DIM),
            "--steps", str(args.steps), "--world", str(WORLD), "--out", str(out)]
    port = str(free_port())
    commands = [(argv, rank_env(rank, world, port)) for rank in range(world)]
    run_ranks(commands, f"embedding {mode} {rows} rows", timeout=3600)
    result = json.loads(out.read_text())
    result["step_s"] = statistics.median(result["times"][2:] or result["times"])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100k rows only, 6 steps")
    parser.add_argument("--rows", default=None, help="comma-separated table sizes (default 1000000,10000000)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 12)")
    args = parser.parse_args()
    sizes = [int(r) for r in (args.rows or ("100000" if args.quick else "1000000,10000000")).split(",")]
    args.steps = args.steps or (6 if args.quick else 12)
    if args.steps < 3 or any(r < WORLD for r in sizes):
        parser.error(f"need --steps >= 3 and at least {WORLD} rows")
    rows_out = []
    with tempfile.TemporaryDirectory(prefix="convoy-bench-embedding-") as tmp:
        for rows in sizes:
            table = rows * DIM * 4
            sharded = run("sharded", rows, WORLD, args, Path(tmp) / f"sharded-{rows}.json")
            need = 3 * table * WORLD * 1.1
            peer_world = WORLD if need < available_bytes() else 2
            replicated = run("replicated", rows, peer_world, args, Path(tmp) / f"replicated-{rows}.json")
            single = run("single", rows, 1, args, Path(tmp) / f"single-{rows}.json") \
                if 3 * table * 1.2 < available_bytes() else None
            rows_out.append((rows, sharded, replicated, single, need))
            print(f"  ran {rows} rows (peer on {peer_world} ranks)", flush=True)

    print(f"\n{WORLD} ranks, one table of rows x {DIM} (fp32), bags of 20 ids, 512 samples per rank, SGD")
    print(f"{'rows':>11}{'table MB/rank':>15}{'+grad MB':>10}{'peer MB/rank':>14}{'+grad MB':>10}{'rows ratio':>12}"
          f"{'peak RSS GB':>13}{'peer RSS GB':>13}{'step ms':>9}{'peer step ms':>14}{'peer ranks':>12}"
          f"{'speedup':>9}{'max |loss - single|':>21}")
    memory_ratios, speedups, loss_gaps = [], {}, []
    for rows, sharded, replicated, single, _ in rows_out:
        ratio = sharded["rows_bytes"] / replicated["rows_bytes"]
        memory_ratios.append(ratio)
        speedup = replicated["step_s"] / sharded["step_s"]
        speedups[rows] = (speedup, replicated["world"])
        gap = max(abs(a - b) for a, b in zip(sharded["losses"], single["losses"], strict=True)) if single else None
        if gap is not None:
            loss_gaps.append(gap)
        mine, peer = sharded["rows_bytes"], replicated["rows_bytes"]
        print(f"{rows:>11}{mine / 1e6:>15.1f}{(mine + sharded['grad_bytes']) / 1e6:>10.1f}"
              f"{peer / 1e6:>14.1f}{(peer + replicated['grad_bytes']) / 1e6:>10.1f}"
              f"{ratio:>12.3f}{sharded['peak_rss'] / GB:>13.2f}{replicated['peak_rss'] / GB:>13.2f}"
              f"{sharded['step_s'] * 1e3:>9.1f}{replicated['step_s'] * 1e3:>14.1f}{replicated['world']:>12}"
              f"{speedup:>8.1f}x{'not run' if gap is None else f'{gap:.1e}':>21}")
    for rows, _, replicated, _, need in rows_out:
        if replicated["world"] != WORLD:
            print(f"  {rows} rows: the replicated peer needs about {need / GB:.1f} GB for {WORLD} ranks, "
                  f"{available_bytes() / GB:.1f} GB available: it ran on {replicated['world']} ranks (a lower bound "
                  "on its step time)")
    print(f"  loss per step (sharded, 4 ranks): {[round(x, 5) for x in rows_out[0][1]['losses']]}")

    print()
    worst = max(memory_ratios)
    print(f"target table_memory: per-rank rows / replicated rows, worst {worst:.3f} (goal ~{MEMORY_GOAL}) "
          f"{'met' if worst <= MEMORY_GOAL * 1.02 else 'missed'}")
    if SPEED_AT in speedups:
        speedup, peer_world = speedups[SPEED_AT]
        note = "" if peer_world == WORLD else f", peer on {peer_world} ranks (a lower bound)"
        print(f"target step_time_10M: replicated / sharded {speedup:.1f}x{note} (goal >= {SPEED_GOAL}x) "
              f"{'met' if speedup >= SPEED_GOAL else 'missed'}")
    else:
        print(f"target step_time_10M: not measured (no 10M-row run) (goal >= {SPEED_GOAL}x) missed")
    if loss_gaps:
        gap = max(loss_gaps)
        print(f"target loss_equal: max |sharded - single-process| per-step loss {gap:.1e} (goal <= {LOSS_TOL:g}) "
              f"{'met' if gap <= LOSS_TOL else 'missed'}")
    else:
        print(f"target loss_equal: not measured (goal <= {LOSS_TOL:g}) missed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
