"""The RL workload's targets (issue 51), each against its peer in the same run where there is one.

    python benchmarks/rl.py [--only buffer,replace,ratio,preempt,learn] [--quick] [--rllib-seeds N]

1. buffer: inserts + samples per second of the replay buffer, prioritized (alpha 0.6): capacity 50,000 CartPole
   transitions, batches of 64; and capacity 10,000 frames (4x84x84 uint8, Atari's), batches of 32; chunks of 32
   inserted, 4 batches sampled a chunk, priorities updated after each sample, timed once the buffer is full.
   convoy's buffer as one host's actors and learners use it (``ReplayService``, one connection each, the actor in
   another thread, tensors through each connection's shared-memory lane), the same with every tensor on the socket
   (as across hosts), and in the same process (``ReplayBuffer``); peer: RLlib's ``PrioritizedEpisodeReplayBuffer``,
   what its DQN uses by default, in the learner's process as RLlib runs it (the same chunks as
   ``SingleAgentEpisode``s, 1-step). Target: the service through shared memory >= 1x RLlib.
2. replace: ``examples/rl_dqn.toml`` running; an actor SIGKILLed 5 times (3 in ``--quick``): from the kill to the
   buffer holding a transition of its replacement (the buffer's per-process counts, read over the transport).
   RLlib's default for a failed env runner is 60 s (``delay_between_env_runner_restarts_s``) plus its probe,
   quoted, not measured. Target: <= 2 s.
3. ratio: the same job (batches of 64, 128-unit layers, target 4: six actors cover the simulator's cost tripled)
   in ``scale`` mode and in ``throttle`` mode (Reverb's rate limiter), one after the other;
   after 15 s ``step_cost`` triples (``convoy config set``), at 25 s an actor is SIGKILLed, at 35 s the learner is
   SIGSTOPped for 5 s; samples per insert in each 10 s window after the first, the time the throttle held each
   side, and transitions inserted per second over the run. Targets: scale mode within +-10% of the target in every
   window; no process blocked > 5% of its time; throughput >= 1.5x the throttle mode's.

4. learn: ``examples/rl_dqn.toml`` as committed, 5 seeds (1 in ``--quick``), each to a mean return of 475 over 100
   episodes or 150k environment steps; peer: RLlib's DQN with its own tuned CartPole config
   (``scripts/rllib_dqn.py``), ``--rllib-seeds`` seeds. Targets: median steps <= 150k; median wall time to 475
   convoy / RLlib <= 0.5. Seed 0's learning curve is copied to ``results/rl-learning-curve.png``. Not in the
   default sections (5 to 30 min a seed for RLlib): ``--only learn``.
5. preempt: a 2-CPU pool held whole by the job (4 actors, 2 learners); ``convoy preempt --cpus 1.25 --priority 5
   --seconds 5``: the time to the CPUs free, the transitions of the preempted actors the buffer does not hold, and
   the time from the priority job's end to 4 actors and a group of 2 learners running again (3 runs).
   Targets: <= 2 s, 0 lost, <= 5 s.
Exits 0 whether the targets are met or missed.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from convoy.control.token import read_token  # noqa: E402
from convoy.parallel.transport import Credentials, Identity  # noqa: E402
from convoy.worker.role_env import service_secret  # noqa: E402
from convoy.workloads.rl.replay_client import ReplayClient  # noqa: E402
from rl_buffer import bench_buffer  # noqa: E402  (benchmarks/ is this script's directory)
from rl_rllib import bench_learn  # noqa: E402

JOB = REPO / "examples" / "rl_dqn.toml"


def start_job(work: Path, *extra: str) -> subprocess.Popen:
    log = (work / "out.txt").open("w")
    return subprocess.Popen([sys.executable, "-m", "convoy", "run", str(JOB), "--run-dir", str(work / "run"),
                             "--set", "stop_return=0", "--set", "env_steps=100000000", *extra],
                            stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)


def output(work: Path) -> str:
    return (work / "out.txt").read_text(errors="replace")


def wait_for(what: str, check, limit: float = 120.0):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.02)
    raise RuntimeError(f"timed out after {limit:.0f} s waiting for {what}")


def replay_of(work: Path) -> ReplayClient:
    """The job's replay service, reached as the job's owner (the run dir's token)."""
    credentials = Credentials(bytes.fromhex(service_secret(read_token(work / "run" / "token"))),
                              Identity("benchmark", 0, 0))

    def address() -> str:
        found = re.findall(r"replay: serving \d+ transitions at (\S+) ", output(work))
        return found[-1] if found else ""

    return ReplayClient(address, credentials)


def stop_job(job: subprocess.Popen) -> None:
    if job.poll() is None:
        os.killpg(job.pid, signal.SIGINT)
        try:
            job.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()


def actor_pid(work: Path, rank: int, not_pid: int = 0) -> int:
    pids = [int(p) for p in re.findall(rf"actor {rank}: stepping \S+ \(pid (\d+),", output(work))]
    return pids[-1] if pids and pids[-1] != not_pid else 0


def inserting(replay: ReplayClient) -> set[str]:
    """The processes of actor rank 0 (``actor0.<incarnation>``) whose transitions the buffer holds."""
    return {source for source, count in dict(replay.stats()["by_source"]).items()  # type: ignore[call-overload]
            if source.startswith("actor0.") and count}


def bench_replace(quick: bool) -> list[str]:
    kills = 3 if quick else 5
    times: list[float] = []
    with tempfile.TemporaryDirectory(prefix="convoy-rl-bench-") as tmp:
        work = Path(tmp)
        job = start_job(work, "--set", "step_cost=0.002")
        try:
            replay = wait_for("the replay service", lambda: (work / "run" / "token").exists() and replay_of(work))
            wait_for("inserts", lambda: int(replay.stats()["inserted"]) > 500)
            pid = 0
            for _ in range(kills):
                pid = wait_for("actor 0", lambda old=pid: actor_pid(work, 0, old))
                before = inserting(replay)
                os.kill(pid, signal.SIGKILL)
                killed = time.monotonic()
                wait_for("a replacement inserting", lambda seen=before: inserting(replay) - seen, 60)
                times.append(time.monotonic() - killed)
                time.sleep(1.0)
        finally:
            stop_job(job)
    median = statistics.median(times)
    print(f"\n## replace: a SIGKILLed actor replaced and inserting again ({kills} kills)")
    print(f"  convoy: median {median:.2f} s, runs {', '.join(f'{t:.2f}' for t in times)}")
    print("  RLlib (quoted): delay_between_env_runner_restarts_s = 60 s by default, plus its health probe")
    return [f"target killed actor inserting again: {median:.2f} s (goal <= 2 s) {'met' if median <= 2 else 'missed'}"]


def run_ratio(mode: str, quick: bool) -> dict[str, object]:
    length = 50.0 if quick else 70.0
    with tempfile.TemporaryDirectory(prefix=f"convoy-rl-{mode}-") as tmp:
        work = Path(tmp)
        job = start_job(work, "--set", f"mode={mode}", "--set", "step_cost=0.002", "--set", "target_ratio=4",
                        "--set", "batch=64", "--set", "hidden=128")  # as in the first runs: 6 actors cover x3
        points: list[tuple[float, int, int, int]] = []
        try:
            replay = wait_for("the replay service", lambda: (work / "run" / "token").exists() and replay_of(work))
            wait_for("learning to start", lambda: int(replay.stats()["sampled"]) > 0)
            began = time.monotonic()
            events = {15.0: "triple", 25.0: "kill", 35.0: "stop", 40.0: "continue"}
            learner = 0
            while time.monotonic() - began < length:
                now = time.monotonic() - began
                for at in [at for at in events if at <= now]:
                    what = events.pop(at)
                    if what == "triple":
                        subprocess.run([sys.executable, "-m", "convoy", "config", "set", "--run-dir",
                                        str(work / "run"), "step_cost=0.006"], check=True, capture_output=True)
                    elif what == "kill":
                        os.kill(actor_pid(work, 0), signal.SIGKILL)
                    elif what in ("stop", "continue"):
                        learner = learner or learner_pid(work)
                        os.kill(learner, signal.SIGSTOP if what == "stop" else signal.SIGCONT)
                stats = replay.stats()
                points.append((now, int(stats["inserted"]), int(stats["sampled"]), int(stats["staged"])))
                time.sleep(1.0)
            final = replay.stats()
        finally:
            stop_job(job)
    windows = []
    for start in range(10, int(length) - 9, 10):
        inside = [p for p in points if start <= p[0] <= start + 10]
        if len(inside) >= 2 and inside[-1][1] > inside[0][1]:
            windows.append((inside[-1][2] - inside[0][2]) / (inside[-1][1] - inside[0][1]))
    span = points[-1][0] - points[0][0]
    return {"windows": windows, "inserts_per_s": (points[-1][1] - points[0][1]) / span,
            "waited_insert_s": float(final["waited_insert_s"]), "waited_sample_s": float(final["waited_sample_s"]),
            "span": span, "staged": int(final["staged"]),
            "most_staged": max(staged for *_, staged in points)}


def learner_pid(work: Path) -> int:
    found = re.findall(r"learner 0: training \S+ \(pid (\d+)\)", output(work))
    if not found:
        raise RuntimeError("the learner has not said its pid")
    return int(found[-1])


def bench_ratio(quick: bool) -> list[str]:
    scale, throttle = run_ratio("scale", quick), run_ratio("throttle", quick)
    print("\n## ratio: samples per insert in each 10 s window after the first (target 4), step_cost x3 at 15 s, an "
          "actor SIGKILLed at 25 s, the learner SIGSTOPped 35-40 s")
    for name, run in (("scale", scale), ("throttle", throttle)):
        windows = ", ".join(f"{w:.2f}" for w in run["windows"])  # type: ignore[attr-defined]
        print(f"  {name:<9} windows [{windows}]; {run['inserts_per_s']:.0f} inserts/s; the throttle held inserts "
              f"{run['waited_insert_s']:.1f} s and samples {run['waited_sample_s']:.1f} s of {run['span']:.0f} s; "
              f"staged at most {run['most_staged']} transitions")
    windows: list[float] = scale["windows"]  # type: ignore[assignment]
    worst = max(abs(w / 4 - 1) for w in windows) if windows else float("inf")
    held = max(float(scale["waited_insert_s"]), float(scale["waited_sample_s"]))  # type: ignore[arg-type]
    blocked = held / float(scale["span"])  # type: ignore[arg-type]
    gain = float(scale["inserts_per_s"]) / max(float(throttle["inserts_per_s"]), 1e-9)  # type: ignore[arg-type]
    return [f"target samples per insert within 10% in every window (scale mode): worst {worst * 100:.0f}% off "
            f"(goal <= 10%) {'met' if worst <= 0.1 else 'missed'}",
            f"target blocked time (scale mode): {blocked * 100:.1f}% (goal <= 5%) "
            f"{'met' if blocked <= 0.05 else 'missed'}",
            f"target throughput scale / throttle: {gain:.2f}x (goal >= 1.5x) {'met' if gain >= 1.5 else 'missed'}"]


def preempt_once(work: Path) -> dict[str, float]:
    """A job of priority 5 asks for 1.25 CPUs of a 2-CPU pool that the RL job holds whole (4 actors at 0.25, 2
    learners at 0.5: the example's job file with the learners' CPUs added): 3 actors and a learner are given back;
    timed from the ask to the CPUs free, and from the priority job's end to the RL job running 4 actors and a
    group of 2 learners again."""
    env = {**os.environ, "CONVOY_POOL": str(work / "pool.db"), "CONVOY_POOL_CPUS": "2"}
    convoy = [sys.executable, "-m", "convoy"]
    log = (work / "out.txt").open("w")
    text = JOB.read_text().replace('entrypoint = "rl_dqn.py"', f'entrypoint = "{JOB.parent / "rl_dqn.py"}"')
    (work / "rl_cpus.toml").write_text(text.replace("[roles.learner]\n", "[roles.learner]\ncpus = 0.5\n"))
    job = subprocess.Popen([*convoy, "run", str(work / "rl_cpus.toml"), "--run-dir", str(work / "run"),
                            "--set", "stop_return=0",
                            "--set", "env_steps=100000000", "--set", "mode=none", "--set", "step_cost=0.002",
                            "--set", "snapshot_every_s=2"], stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                           start_new_session=True)
    try:
        wait_for("the job", lambda: "controller: 16 slices dealt to 1 actor(s)" in output(work), 120)
        subprocess.run([*convoy, "scale", "--run-dir", str(work / "run"), "actor=4", "learner=2"], check=True,
                       env=env, capture_output=True)
        wait_for("4 actors and 2 learners", lambda: "dealt to 4 actor(s)" in output(work) and re.search(
            r"learner 1: training \S+ \(pid \d+\), world size 2", output(work)), 120)
        time.sleep(3.0)
        asked = subprocess.run([*convoy, "preempt", "--cpus", "1.25", "--priority", "5", "--seconds", "5"],
                               env=env, capture_output=True, text=True, timeout=120)
        ended, mark = time.monotonic(), len(output(work))
        free = re.search(r"free after ([\d.]+) s", asked.stdout)
        if asked.returncode != 0 or free is None:
            raise RuntimeError(f"convoy preempt failed: {asked.stdout}{asked.stderr}")

        def back() -> bool:
            later = output(work)[mark:]
            return len(set(re.findall(r"actor ([123]): stepping", later))) == 3 and bool(
                re.search(r"learner 0: training \S+ \(pid \d+\), world size 2", later))

        try:
            wait_for("the job back at its count", back, 60)
        except RuntimeError:
            print(output(work)[-6000:])
            raise
        regrown = time.monotonic() - ended
        replay = replay_of(work)
        by_source = dict(replay.stats()["by_source"])  # type: ignore[call-overload]
        replay.close()
    finally:
        stop_job(job)
    text = output(work)
    lost = 0
    cut = r"actor (\d): preempted: episode cut at step \d+; (\d+) transitions inserted"
    for found in re.finditer(cut, text):
        rank, inserted = found.groups()
        started = re.findall(rf"actor {rank}: stepping \S+ \(pid \d+, incarnation (\d+)\)", text[:found.start()])
        held = int(by_source.get(f"actor{rank}.{started[-1]}", 0))  # the process that was preempted
        lost += max(0, int(inserted) - held)
    return {"free": float(free.group(1)), "back": regrown, "lost": float(lost)}


def bench_preempt(quick: bool) -> list[str]:
    runs = []
    for _ in range(1 if quick else 3):
        with tempfile.TemporaryDirectory(prefix="convoy-rl-preempt-") as tmp:
            runs.append(preempt_once(Path(tmp)))
    free = statistics.median(run["free"] for run in runs)
    back = statistics.median(run["back"] for run in runs)
    lost = sum(run["lost"] for run in runs)
    print(f"\n## preempt: a priority job asks for 1.25 of 2 CPUs held by the RL job ({len(runs)} runs)")
    frees = ", ".join(f"{run['free']:.2f}" for run in runs)
    backs = ", ".join(f"{run['back']:.2f}" for run in runs)
    print(f"  CPUs free after: {frees} s; back at 4 actors and 2 learners after the priority job ended: {backs} s; "
          f"transitions lost {lost:.0f}")
    return [f"target preemption frees the CPUs: {free:.2f} s (goal <= 2 s) {'met' if free <= 2 else 'missed'}",
            f"target transitions lost to a preemption: {lost:.0f} (goal 0) {'met' if lost == 0 else 'missed'}",
            f"target back at its count after the priority job: {back:.2f} s (goal <= 5 s) "
            f"{'met' if back <= 5 else 'missed'}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="buffer,replace,ratio,preempt")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rllib-seeds", type=int, default=5, help="seeds of RLlib's DQN in the learn section "
                                                                   "(5 to 30 min each here)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    targets: list[str] = []
    parts = {"buffer": bench_buffer, "replace": bench_replace, "ratio": bench_ratio,
             "preempt": bench_preempt, "learn": lambda quick: bench_learn(quick, args.rllib_seeds)}
    for name in args.only.split(","):
        targets += parts[name](args.quick)
    print()
    for line in targets:
        print(line)


if __name__ == "__main__":
    main()
