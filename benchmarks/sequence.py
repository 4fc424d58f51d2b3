"""Sequence-parallel attention, 4 gloo ranks: query broadcast against all-gather K/V, ring pass-K/V
and Ulysses, and torch's fused single-device attention (``scaled_dot_product_attention``) as the peer.

    python benchmarks/sequence.py [--quick] [--lengths 2048,8192,16384] [--reps N]

d = 512 as 8 heads of 64, with 8 and with 2 K/V heads (8 only at the longest length), batch 1,
float32, query broadcast with ``auto_micro`` micro-sequences (``--micro``), no mask (the
analytic byte counts are for that case). Times are medians of 5 reps at L <= 2048, else of
``--reps`` (2), 1 at the longest length. Each configuration runs in fresh processes so its
peak memory (resident size reached during one forward and backward, over what it held before)
is its own. Bytes are what each rank handed to torch.distributed, mean over ranks, against the
analytic counts: query broadcast 2 L d (n-1)/n, ring about 2 L d_kv, Ulysses about 4 L d / n
(d_kv = K/V heads x 64). Exactness (max abs error against float64 single-device attention,
causal and not) is checked at the shortest length. Configurations that can't fit in memory
(Ulysses materialises L^2 scores) are skipped above a limit and reported.
The peer is the whole sequence in one process through ``torch.nn.functional.scaled_dot_product_attention``
(CPU flash kernels, forward and backward, grouped K/V heads as they are, same shapes, dtype, warm-up
and peak measurement as a rank), so "vs sdpa" (a rank's peak over the peer's, the memory target's
ratio) compares sharding against the best single device, fused kernels on both sides. Up to
L = 2048 (``NAIVE_LENGTH``; cheap there, half a minute and 6 GB a pass at 8192) the old peer runs
too, plain autograd attention holding all L x L scores, labelled naive; "vs naive" is beside it.
The loopback speed target is measured apart, with query broadcast and all-gather K/V (8 K/V
heads) timed in the same processes, reps alternating, so that a busy spell of this shared
machine slows both alike; the separate runs' ratios are printed beside it.
Last, where bytes set the time: each rank on its own network namespace "host" with its uplink
limited (``--rate``, default 100 Mbit/s; needs root), query broadcast against all-gather K/V at
the shortest length, with and without a causal mask, bytes read from the links.
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
from convoy.testing.netns import HostNetwork, netns_problem  # noqa: E402
from ranks import rank_env, run_ranks  # noqa: E402

WORKER = REPO / "benchmarks" / "scripts" / "sequence_worker.py"
WORLD, D_MODEL, HEADS, HEAD_DIM = 4, 512, 8, 64
SCHEMES = ("query_broadcast", "allgather_kv", "ring", "ulysses")
PEERS = ("sdpa", "naive")
"""Single-device rows, one process each: the peer, then the naive reference (scores held, not the peer)."""
NAIVE_LENGTH = 2048
"""Longest sequence the naive single-device row runs at (it holds L x L scores and is slow above)."""
SCORES_LIMIT = 2.5e9
"""Most bytes one process may spend on a single L x L score tensor (per head, float32)."""
ERROR_GOAL, MEMORY_SLACK = 1e-5, 1.10
MICRO = "auto"
"""Query micro-sequences per rank (``--micro``): auto is ``sequence.auto_micro`` (1 at L=2048, 4 from 8192)."""


def run(scheme: str, length: int, kv_heads: int, causal: bool, reps: int, check: bool, out: Path,
        net: HostNetwork | None = None) -> list[dict]:
    """One configuration in fresh processes; with ``net``, rank r runs in host r's namespace."""
    single = scheme in PEERS
    port = str(free_port())
    argv = [sys.executable, str(WORKER), "--scheme", scheme, "--length", str(length), "--kv-heads", str(kv_heads),
            "--reps", str(reps), "--out", str(out), "--micro", str(MICRO)] + (["--causal"] if causal else []) + \
        (["--check"] if check else []) + (["--single"] if single else [])
    world = 1 if single else WORLD
    commands = []
    for rank in range(world):
        if net is None:
            commands.append((argv, rank_env(rank, world, port)))
            continue
        env = rank_env(rank, world, port, MASTER_ADDR=net.host_address(0), GLOO_SOCKET_IFNAME=net.host_link(rank))
        commands.append(([*net.exec_prefix(rank), *argv], env))
    run_ranks(commands, f"{scheme} L={length}")
    return json.loads(out.read_text())


