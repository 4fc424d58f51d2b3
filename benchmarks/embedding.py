"""Row-sharded embeddings against DDP with a replicated ``nn.EmbeddingBag``, 4 ranks.

    python benchmarks/embedding.py [--quick] [--rows 1000000,10000000] [--steps 12]

A click model of one large table (rows x 64, bags of 20 skewed ids per sample, 512 samples per
rank) and a small dense MLP (benchmarks/scripts/embedding_worker.py). convoy: the table sharded
by rows over the ranks, sparse SGD, the MLP under DDP. Two peers, both the table and the MLP
together under DDP (gloo) with every rank holding all the rows:

* dense gradients (the peer the README quoted first): ``nn.EmbeddingBag`` as it comes, so the
  table's gradient is a dense rows x 64 tensor allreduced every step, then ``torch.optim.SGD``;
* sparse gradients, the peer as its users would run it: ``nn.EmbeddingBag(sparse=True)``, whose
  gradient holds only the looked-up rows; DDP allreduces it as a sparse tensor and
  ``torch.optim.SGD`` (which takes sparse gradients) updates only those rows. Plain SGD at
  convoy's learning rate, because convoy's side is plain SGD too (``SparseSGD`` for the table,
  ``torch.optim.SGD`` for the MLP): both sides take the same steps and the same losses, so the
  step time is the only difference. (``SparseAdam`` for the table would be an optimizer convoy's
  run does not use.)

All runs start from the same rows. Per run: per-rank table memory as sizes (rows, and rows plus
the table's gradient: dense, or the largest sparse one seen), and as measured: peak RSS, and how
much the anonymous resident memory (``RssAnon``, no shared-library pages) grew from just before
the model was built to its largest after a step, gradients still held (the busiest rank): what
the memory target compares; and the median step time
(first 2 steps left out); the loss of every step is compared with one process training the same
model on all ranks' batches put together. The step-time target and the headline ratio are
against the better (faster) peer at each size; the dense peer's ratio is printed beside it.
TorchRec, the other peer, is run only if ``import torchrec`` works; otherwise one line says why
not (this benchmark installs nothing). Tried by hand on 2026-12-04: the newest on the package
index, torchrec 1.9.2 with fbgemm-gpu-cpu 1.9.0, fails to load against torch 2.13
(``fbgemm_gpu_tbe_index_select.so: undefined symbol``), so no TorchRec run exists here.

A replicated 10M x 64 table needs its rows, its gradient and a gradient being accumulated,
about 7.7 GB per rank with dense gradients: 4 ranks do not fit this 24 GB machine. Where a peer
does not fit with 4 ranks it runs with 2 (the ``ranks`` column): each rank then sends less per
allreduce (ring: ``2 (k-1)/k`` of the table), so its step time is a lower bound for 4 ranks and
the speedup an under-estimate. The sparse peer needs about the rows alone per rank (2.6 GB at 10M).
"""

from __future__ import annotations

import argparse
import json
import os
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
MEMORY_SLACK = 1.1  # "~1/4": the shard's gradient rows and the exchange's buffers come on top of 1/4 of the rows
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
    result["load"] = os.getloadavg()[0]  # the machine is shared: how busy it was over the last minute
    return result


PEERS = {"replicated": "DDP, dense grads", "replicated-sparse": "DDP, sparse grads"}


def torchrec_line() -> str:
    """Whether TorchRec can be the third peer here, and if not why not."""
    try:
        import torchrec  # noqa: F401
    except Exception as error:  # ImportError, or a build that fails on import
        return (f"TorchRec: not run: `import torchrec` fails here ({type(error).__name__}: {error}); it is not "
                "installed in this environment and this benchmark installs nothing, so the peers are DDP only")
    return ("TorchRec: importable, but no TorchRec run is written into this benchmark yet; "
            "the peers are DDP only")


def peer_world(mode: str, table: int) -> tuple[int, float]:
    """4 ranks where the peer's replicated tables fit in the memory available now, else 2."""
    copies = 3 if mode == "replicated" else 1.2  # dense: rows, gradient, gradient being reduced
    need = copies * table * WORLD * 1.1
    return (WORLD if need < available_bytes() else 2), need


