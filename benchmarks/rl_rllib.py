"""RLlib's side of ``benchmarks/rl.py`` (issue 51): its replay buffer timed as its DQN uses it (the buffer section's
peer), and the learn section, ``examples/rl_dqn.toml`` as committed against RLlib's DQN with its own tuned CartPole
config (``scripts/rllib_dqn.py``), seed by seed, to a mean return of 475 over 100 episodes or 150k environment
steps. Run through ``python benchmarks/rl.py``."""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "examples" / "rl_dqn.toml"
CAPACITY, CHUNK, BATCH, SAMPLES_PER_CHUNK = 50_000, 32, 64, 4


def time_rllib(rounds: int, obs: tuple[int, ...] = (4,), frames: bool = False, capacity: int = CAPACITY,
               batch: int = BATCH) -> float | str:
    """RLlib's prioritized episode buffer, what its DQN uses by default, at the same chunks and batches; ``frames``:
    uint8 observations."""
    try:
        import numpy
        from ray.rllib.env.single_agent_episode import SingleAgentEpisode
        from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import PrioritizedEpisodeReplayBuffer
    except Exception as exc:  # noqa: BLE001 (any import failure: the peer is not measured, said so)
        return f"not measured: ray.rllib does not import here ({type(exc).__name__}: {exc})"

    def episode() -> SingleAgentEpisode:
        if frames:
            seen = numpy.random.randint(0, 256, (CHUNK + 1, *obs), dtype=numpy.uint8)
        else:
            seen = numpy.random.randn(CHUNK + 1, *obs).astype(numpy.float32)
        made = SingleAgentEpisode(observations=list(seen), actions=list(numpy.random.randint(0, 2, CHUNK)),
                                  rewards=[1.0] * CHUNK, len_lookback_buffer=0)
        return made.to_numpy()

    buffer = PrioritizedEpisodeReplayBuffer(capacity=capacity, alpha=0.6)
    for _ in range(capacity // CHUNK + 1):
        buffer.add([episode()])
    chunks = [episode() for _ in range(rounds)]  # each its own episode: one added again would continue it
    began, done = time.perf_counter(), 0
    for i in range(rounds):
        buffer.add([chunks[i % len(chunks)]])
        done += CHUNK
        for _ in range(SAMPLES_PER_CHUNK):
            buffer.sample(num_items=batch, n_step=1, beta=0.4)
            buffer.update_priorities(numpy.random.rand(batch))
            done += batch
    return done / (time.perf_counter() - began)


def output(work: Path) -> str:
    return (work / "out.txt").read_text(errors="replace")


LEARN_GOAL, LEARN_STEPS = 475.0, 150_000


def convoy_learns(seed: int, extra: list[str]) -> dict[str, object]:
    """One seed of ``examples/rl_dqn.toml`` as committed (it ends once the last 100 episodes average 475): the env
    steps and wall time (launch to exit) it took, or that it did not get there in 150k steps."""
    with tempfile.TemporaryDirectory(prefix="convoy-rl-learn-") as tmp:
        work = Path(tmp)
        began = time.monotonic()
        log = (work / "out.txt").open("w")
        job = subprocess.run([sys.executable, "-m", "convoy", "run", str(JOB), "--run-dir", str(work / "run"),
                              "--set", f"seed={seed}", "--set", f"env_steps={LEARN_STEPS}", *extra],
                             stdout=log, stderr=subprocess.STDOUT, cwd=REPO, timeout=3600)
        wall = time.monotonic() - began
        text = output(work)
        final = re.search(r"final: mean return ([\d.]+) over the last \d+ episodes after (\d+) environment steps", text)
        if job.returncode != 0 or final is None:
            raise RuntimeError(f"the DQN job failed (exit {job.returncode}):\n{text[-3000:]}")
        curve = REPO / "benchmarks" / "results" / "rl-learning-curve.png"
        if seed == 0:
            curve.write_bytes((work / "run" / "learning-curve.png").read_bytes())
        mean, steps = float(final.group(1)), int(final.group(2))
        return {"reached": mean >= LEARN_GOAL, "steps": steps, "wall": wall, "mean": mean}


def rllib_learns(seed: int) -> dict[str, object]:
    """One seed of RLlib's DQN with its tuned CartPole config (``scripts/rllib_dqn.py``), to 475 or 150k steps."""
    script = REPO / "benchmarks" / "scripts" / "rllib_dqn.py"
    done = subprocess.run([sys.executable, str(script), "--seed", str(seed), "--reward", str(LEARN_GOAL),
                           "--max-steps", str(LEARN_STEPS)], capture_output=True, text=True, timeout=7200)
    reached = re.search(r"rllib: reached ([\d.]+) at (\d+) steps in ([\d.]+) s", done.stdout)
    if reached:
        return {"reached": True, "steps": int(reached.group(2)), "wall": float(reached.group(3)),
                "mean": float(reached.group(1))}
    missed = re.search(r"rllib: not reached by (\d+) steps \(([\d.]+) s\)", done.stdout)
    if missed is None:
        raise RuntimeError(f"RLlib's DQN did not run (exit {done.returncode}):\n{done.stdout[-2000:]}"
                           f"{done.stderr[-3000:]}")
    last = re.findall(r"rllib: steps \d+ return ([\d.na]+)", done.stdout)
    return {"reached": False, "steps": int(missed.group(1)), "wall": float(missed.group(2)),
            "mean": float(last[-1]) if last else float("nan")}


def describe_runs(name: str, runs: list[dict[str, object]]) -> None:
    for seed, run in enumerate(runs):
        how = "reached 475" if run["reached"] else f"not reached (mean {run['mean']:.1f})"
        print(f"  {name:<7} seed {seed}: {how} at {run['steps']} env steps, {run['wall']:.0f} s")


def bench_learn(quick: bool, rllib_seeds: int) -> list[str]:
    seeds = 1 if quick else 5
    print(f"\n## learn: DQN on CartPole-v1 to a mean return of 475 over 100 episodes, at most 150k env steps "
          f"({seeds} seeds; RLlib {rllib_seeds})")
    ours = [convoy_learns(seed, []) for seed in range(seeds)]
    describe_runs("convoy", ours)
    theirs = [rllib_learns(seed) for seed in range(rllib_seeds)]
    describe_runs("RLlib", theirs)
    steps = statistics.median(float(run["steps"]) if run["reached"] else float("inf") for run in ours)
    wall = statistics.median(float(run["wall"]) if run["reached"] else float("inf") for run in ours)
    lines = [f"target DQN reaches 475 in <= 150k steps (median of {seeds}): "
             + (f"{steps:.0f} steps (goal <= 150000) {'met' if steps <= LEARN_STEPS else 'missed'}"
                if steps < float("inf") else "not reached by the median seed (goal <= 150000) missed")]
    if theirs:
        peer = statistics.median(float(run["wall"]) if run["reached"] else float("inf") for run in theirs)
        if peer < float("inf"):
            ratio = wall / peer
            lines.append(f"target wall time to 475, convoy / RLlib: {wall:.0f} s / {peer:.0f} s = {ratio:.2f} "
                         f"(goal <= 0.5) {'met' if ratio <= 0.5 else 'missed'}")
        else:
            spent = statistics.median(float(run["wall"]) for run in theirs)
            lines.append(f"target wall time to 475, convoy / RLlib: RLlib did not reach 475 in 150k steps ({spent:.0f} "
                         f"s, median); convoy {wall:.0f} s: ratio below {wall / spent:.2f} (goal <= 0.5) "
                         f"{'met' if wall / spent <= 0.5 else 'missed'}")
    return lines