def slow_link(length: int, rate: str, reps: int, tmp: Path) -> list[tuple[str, float]]:
    """Each rank on its own namespace host, every host's uplink limited to ``rate``: query
    broadcast against all-gather K/V (8 K/V heads) with and without a causal mask. Returns
    (configuration, all-gather time / query-broadcast time)."""
    problem = netns_problem()
    if problem:
        print(f"\nslow link skipped: {problem}")
        return []
    ratios = []
    with HostNetwork(WORLD, prefix="cvs", second_octet=79) as net:
        shaped = {net.shape(host, rate, "0.5ms") for host in range(WORLD)}
        print(f"\nL={length}, 8 K/V heads, each rank on its own host, uplinks {', '.join(shaped)} "
              f"(times: median of {reps}; bytes: measured on each host's link, mean per host, fwd+bwd)")
        print(f"{'mask':<8}{'scheme':<18}{'fwd s':>8}{'fwd+bwd s':>11}{'wire MB/host':>14}")
        for causal in (False, True):
            times = {}
            for scheme in ("query_broadcast", "allgather_kv"):
                before = [net.sent_bytes(h) for h in range(WORLD)]
                rows = run(scheme, length, HEADS, causal, reps, False, tmp / "slow.json", net)
                # one measured forward+backward, then reps x (forward, forward+backward); both schemes send
                # as much in a backward as in a forward, so that is 1 + 1.5 reps forward+backward passes
                wire = statistics.mean(net.sent_bytes(h) - b for h, b in enumerate(before)) / (1 + 1.5 * reps)
                times[scheme] = statistics.median(r["forward_backward_s"] for r in rows)
                print(f"{'causal' if causal else 'none':<8}{scheme:<18}"
                      f"{statistics.median(r['forward_s'] for r in rows):>8.2f}{times[scheme]:>11.2f}"
                      f"{wire / 2**20:>14.2f}")
            ratios.append((f"slow link, L={length}, {'causal' if causal else 'no mask'}",
                           times["allgather_kv"] / times["query_broadcast"]))
    return ratios


def interleaved(lengths: list[int], quick: bool, tmp: Path) -> list[tuple[str, float]]:
    """Query broadcast against all-gather K/V (8 K/V heads, the target's case) timed in the same
    processes, reps alternating between them, so that a busy spell of this shared machine hits
    both alike (the tables run each scheme in its own processes, minutes apart). Returns
    (configuration, all-gather fwd+bwd time / query-broadcast fwd+bwd time), medians."""
    if not lengths:
        return []
    print(f"\nloopback, {HEADS} K/V heads, not causal: query broadcast and all-gather K/V in the same processes, "
          f"reps interleaved (fwd+bwd s, median)")
    print(f"{'L':<8}{'reps':>6}{'query_broadcast':>17}{'allgather_kv':>14}{'ratio':>8}")
    ratios = []
    for length in lengths:
        count = 3 if quick else 9 if length <= 2048 else 5 if length <= 8192 else 3
        rows = run("query_broadcast,allgather_kv", length, HEADS, False, count, False, tmp / "pair.json")
        qb, ag = (statistics.median(r["schemes"][s]["forward_backward_s"] for r in rows)
                  for s in ("query_broadcast", "allgather_kv"))
        ratios.append((f"L={length} kv={HEADS}", ag / qb))
        print(f"{length:<8}{count:>6}{qb:>17.3f}{ag:>14.3f}{ag / qb:>8.2f}")
    return ratios


