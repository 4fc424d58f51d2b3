"""Sequence-parallel attention, 4 gloo ranks: query broadcast against all-gather K/V, ring pass-K/V
and Ulysses, and torch's fused single-device attention (``scaled_dot_product_attention``) as the peer.

    python benchmarks/sequence.py [--quick] [--lengths 2048,8192,16384] [--reps N]

d = 512 as 8 heads of 64, with 8 and with 2 K/V heads (8 only at the longest length), batch 1,
float32, query broadcast with ``auto_chunks`` chunks (``--micro``), no mask (the analytic byte
counts are for that case). Times are medians of 5 reps at L <= 2048, else of ``--reps`` (2), 1 at
the longest length. Each configuration runs in fresh processes. Memory, per process: one forward
and backward at full size first (what a first pass alone allocates for good, e.g. the autograd
engine's buffers), then the kernel's high-water mark is reset, and "peak" is the most resident
bytes the measured pass added to what the process held before it ("process", printed beside:
libraries, gloo, the inputs), so the attention's own bytes are counted apart from the process's.
Every process maps its large blocks (``MALLOC``) so that freed tensors leave the resident size.
The memory target is read from its own table (``MEMORY_LENGTH`` x d = 8192, 128 heads, with 128
and 32 K/V heads), where single-device attention's own peak is over a gigabyte; at d = 512 a
rank's part is a few MB and the buffers of a pass weigh as much, so those ratios are printed but
are not the target. At that size query broadcast is also timed against ring attention in the same
processes, reps interleaved (``--ring-only`` runs just that).
Bytes are what each rank handed to torch.distributed, mean over ranks, against the
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
ERROR_GOAL, MEMORY_GOAL = 1e-5, 0.30
MICRO = "auto"
"""Query micro-sequences per rank (``--micro``): auto is ``query_broadcast.auto_chunks`` (chunks by heads)."""
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}
"""Every process, each scheme and the peer alike: blocks of 64 KiB and more are mapped and unmapped as they are
allocated and freed, so the resident size is the bytes alive (glibc's default raises its mapping threshold to
the largest block freed, up to 32 MiB, after which freed tensors stay resident and the peak counts them)."""
MEMORY_LENGTH, MEMORY_HEADS, MEMORY_KV = 8192, 128, (128, 32)
"""The memory table: single-device attention's own peak over 1 GB (d = 8192), where the method matters."""


def run(scheme: str, length: int, kv_heads: int, causal: bool, reps: int, check: bool, out: Path,
        net: HostNetwork | None = None, heads: int = HEADS) -> list[dict]:
    """One configuration in fresh processes; with ``net``, rank r runs in host r's namespace."""
    single = scheme in PEERS
    port = str(free_port())
    argv = [sys.executable, str(WORKER), "--scheme", scheme, "--length", str(length), "--heads", str(heads),
            "--kv-heads", str(kv_heads), "--reps", str(reps), "--out", str(out), "--micro", str(MICRO)] + \
        (["--causal"] if causal else []) + (["--check"] if check else []) + (["--single"] if single else [])
    world = 1 if single else WORLD
    commands = []
    for rank in range(world):
        if net is None:
            commands.append((argv, rank_env(rank, world, port, **MALLOC)))
            continue
        env = rank_env(rank, world, port, MASTER_ADDR=net.host_address(0), GLOO_SOCKET_IFNAME=net.host_link(rank),
                       **MALLOC)
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


def paired(other: str, length: int, heads: int, kv: int, reps: int, tmp: Path) -> tuple[float, float]:
    """Query broadcast and ``other`` timed in the same processes, reps alternating between them (A B, B A, ...),
    so that a busy spell of this shared machine hits both alike; their fwd+bwd medians."""
    rows = run(f"query_broadcast,{other}", length, kv, False, reps, False, tmp / "pair.json", heads=heads)
    qb, theirs = (statistics.median(r["schemes"][s]["forward_backward_s"] for r in rows)
                  for s in ("query_broadcast", other))
    return qb, theirs


