"""convoy on a Ray cluster (``--scheduler ray``, issue 50) against Ray Train's TorchTrainer on the same cluster.

    python benchmarks/ray_scheduler.py [--runs N] [--quick]

The cluster: a real one on this machine (``convoy.testing.ray_cluster``): a head with 1 CPU, and 3 raylets of 1 CPU
and one ``convoy_node`` each, where both systems place their 3 ranks (one per node). The training: the same small
DDP loop (``scripts/ray_ddp.py``), 50 ms of "data loading" per step. convoy: ``--nnodes 2:3``, in-memory snapshots;
Ray Train: ``ScalingConfig(num_workers=(2, 3))`` (elastic), a checkpoint to local disk after every step,
``FailureConfig(max_failures=1)``. The systems alternate, ``--runs`` trials each (3; ``--quick`` 1). In a trial:

1. Start: from the launch of ``convoy run`` / the Ray Train driver to the first finished step.
2. A node lost: once all 3 ranks train, the raylet of the last node is SIGKILLed; from the kill to the first step
   that every rank of the next round finished, and the finished steps lost (done again in a later round).
3. A node joins: a new raylet is started; from it being up to the first step finished by 3 ranks (Ray Train: as
   it grows, if it grows within 90 s).

Then an infeasible request (each rank asks for a GPU; the cluster has none): the time until the job fails with an
error (Ray Train: until it fails, or 60 s). Targets: loss recovery convoy / Ray Train <= 0.3 with 0 steps lost;
growth <= 5 s; start convoy / Ray Train <= 0.8; infeasible error <= 10 s. Exits 0 whether they are met or not.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks" / "scripts")]

from steplog import StepLog, steps_lost  # noqa: E402

from convoy.testing.ray_cluster import LocalRayCluster, RayNodeProcess  # noqa: E402

SCRIPT = str(REPO / "benchmarks" / "scripts" / "ray_ddp.py")
NODE = {"convoy_node": 1}
PHASE_LIMIT_S = 120.0
GROW_LIMIT_S = 90.0
INFEASIBLE_LIMIT_S = 60.0


def command(system: str, address: str, work: Path, gpu: bool = False) -> list[str]:
    out = ["--out", str(work / "out")]
    if system == "convoy":
        return [sys.executable, "-m", "convoy", "run", "--scheduler", "ray", "--address", address, "--ray-resource",
                "convoy_node=1", "--nnodes", "2:3", "--run-dir", str(work / "run"), "--stop-grace", "2",
                *(["--ray-gpus", "1"] if gpu else []), SCRIPT, *out]
    return [sys.executable, SCRIPT, "--ray", address, "--storage", str(work / "storage"), *out,
            *(["--gpu"] if gpu else [])]


def wait_until(log: StepLog, process: subprocess.Popen, check, limit: float, what: str):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        log.poll()
        found = check()
        if found is not None:
            return found
        if process.poll() is not None:
            raise RuntimeError(f"{what}: the job ended (exit {process.returncode})")
        time.sleep(0.02)
    return None


def rounds(log: StepLog, since: float = 0.0) -> dict[int, set[int]]:
    found: dict[int, set[int]] = {}
    for step in log.steps:
        if step.t > since:
            found.setdefault(step.round_id, set()).add(step.rank)
    return found


def trial(system: str, cluster: LocalRayCluster, nodes: list[RayNodeProcess]) -> dict[str, float | None]:
    work = Path(tempfile.mkdtemp(prefix=f"raybench-{system}-"))
    log = StepLog(work / "out")
    (work / "out").mkdir()
    launched = time.time()
    process = subprocess.Popen(command(system, cluster.address, work), stdout=open(work / "stdout", "wb"),
                               stderr=subprocess.STDOUT, start_new_session=True, env=cluster.env)
    result: dict[str, float | None] = {}
    try:
        first = wait_until(log, process, lambda: log.steps[0].t if log.steps else None, PHASE_LIMIT_S, "start")
        result["start_s"] = None if first is None else first - launched
        three = wait_until(log, process, lambda: next((r for r, ranks in rounds(log).items() if len(ranks) == 3
                                                       and log.last_step() >= 30), None), PHASE_LIMIT_S, "3 ranks")
        if three is None:
            raise RuntimeError("never trained on 3 nodes")
        killed = time.time()
        nodes[-1].kill()
        again = wait_until(log, process, lambda: log.first_per_rank(
            lambda s: s.t > killed and s.round_id != three, 2), PHASE_LIMIT_S, "after the kill")
        result["recover_s"] = None if again is None else again - killed
        result["lost"] = float(steps_lost(log.steps))
        nodes[-1] = cluster.add_node(1, NODE)
        joined = time.time()
        grown = wait_until(log, process, lambda: log.first_per_rank(
            lambda s: s.t > joined and len(rounds(log, joined).get(s.round_id, ())) == 3, 3), GROW_LIMIT_S, "growth")
        result["grow_s"] = None if grown is None else grown - joined
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        print(f"  {system}: " + ", ".join(f"{k} {'-' if v is None else f'{v:.3f}'}" for k, v in result.items())
              + f"   (output: {work / 'stdout'})", flush=True)
    return result


def infeasible(system: str, cluster: LocalRayCluster) -> float | None:
    work = Path(tempfile.mkdtemp(prefix=f"raybench-{system}-gpu-"))
    began = time.time()
    process = subprocess.Popen(command(system, cluster.address, work, gpu=True), stdout=open(work / "stdout", "wb"),
                               stderr=subprocess.STDOUT, start_new_session=True, env=cluster.env)
    try:
        process.wait(INFEASIBLE_LIMIT_S)
        took = time.time() - began
        tail = (work / "stdout").read_text(errors="replace").strip().splitlines()[-1:]
        print(f"  {system}: failed after {took:.1f} s (exit {process.returncode}): {tail[0] if tail else ''}"[:300])
        return took if process.returncode != 0 else None
    except subprocess.TimeoutExpired:
        print(f"  {system}: no error in {INFEASIBLE_LIMIT_S:.0f} s (still waiting for a GPU)")
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
        return None


def median(values: list[float | None]) -> float | None:
    known = [value for value in values if value is not None]
    return statistics.median(known) if len(known) == len(values) and known else None


def say(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    runs = 1 if args.quick else args.runs
    try:
        import ray.train  # noqa: F401
    except ImportError:
        sys.exit("Ray Train is the peer: pip install 'ray[train]' (convoy's own tests need only 'convoy[ray]')")
    results: dict[str, list[dict[str, float | None]]] = {"convoy": [], "ray": []}
    with LocalRayCluster(head_cpus=1) as cluster:
        nodes = [cluster.add_node(1, NODE) for _ in range(3)]
        for index in range(runs):
            for system in ("convoy", "ray") if index % 2 == 0 else ("ray", "convoy"):
                print(f"trial {index + 1}, {system}", flush=True)
                results[system].append(trial(system, cluster, nodes))
        print("infeasible request (a GPU per node, the cluster has none)", flush=True)
        errors = {system: infeasible(system, cluster) for system in ("convoy", "ray")}
    table = {system: {key: median([run.get(key) for run in runs_]) for key in ("start_s", "recover_s", "lost",
                                                                                 "grow_s")}
             for system, runs_ in results.items()}
    print(f"\nmedians of {runs} trial(s)        convoy     Ray Train   ratio")
    for key, label in (("start_s", "start to first step (s)"), ("recover_s", "node lost -> training (s)"),
                       ("lost", "finished steps lost"), ("grow_s", "node joins -> 3 ranks (s)")):
        ours, theirs = table["convoy"][key], table["ray"][key]
        ratio = f"{ours / theirs:.2f}" if ours is not None and theirs else "-"
        print(f"  {label:28} {say(ours):>9} {say(theirs):>11} {ratio:>7}")
    print(f"  {'infeasible -> error (s)':28} {say(errors['convoy']):>9} {say(errors['ray']):>11}")
    print()
    ours, theirs = table["convoy"], table["ray"]
    checks = [
        ("node lost: convoy / Ray Train <= 0.3, 0 steps lost", ours["recover_s"] is not None and bool(theirs[
            "recover_s"]) and ours["recover_s"] / theirs["recover_s"] <= 0.3 and ours["lost"] == 0),
        ("node joins: training on it <= 5 s", ours["grow_s"] is not None and ours["grow_s"] <= 5.0),
        ("start: convoy / Ray Train <= 0.8", ours["start_s"] is not None and bool(theirs["start_s"])
         and ours["start_s"] / theirs["start_s"] <= 0.8),
        ("infeasible request: an error <= 10 s", errors["convoy"] is not None and errors["convoy"] <= 10.0),
    ]
    for name, met in checks:
        print(f"target {name}: {'met' if met else 'missed'}")
    shutil.rmtree(Path(tempfile.gettempdir()) / "ray_ddp", ignore_errors=True)


if __name__ == "__main__":
    main()