def fits(scheme: str, length: int) -> bool:
    """Whether the L x L scores of the schemes that materialise them stay under the limit."""
    if scheme == "naive":
        return length <= NAIVE_LENGTH and length * length * HEADS * 4 <= SCORES_LIMIT * 2
    if scheme == "ulysses":
        return length * length * (HEADS // WORLD) * 4 <= SCORES_LIMIT / 2
    return True


def analytic(scheme: str, length: int, kv_heads: int) -> float:
    d_kv = kv_heads * HEAD_DIM
    elements = {"query_broadcast": 2 * length * D_MODEL * (WORLD - 1) / WORLD, "ring": 2 * length * d_kv,
                "ulysses": 4 * length * D_MODEL / WORLD, "allgather_kv": 2 * length * d_kv * (WORLD - 1) / WORLD}
    return elements[scheme] * 4


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2048 positions only, 1 rep")
    parser.add_argument("--lengths", default=None, help="comma-separated sequence lengths (default 2048,8192,16384)")
    parser.add_argument("--reps", type=int, default=None, help="timed reps (default 2)")
    parser.add_argument("--rate", default="100mbit", help="each host's uplink in the slow-link run (tc syntax)")
    parser.add_argument("--slow-link-only", action="store_true", help="only the slow-link comparison")
    parser.add_argument("--micro", default=MICRO, help=f"query micro-sequences per rank (default {MICRO})")
    args = parser.parse_args()
    globals()["MICRO"] = args.micro
    lengths = [int(x) for x in (args.lengths or ("2048" if args.quick else "2048,8192,16384")).split(",")]
    reps = args.reps or (1 if args.quick else 2)
    short_reps = args.reps or (1 if args.quick else 5)  # the short rows are fast and the noisiest: more reps
    errors: dict[str, float] = {}
    memory: list[tuple[str, float]] = []
    naive_memory: list[tuple[str, float]] = []
    separate: list[tuple[str, float]] = []
    speed: list[tuple[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="convoy-bench-sequence-") as tmp:
        if args.slow_link_only:
            lengths = lengths[:1]
        for causal in () if args.slow_link_only else (False, True):  # exactness, shortest length
            for scheme in SCHEMES:
                for kv in (HEADS, 2):
                    rows = run(scheme, lengths[0], kv, causal, 1, True, Path(tmp) / "check.json")
                    worst = max(max(r["errors"].values()) for r in rows)
                    errors[f"{scheme} kv={kv} {'causal' if causal else 'full'}"] = worst
        if errors:
            print(f"exactness at L={lengths[0]}, float32 against float64 single-device attention (max abs error, "
                  f"output and q/k/v gradients, every rank):")
        for name, worst in errors.items():
            print(f"  {name:<36} {worst:.2e}")
        for length in [] if args.slow_link_only else lengths:
            longest = length == max(lengths) and len(lengths) > 2
            table_reps = 1 if longest else short_reps if length <= 2048 else reps
            for kv in (HEADS,) if longest else (HEADS, 2):  # the longest: one K/V width, one rep (minutes each)
                print(f"\nL={length}, d={D_MODEL}, {HEADS} heads, {kv} K/V heads, {WORLD} ranks, not causal "
                      f"(times: median of {table_reps})")
                print(f"{'scheme':<18}{'fwd s':>8}{'fwd+bwd s':>11}{'fwd MB/rank':>13}{'analytic':>10}"
                      f"{'bwd MB/rank':>13}{'peak MB/rank':>14}{'vs sdpa':>9}{'vs naive':>10}")
                peers: dict[str, float] = {}
                for scheme in (*PEERS, *SCHEMES):
                    label = "naive (L^2)" if scheme == "naive" else scheme
                    if scheme == "naive" and length > NAIVE_LENGTH:
                        print(f"{label:<18}{f'not run above L={NAIVE_LENGTH} (slow, L^2 scores)':>47}")
                        continue
                    if not fits(scheme, length):
                        print(f"{label:<18}{'does not fit (L^2 scores)':>40}")
                        continue
                    rows = run(scheme, length, kv, False, table_reps, False, Path(tmp) / "run.json")
                    peak = max(r["peak_bytes"] for r in rows)
                    fwd, both = statistics.median(r["forward_s"] for r in rows), \
                        statistics.median(r["forward_backward_s"] for r in rows)
                    against = [f"{peak / peers[p]:.3f}" if p in peers and p != scheme else "-" for p in PEERS]
                    if scheme in PEERS:
                        peers[scheme] = peak
                        print(f"{label:<18}{fwd:>8.2f}{both:>11.2f}{'-':>13}{'-':>10}{'-':>13}{peak / 2**20:>14.0f}"
                              f"{against[0]:>9}{against[1]:>10}")
                        continue
                    sent_f = statistics.mean(r["bytes_forward"] for r in rows)
                    sent_b = statistics.mean(r["bytes_backward"] for r in rows)
                    ratio = peak / peers["sdpa"] if "sdpa" in peers else float("nan")
                    if "sdpa" in peers:
                        memory.append((f"{scheme} L={length} kv={kv}", ratio))
                    if "naive" in peers:
                        naive_memory.append((f"{scheme} L={length} kv={kv}", peak / peers["naive"]))
                    if scheme == "query_broadcast":
                        qb_time = both
                    if scheme == "allgather_kv" and kv * 2 * HEAD_DIM > D_MODEL:  # K/V bytes exceed Q bytes
                        separate.append((f"L={length} kv={kv}", both / qb_time))
                    print(f"{scheme:<18}{fwd:>8.2f}{both:>11.2f}{sent_f / 2**20:>13.2f}"
                          f"{analytic(scheme, length, kv) / 2**20:>10.2f}{sent_b / 2**20:>13.2f}"
                          f"{peak / 2**20:>14.0f}{against[0]:>9}{against[1]:>10}")
        speed = interleaved([] if args.slow_link_only else lengths, args.quick, Path(tmp))
        slow = slow_link(lengths[0], args.rate, reps, Path(tmp))
    print()
    if errors:
        worst = max(errors.values())
        print(f"target exact_fp32: worst max abs error {worst:.2e} over {len(errors)} runs (goal < {ERROR_GOAL:.0e}) "
              f"{'met' if worst < ERROR_GOAL else 'missed'}")
    goal = MEMORY_SLACK / WORLD
    qb_memory = [(name, ratio) for name, ratio in memory if name.startswith("query_broadcast")]
    if qb_memory:
        name, ratio = max(qb_memory, key=lambda item: item[1])
        print(f"target memory_per_device: query broadcast peak per rank / single-device SDPA peak, worst {ratio:.3f} "
              f"({name}; all: {', '.join(f'{r:.3f}' for _, r in qb_memory)}) (goal <= {goal:.3f}) "
              f"{'met' if ratio <= goal else 'missed'}")
    qb_naive = [(name, ratio) for name, ratio in naive_memory if name.startswith("query_broadcast")]
    if qb_naive:  # not a target: the naive peer holds L^2 scores, so this ratio measures the kernel too
        print(f"(not a target) query broadcast peak per rank / naive single-device peak (L^2 scores, L <= "
              f"{NAIVE_LENGTH}): {', '.join(f'{r:.3f} ({name})' for name, r in qb_naive)}")
    if speed:
        name, ratio = min(speed, key=lambda item: item[1])
        print(f"target faster_than_allgather: all-gather K/V time / query broadcast time on loopback (compute-bound), "
              f"interleaved in the same processes, worst {ratio:.2f} ({name}; all: "
              f"{', '.join(f'{r:.2f}' for _, r in speed)}; the separate runs of the tables: "
              f"{', '.join(f'{r:.2f}' for _, r in separate)}) (goal > 1.00) {'met' if ratio > 1.0 else 'missed'}")
    if slow:
        name, ratio = min(slow, key=lambda item: item[1])
        print(f"target faster_than_allgather_slow_link: all-gather K/V time / query broadcast time, worst {ratio:.2f} "
              f"({name}; all: {', '.join(f'{r:.2f}' for _, r in slow)}) (goal > 1.00) "
              f"{'met' if ratio > 1.0 else 'missed'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