def loss_gap(run: dict, single: dict | None) -> float | None:
    """Largest per-step loss difference from one process on all 4 ranks' batches; none for a run
    on fewer ranks (it trains on fewer batches, so its losses are not the same sums)."""
    if single is None or run["world"] != WORLD:
        return None
    return max(abs(a - b) for a, b in zip(run["losses"], single["losses"], strict=True))


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
    print(torchrec_line(), flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="convoy-bench-embedding-") as tmp:
        for rows in sizes:
            table = rows * DIM * 4
            sharded = run("sharded", rows, WORLD, args, Path(tmp) / f"sharded-{rows}.json")
            peers, needs = {}, {}
            for mode in PEERS:
                world, needs[mode] = peer_world(mode, table)
                peers[mode] = run(mode, rows, world, args, Path(tmp) / f"{mode}-{rows}.json")
            single = run("single", rows, 1, args, Path(tmp) / f"single-{rows}.json") \
                if 3 * table * 1.2 < available_bytes() else None
            results.append((rows, sharded, peers, single, needs))
            print(f"  ran {rows} rows (" + "; ".join(f"{PEERS[m]} on {peers[m]['world']} ranks" for m in PEERS)
                  + ")", flush=True)

    print(f"\n{WORLD} ranks, one table of rows x {DIM} (fp32), bags of 20 ids, 512 samples per rank, plain SGD "
          f"(lr 0.05) everywhere; step = median of steps 3-{args.steps}")
    print(f"{'rows':>11}  {'run':<20}{'ranks':>6}{'table MB/rank':>15}{'+grad MB':>10}{'rows ratio':>12}"
          f"{'peak RSS GB':>13}{'anon grew GB':>13}{'grew ratio':>12}{'step ms':>10}{'x convoy':>10}"
          f"{'max |loss - single|':>21}{'load':>6}")
    memory_ratios, speedups, loss_gaps = [], {}, []
    for rows, sharded, peers, single, _ in results:
        best = min(PEERS, key=lambda m: peers[m]["step_s"])
        speedups[rows] = {m: (peers[m]["step_s"] / sharded["step_s"], peers[m]["world"]) for m in PEERS}
        speedups[rows]["best"] = best
        gap = loss_gap(sharded, single)
        if gap is not None:
            loss_gaps.append(gap)
        memory_ratios.append((max(sharded["anon_grown"] / peers[m]["anon_grown"] for m in PEERS), rows))
        for name, result in [("convoy, row-sharded", sharded)] + [(PEERS[m], peers[m]) for m in PEERS]:
            ratio = result["rows_bytes"] / peers["replicated"]["rows_bytes"]
            gap = loss_gap(result, single)
            gap_text = f"{gap:.1e}" if gap is not None else "not run" if single is None else "n/a"
            print(f"{rows:>11}  {name:<20}{result['world']:>6}{result['rows_bytes'] / 1e6:>15.1f}"
                  f"{(result['rows_bytes'] + result['grad_bytes']) / 1e6:>10.1f}{ratio:>12.3f}"
                  f"{result['peak_rss'] / GB:>13.2f}{result['anon_grown'] / GB:>13.2f}"
                  f"{result['anon_grown'] / peers['replicated-sparse']['anon_grown']:>12.3f}"
                  f"{result['step_s'] * 1e3:>10.1f}"
                  f"{result['step_s'] / sharded['step_s']:>9.1f}x{gap_text:>21}{result['load']:>6.1f}")
    for rows, _, peers, _, needs in results:
        for mode in PEERS:
            if peers[mode]["world"] != WORLD:
                print(f"  {rows} rows: {PEERS[mode]} needs about {needs[mode] / GB:.1f} GB for {WORLD} ranks, "
                      f"{available_bytes() / GB:.1f} GB available: it ran on {peers[mode]['world']} ranks (a lower "
                      "bound on its step time)")
    print("  anon grew: RssAnon after a step (gradients held) less RssAnon before the model was built, largest "
          f"step, busiest rank; grew ratio: against {PEERS['replicated-sparse']}'s")
    print("  load: the 1-minute load average when the run ended (2 cores, shared with other work); "
          "max |loss - single| is n/a for a run on fewer ranks (fewer batches per step)")
    print(f"  loss per step (sharded, 4 ranks): {[round(x, 5) for x in results[0][1]['losses']]}")
    for rows in speedups:
        best = speedups[rows]["best"]
        print(f"  {rows} rows: better peer {PEERS[best]}; convoy " + ", ".join(
            f"{speedups[rows][m][0]:.1f}x faster than {PEERS[m]}" for m in PEERS))

    print()
    worst, at = max(memory_ratios)
    print(f"target table_memory: measured per-rank memory (RssAnon growth from before the model, busiest "
          f"rank) sharded / replicated, worst {worst:.3f} (at {at} rows, against the peer that used less) "
          f"(goal ~{MEMORY_GOAL}: <= {MEMORY_GOAL * MEMORY_SLACK:.3f}) "
          f"{'met' if worst <= MEMORY_GOAL * MEMORY_SLACK else 'missed'}")
    if SPEED_AT in speedups:
        best = speedups[SPEED_AT]["best"]
        speedup, world = speedups[SPEED_AT][best]
        note = "" if world == WORLD else f", on {world} ranks (a lower bound)"
        dense, dense_world = speedups[SPEED_AT]["replicated"]
        print(f"target step_time_10M: better peer ({PEERS[best]}{note}) / sharded {speedup:.1f}x "
              f"(goal >= {SPEED_GOAL}x; {PEERS['replicated']} on {dense_world} ranks {dense:.1f}x) "
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
