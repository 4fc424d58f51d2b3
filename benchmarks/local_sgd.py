"""Group-wise local SGD against fully synchronous data parallelism (and torch's PeriodicModelAverager).

    python benchmarks/local_sgd.py [--quick] [--steps 400] [--every 8] [--seeds 3] [--rate 100mbit]

4 ranks as 2 model groups x 2 pipeline stages train the character-level language model of
examples/train_local_sgd.py (text: the Python standard library's sources) for the same number
of steps in each configuration:

- ``ddp``: each step every shard's gradients are averaged over its shard group (the peer);
- ``torch-averager``: torch's ``PeriodicModelAverager`` every H steps (the peer for averaging);
- convoy ``LocalSGD`` every H steps: plain averaging, Nesterov (DiLoCo's outer optimizer), and
  Nesterov with staggered shards.

(a) loopback: held-out loss of the final model, the training-loss curve, and the bytes each
rank sent to other groups (counted per allreduce, ring model: a figure, not a target). ``ddp``
and averaging run with ``--seeds`` seeds (median reported), the others with one. (b) slow link:
each group is a network namespace whose traffic to the other group goes through ``tc netem``
(default 100 Mbit/s, 1 ms), its two stages talking over their namespace's loopback; wall time of
``ddp`` and averaging, and the bytes the links carried, read from the links' own counters. The
bytes target is measured there: each configuration runs for N and for 2N steps, and the
difference of the two runs' link bytes is what N training steps carry (start-up, rendezvous and
shutdown cancel out). The slow link trains its own model (``--slow-width``, default 128: 0.87 M
parameters, 3.5 MB of gradients a step, about 0.4 s of the default link a step for DDP against about 0.1 s of
compute) so that the link bounds DDP's step, as it does for the users of DiLoCo-style training; (a)'s model is
small enough for its 9 runs to fit. Needs root for (b); without it the bytes and wall targets print ``missed``
with the reason. Writes the loss curves to ``--png``.
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

EXAMPLE = REPO / "examples" / "train_local_sgd.py"
WORLD, SHARDS = 4, 2
BYTES_GOAL, LOSS_GOAL, WALL_GOAL = 1 / 8, 0.03, 0.8
CONFIGS = {
    "ddp": ["--sync", "ddp"],
    "torch-averager": ["--sync", "torch-averager"],
    "average": ["--sync", "local", "--outer", "average"],
    "nesterov": ["--sync", "local", "--outer", "nesterov"],
    "nesterov-staggered": ["--sync", "local", "--outer", "nesterov", "--stagger"],
}
MAIN = "average"  # the best at H=8; DiLoCo's Nesterov (0.7, 0.9) is tuned for H in the hundreds


def run(name: str, args: argparse.Namespace, seed: int, out: Path, net: HostNetwork | None = None) -> dict:
    """One training job of 4 ranks; with ``net``, group g's ranks run in host g's namespace."""
    port, argv = str(free_port()), [sys.executable, str(EXAMPLE), *CONFIGS[name], "--every", str(args.every),
                                    "--steps", str(args.steps), "--seed", str(seed), "--out", str(out),
                                    "--log-every", str(10 ** 6), *args.model]
    commands = []
    for rank in range(WORLD):
        host = rank // SHARDS
        env = rank_env(rank, WORLD, port)
        if net is not None:
            env.update(MASTER_ADDR=net.host_address(0), GLOO_SOCKET_IFNAME=net.host_link(host))
        commands.append(([*(net.exec_prefix(host) if net else []), *argv], env))
    before = [net.sent_bytes(h) for h in range(2)] if net else []
    run_ranks(commands, f"local SGD {name} seed {seed}", timeout=3600)
    result = json.loads(out.read_text())
    if net:
        result["link_bytes"] = sum(net.sent_bytes(h) - b for h, b in enumerate(before))
    curves = [dict(curve) for curve in result["curves"].values()]
    result["curve"] = [statistics.mean(curve[step] for curve in curves) for step in range(args.steps)]
    tail = max(1, args.steps // 10)
    result["train_loss"] = statistics.mean(result["curve"][-tail:])
    return result


def steps_bytes(slow: dict[str, dict], name: str, steps: int) -> float:
    """Link bytes of ``steps`` training steps: the 2N-step run's counters less the N-step run's."""
    return (slow[f"{name} x2"]["link_bytes"] - slow[name]["link_bytes"]) / steps


def smooth(values: list[float], width: int) -> list[float]:
    out, total = [], 0.0
    for index, value in enumerate(values):
        total += value - (values[index - width] if index >= width else 0.0)
        out.append(total / min(index + 1, width))
    return out


def plot(rows: dict[str, list[dict]], path: Path, every: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_bytes) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, results in rows.items():
        curve = smooth(results[0]["curve"], 20)
        label = name if name == "ddp" else f"{name} (H={every})"
        by_step.plot(range(len(curve)), curve, label=label)
        per_step = results[0]["cross_bytes_rank0"] / len(curve) / 2 ** 20
        by_bytes.plot([per_step * (s + 1) for s in range(len(curve))], curve, label=label)
    by_step.set(xlabel="step", ylabel="training loss (nats/byte, mean of 20 steps)", title="loss per step")
    by_bytes.set(xlabel="MB sent to the other group by one rank", ylabel="training loss", xscale="log",
                 title="loss per byte between groups")
    for axis in (by_step, by_bytes):
        axis.grid(alpha=0.3)
        axis.legend()
    fig.suptitle("char-level LM, 2 groups x 2 pipeline stages (4 gloo ranks)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 48 steps, one seed (about a minute)")
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default 400)")
    parser.add_argument("--every", type=int, default=8, help="H: inner steps between syncs")
    parser.add_argument("--seeds", type=int, default=None, help=f"seeds for ddp and {MAIN} (default 3)")
    parser.add_argument("--slow-steps", type=int, default=None, help="steps per slow-link run (default 120)")
    parser.add_argument("--rate", default="100mbit", help="the slow link's rate (tc syntax)")
    parser.add_argument("--delay", default="1ms", help="the slow link's one-way delay (tc syntax)")
    parser.add_argument("--slow-width", type=int, default=128,
                        help="the slow-link runs' model width (4 layers): big enough that the link bounds DDP's step")
    parser.add_argument("--png", default=str(REPO / "benchmarks" / "results" / "local_sgd.png"),
                        help="where the loss-curve plot goes")
    args = parser.parse_args()
    args.steps = args.steps or (48 if args.quick else 400)
    args.seeds = args.seeds or (1 if args.quick else 3)
    args.slow_steps = args.slow_steps or (24 if args.quick else 120)
    args.model = ["--width", "32", "--layers", "2", "--heads", "2", "--batch", "16", "--corpus-bytes", "500000"
                  ] if args.quick else []
    slow_model = ["--width", str(args.slow_width), "--layers", "4", "--heads", "4", "--batch", "16",
                  "--corpus-bytes", "500000"]
    if args.steps < args.every or args.every < 1 or args.seeds < 1:
        parser.error("need --every >= 1, --steps >= --every and --seeds >= 1")
    if args.slow_steps % args.every:
        parser.error(f"--slow-steps must be a multiple of --every ({args.every}), so that both slow-link runs end "
                     "on a sync")
    rows: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="convoy-bench-local-sgd-") as tmp:
        for name in CONFIGS:
            seeds = range(args.seeds if name in ("ddp", MAIN) else 1)
            rows[name] = [run(name, args, seed, Path(tmp) / f"{name}-{seed}.json") for seed in seeds]
            print(f"  ran {name} ({len(rows[name])} seed(s))", flush=True)
        problem = netns_problem()
        slow: dict[str, dict] = {}
        if not problem:
            slow_args = argparse.Namespace(**{**vars(args), "steps": args.slow_steps, "model": slow_model})
            long_args = argparse.Namespace(**{**vars(args), "steps": 2 * args.slow_steps, "model": slow_model})
            for name in ("ddp", MAIN):
                for key, run_args in ((name, slow_args), (f"{name} x2", long_args)):
                    with HostNetwork(2, prefix="cvl", second_octet=81) as net:
                        shaped = {net.shape(host, args.rate, args.delay) for host in range(2)}
                        slow[key] = run(name, run_args, 0, Path(tmp) / f"slow-{key}.json", net)
                print(f"  ran {name} on the slow link ({args.slow_steps} and {2 * args.slow_steps} steps)", flush=True)

    ddp = rows["ddp"]
    ddp_loss = statistics.median(r["held_out_loss"] for r in ddp)
    ddp_bytes = ddp[0]["cross_bytes_rank0"]
    print(f"\n(a) loopback: {WORLD} ranks as 2 groups x {SHARDS} stages, {args.steps} steps, H={args.every}, "
          f"{ddp[0]['params'] / 1e6:.2f} M parameters")
    print(f"{'config':>20}{'seeds':>6}{'held-out loss':>15}{'vs ddp':>9}{'train loss':>12}"
          f"{'MB to other group':>19}{'vs ddp':>9}{'wall s':>9}{'identical':>10}")
    for name, results in rows.items():
        loss = statistics.median(r["held_out_loss"] for r in results)
        sent = results[0]["cross_bytes_rank0"]
        print(f"{name:>20}{len(results):>6}{loss:>15.4f}{loss / ddp_loss:>9.3f}"
              f"{statistics.median(r['train_loss'] for r in results):>12.4f}{sent / 1e6:>19.2f}"
              f"{sent / ddp_bytes:>9.4f}{statistics.median(r['wall_s'] for r in results):>9.1f}"
              f"{'yes' if all(r['identical'] for r in results) else 'NO':>10}")
    for name in ("ddp", MAIN):
        print(f"  {name} held-out loss per seed: {[round(r['held_out_loss'], 4) for r in rows[name]]}")
    plot(rows, Path(args.png), args.every)
    print(f"loss curves: {args.png}")
    if slow:
        print(f"\n(b) slow link between the groups ({', '.join(shaped)}), {args.slow_steps} steps, "
              f"{slow['ddp']['params'] / 1e6:.2f} M parameters ({' '.join(slow_model)})")
        print(f"{'config':>20}{'steps':>7}{'wall s':>9}{'s/step':>9}{'MB on the links':>17}{'MB counted':>12}")
        for name, result in slow.items():
            counted, steps = result["cross_bytes_rank0"] * WORLD, len(result["curve"])
            print(f"{name:>20}{steps:>7}{result['wall_s']:>9.1f}{result['wall_s'] / steps:>9.3f}"
                  f"{result['link_bytes'] / 1e6:>17.2f}{counted / 1e6:>12.2f}")
        per_step = {name: steps_bytes(slow, name, args.slow_steps) for name in ("ddp", MAIN)}
        print("  link MB per training step (the x2 run less the other, over the steps between them): "
              + ", ".join(f"{name} {value / 1e6:.3f}" for name, value in per_step.items()))
        slow_loss = {name: slow[f"{name} x2"]["held_out_loss"] for name in ("ddp", MAIN)}
        print(f"  held-out loss after {2 * args.slow_steps} steps: ddp {slow_loss['ddp']:.4f}, {MAIN} "
              f"{slow_loss[MAIN]:.4f} ({slow_loss[MAIN] / slow_loss['ddp'] - 1:+.2%})")
        steady = {name: (slow[f"{name} x2"]["wall_s"] - slow[name]["wall_s"]) / args.slow_steps
                  for name in ("ddp", MAIN)}
        print("  s per training step, the same difference (no start-up, no first connections): "
              + ", ".join(f"{name} {value:.3f}" for name, value in steady.items())
              + f"; {MAIN} / ddp {steady[MAIN] / steady['ddp']:.3f}")
    else:
        print(f"\n(b) slow link skipped: {problem}")

    print()
    if slow:
        ratio = per_step[MAIN] / per_step["ddp"]
        print(f"target cross_group_bytes: {MAIN} H={args.every} / ddp, bytes the links carried per training step "
              f"{ratio:.4f} (goal <= {BYTES_GOAL:.4f}) {'met' if ratio <= BYTES_GOAL else 'missed'}")
    else:
        print(f"target cross_group_bytes: not measured ({problem}: no links to count on) (goal <= {BYTES_GOAL:.4f}) "
              "missed")
    gap = statistics.median(r["held_out_loss"] for r in rows[MAIN]) / ddp_loss - 1
    slow_gap = f", on the slow link's model {slow_loss[MAIN] / slow_loss['ddp'] - 1:+.2%}" if slow else ""
    worst = max(gap, slow_loss[MAIN] / slow_loss["ddp"] - 1) if slow else gap
    print(f"target final_loss: {MAIN} held-out loss {gap * 100:+.2f}% vs ddp, median of {args.seeds} seed(s)"
          f"{slow_gap} (goal within {LOSS_GOAL * 100:.0f}%) {'met' if worst <= LOSS_GOAL else 'missed'}")
    if slow:
        wall = slow[MAIN]["wall_s"] / slow["ddp"]["wall_s"]  # the N-step runs, start-up included
        print(f"target slow_link_wall: {MAIN} / ddp wall time {wall:.3f} (goal <= {WALL_GOAL}) "
              f"{'met' if wall <= WALL_GOAL else 'missed'}")
    else:
        print(f"target slow_link_wall: not measured ({problem}) (goal <= {WALL_GOAL}) missed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