def interleaved(lengths: list[int], quick: bool, tmp: Path) -> list[tuple[str, float]]:
    """Query broadcast against all-gather K/V (8 K/V heads, the target's case), ``paired`` (the tables run each
    scheme in its own processes, minutes apart). Returns (configuration, all-gather fwd+bwd time / query-broadcast
    fwd+bwd time), medians."""
    if not lengths:
        return []
    print(f"\nloopback, {HEADS} K/V heads, not causal: query broadcast and all-gather K/V in the same processes, "
          f"reps interleaved (fwd+bwd s, median)")
    print(f"{'L':<8}{'reps':>6}{'query_broadcast':>17}{'allgather_kv':>14}{'ratio':>8}")
    ratios = []
    for length in lengths:
        count = 3 if quick else 9 if length <= 2048 else 5 if length <= 8192 else 3
        qb, ag = paired("allgather_kv", length, HEADS, HEADS, count, tmp)
        ratios.append((f"L={length} kv={HEADS}", ag / qb))
        print(f"{length:<8}{count:>6}{qb:>17.3f}{ag:>14.3f}{ag / qb:>8.2f}")
    return ratios


def against_ring(reps: int, tmp: Path) -> list[tuple[str, float]]:
    """Query broadcast against ring attention at the memory table's size, ``paired``. Returns (K/V heads,
    ring's fwd+bwd time / query broadcast's)."""
    print(f"\nL={MEMORY_LENGTH}, d={MEMORY_HEADS * HEAD_DIM}, not causal: query broadcast and ring in the same "
          f"processes, reps interleaved (fwd+bwd s, median of {reps})")
    print(f"{'K/V heads':<10}{'query_broadcast':>17}{'ring':>10}{'ratio':>8}")
    ratios = []
    for kv in MEMORY_KV:
        qb, ring = paired("ring", MEMORY_LENGTH, MEMORY_HEADS, kv, reps, tmp)
        ratios.append((f"kv={kv}", ring / qb))
        print(f"{kv:<10}{qb:>17.2f}{ring:>10.2f}{ring / qb:>8.2f}")
    return ratios


def fits(scheme: str, length: int, heads: int = HEADS) -> bool:
    """Whether the L x L scores of the schemes that materialise them stay under the limit."""
    if scheme == "naive":
        return length <= NAIVE_LENGTH and length * length * heads * 4 <= SCORES_LIMIT * 2
    if scheme == "ulysses":
        return length * length * (heads // WORLD) * 4 <= SCORES_LIMIT / 2
    return True


def analytic(scheme: str, length: int, kv_heads: int, heads: int = HEADS) -> float:
    d_kv, d_model = kv_heads * HEAD_DIM, heads * HEAD_DIM
    elements = {"query_broadcast": 2 * length * d_model * (WORLD - 1) / WORLD, "ring": 2 * length * d_kv,
                "ulysses": 4 * length * d_model / WORLD, "allgather_kv": 2 * length * d_kv * (WORLD - 1) / WORLD}
    return elements[scheme] * 4


class Table:
    """One length and width, every scheme and the single-device peers in fresh processes: times, bytes sent,
    each process's resident size before the pass and the attention's own peak over it."""

    def __init__(self, length: int, heads: int, kv: int, reps: int, tmp: Path) -> None:
        self.length, self.heads, self.kv, self.reps, self.tmp = length, heads, kv, reps, tmp
        self.peaks: dict[str, float] = {}
        self.times: dict[str, float] = {}

    def print(self) -> None:
        print(f"\nL={self.length}, d={self.heads * HEAD_DIM}, {self.heads} heads, {self.kv} K/V heads, {WORLD} ranks, "
              f"not causal (times: median of {self.reps}; MB: resident size, the process before the pass and the "
              f"most the pass added, per rank)")
        print(f"{'scheme':<18}{'fwd s':>8}{'fwd+bwd s':>11}{'fwd MB/rank':>13}{'analytic':>10}"
              f"{'bwd MB/rank':>13}{'process MB':>12}{'peak MB':>10}{'vs sdpa':>9}{'vs naive':>10}")
        for scheme in (*PEERS, *SCHEMES):
            self.row(scheme)

    def row(self, scheme: str) -> None:
        label = "naive (L^2)" if scheme == "naive" else scheme
        if scheme == "naive" and self.length > NAIVE_LENGTH:
            print(f"{label:<18}{f'not run above L={NAIVE_LENGTH} (slow, L^2 scores)':>47}")
            return
        if not fits(scheme, self.length, self.heads):
            print(f"{label:<18}{'does not fit (L^2 scores)':>40}")
            return
        rows = run(scheme, self.length, self.kv, False, self.reps, False, self.tmp / "run.json", heads=self.heads)
        peak = max(r["peak_bytes"] for r in rows)
        process = max(r["process_bytes"] for r in rows)
        fwd = statistics.median(r["forward_s"] for r in rows)
        self.times[scheme] = both = statistics.median(r["forward_backward_s"] for r in rows)
        against = [f"{peak / self.peaks[p]:.3f}" if p in self.peaks else "-" for p in PEERS]
        self.peaks[scheme] = peak
        sent = "-", "-", "-"
        if scheme not in PEERS:
            sent = (f"{statistics.mean(r['bytes_forward'] for r in rows) / 2**20:.2f}",
                    f"{analytic(scheme, self.length, self.kv, self.heads) / 2**20:.2f}",
                    f"{statistics.mean(r['bytes_backward'] for r in rows) / 2**20:.2f}")
        print(f"{label:<18}{fwd:>8.2f}{both:>11.2f}{sent[0]:>13}{sent[1]:>10}{sent[2]:>13}{process / 2**20:>12.0f}"
              f"{peak / 2**20:>10.0f}{against[0]:>9}{against[1]:>10}")

    def ratio(self, scheme: str, peer: str = "sdpa") -> float | None:
        """``scheme``'s peak per rank over ``peer``'s, where both ran."""
        if scheme in self.peaks and peer in self.peaks:
            return self.peaks[scheme] / self.peaks[peer]
        return None


def listing(ratios: list[tuple[str, float]]) -> str:
    return ", ".join(f"{name} {ratio:.2f}" for name, ratio in ratios)


def print_faster(target: str, what: str, ratios: list[tuple[str, float]], beside: str = "",
                 strict: bool = True) -> None:
    """A speed target's line: the worst of ``ratios`` (the peer's time over query broadcast's) against 1, above it
    where ``strict``, at least 1 otherwise."""
    name, ratio = min(ratios, key=lambda item: item[1])
    met = ratio > 1.0 if strict else ratio >= 1.0
    print(f"target {target}: {what}, worst {ratio:.2f} ({name}; all: {listing(ratios)}"
          f"{'; ' + beside if beside else ''}) (goal {'>' if strict else '>='} 1.00) {'met' if met else 'missed'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2048 positions only, 1 rep")
    parser.add_argument("--lengths", default=None, help="comma-separated sequence lengths (default 2048,8192,16384)")
    parser.add_argument("--reps", type=int, default=None, help="timed reps (default 2)")
    parser.add_argument("--rate", default="100mbit", help="each host's uplink in the slow-link run (tc syntax)")
    parser.add_argument("--slow-link-only", action="store_true", help="only the slow-link comparison")
    parser.add_argument("--ring-only", action="store_true", help="only query broadcast against ring, interleaved, "
                        "at the memory table's size")
    parser.add_argument("--micro", default=MICRO, help=f"query micro-sequences per rank (default {MICRO})")
    args = parser.parse_args()
    globals()["MICRO"] = args.micro
    lengths = [int(x) for x in (args.lengths or ("2048" if args.quick else "2048,8192,16384")).split(",")]
    reps = args.reps or (1 if args.quick else 2)
    short_reps = args.reps or (1 if args.quick else 5)  # the short rows are fast and the noisiest: more reps
    errors: dict[str, float] = {}
    memory: list[tuple[str, float]] = []
    small_memory: list[tuple[str, float]] = []
    sdpa_peaks: list[float] = []
    separate_ring: list[tuple[str, float]] = []
    naive_memory: list[tuple[str, float]] = []
    separate: list[tuple[str, float]] = []
    speed: list[tuple[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="convoy-bench-sequence-") as tmp:
        if args.slow_link_only:
            lengths = lengths[:1]
        for causal in () if args.slow_link_only or args.ring_only else (False, True):  # exactness, shortest length
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
        for length in [] if args.slow_link_only or args.ring_only else lengths:
            longest = length == max(lengths) and len(lengths) > 2
            table_reps = 1 if longest else short_reps if length <= 2048 else reps
            for kv in (HEADS,) if longest else (HEADS, 2):  # the longest: one K/V width, one rep (minutes each)
                table = Table(length, HEADS, kv, table_reps, Path(tmp))
                table.print()
                for scheme in SCHEMES:
                    if table.ratio(scheme) is not None:
                        small_memory.append((f"{scheme} L={length} kv={kv}", table.ratio(scheme)))
                    if table.ratio(scheme, "naive") is not None:
                        naive_memory.append((f"{scheme} L={length} kv={kv}", table.ratio(scheme, "naive")))
                if kv * 2 * HEAD_DIM > D_MODEL:  # K/V bytes exceed Q bytes
                    times = table.times
                    separate.append((f"L={length} kv={kv}", times["allgather_kv"] / times["query_broadcast"]))
        only = args.slow_link_only or args.ring_only
        for kv in () if only or args.quick else MEMORY_KV:
            table = Table(MEMORY_LENGTH, MEMORY_HEADS, kv, 1, Path(tmp))
            table.print()
            memory += [(f"{scheme} L={MEMORY_LENGTH} d={MEMORY_HEADS * HEAD_DIM} kv={kv}", table.ratio(scheme))
                       for scheme in SCHEMES if table.ratio(scheme) is not None]
            sdpa_peaks.append(table.peaks["sdpa"])
            separate_ring.append((f"kv={kv}", table.times["ring"] / table.times["query_broadcast"]))
        ring_ratios = [] if args.quick or args.slow_link_only else against_ring(2, Path(tmp))
        speed = interleaved([] if only else lengths, args.quick, Path(tmp))
        slow = [] if args.ring_only else slow_link(lengths[0], args.rate, reps, Path(tmp))
    print()
    if errors:
        worst = max(errors.values())
        print(f"target exact_fp32: worst max abs error {worst:.2e} over {len(errors)} runs (goal < {ERROR_GOAL:.0e}) "
              f"{'met' if worst < ERROR_GOAL else 'missed'}")
    qb_memory = [(name, ratio) for name, ratio in memory if name.startswith("query_broadcast")]
    if qb_memory:
        name, ratio = max(qb_memory, key=lambda item: item[1])
        print(f"target memory_per_device: query broadcast's peak per rank / single-device SDPA's, where SDPA's own "
              f"peak is {', '.join(f'{p / 2**30:.2f}' for p in sdpa_peaks)} GB: worst {ratio:.3f} ({name}; all: "
              f"{', '.join(f'{r:.3f}' for _, r in qb_memory)}; the other schemes: "
              f"{', '.join(f'{n} {r:.3f}' for n, r in memory if not n.startswith('query_broadcast'))}) "
              f"(goal <= {MEMORY_GOAL:.2f}) {'met' if ratio <= MEMORY_GOAL else 'missed'}")
    if ring_ratios:
        print_faster("not_slower_than_ring", f"ring's fwd+bwd time / query broadcast's at L={MEMORY_LENGTH} d="
                     f"{MEMORY_HEADS * HEAD_DIM}, interleaved in the same processes", ring_ratios,
                     f"the tables' separate single passes: {listing(separate_ring) or 'not run'}", strict=False)
    qb_small = [(name, ratio) for name, ratio in small_memory if name.startswith("query_broadcast")]
    if qb_small:  # not a target: at d = 512 a rank's part is a few MB and the buffers of a pass weigh as much
        print(f"(not a target) query broadcast peak per rank / SDPA's at d={D_MODEL}: "
              f"{', '.join(f'{r:.3f} ({name})' for name, r in qb_small)}")
    qb_naive = [(name, ratio) for name, ratio in naive_memory if name.startswith("query_broadcast")]
    if qb_naive:  # not a target: the naive peer holds L^2 scores, so this ratio measures the kernel too
        print(f"(not a target) query broadcast peak per rank / naive single-device peak (L^2 scores, L <= "
              f"{NAIVE_LENGTH}): {', '.join(f'{r:.3f} ({name})' for name, r in qb_naive)}")
    if speed:
        print_faster("faster_than_allgather", "all-gather K/V time / query broadcast time on loopback "
                     "(compute-bound), interleaved in the same processes", speed,
                     f"the separate runs of the tables: {listing(separate)}")
    if slow:
        print_faster("faster_than_allgather_slow_link", "all-gather K/V time / query broadcast time", slow)
    return 0


if __name__ == "__main__":
    sys.exit(main())
