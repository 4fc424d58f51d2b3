"""Benchmark: convoy.Checkpointer's saves and restore against a plain torch.save / torch.load.

    python benchmarks/checkpoint.py [--quick] [--tmp DIR]

A stack of ``Linear(1024, 1024)`` layers (~100 MB of float32 parameters, ~300 MB with Adam's
state; ``--quick``: a quarter) trains on random batches in this process, in alternating blocks
without and with a checkpointer, with a plain ``torch.save`` of the same state to the same disk
after each pair (the peer). Every number is a median over repetitions. What "blocks the loop":

- a save: the time inside ``ckpt.step()`` plus what the next ``optimizer.step()`` waits for in the
  Checkpointer's pre-step hook (timed by hooks registered before and after it), for in-memory
  snapshots and for persistent (DCP) saves; the background write is timed until ``step-N`` is sealed,
  and the next save starts only after that (an untimed wait), so each save is measured on its own;
- a restore: a worker training with snapshots is SIGKILLed; fresh processes time ``restore()`` plus
  the first ``optimizer.step()``'s wait, and ``torch.load`` + ``load_state_dict`` of the peer file.

CPU-time rows tell work from waiting for a core: on a busy 2-core machine the wall times swing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

import convoy
from convoy.runtime.persist import step_dir
from convoy.shm import remove_segments

SCRIPTS = Path(__file__).resolve().parent / "scripts"
WORKER = SCRIPTS / "ckpt_worker.py"
sys.path.insert(0, str(SCRIPTS))
from ckpt_worker import build, forward_backward  # noqa: E402

JOB_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
           "MASTER_ADDR", "MASTER_PORT", "CONVOY_JOB_ID", "CONVOY_NODE_ID", "CONVOY_RUN_DIR", "CONVOY_ROUND")


@dataclass(frozen=True)
class Sizes:
    """How big and how long: the model, the timed blocks, the saves and the restores."""

    name: str
    layers: int
    width: int = 1024
    batch: int = 32
    reps: int = 5  # blocks without and with snapshots, each followed by one peer save
    block: int = 6  # steps per block; the first of each is not timed
    persist_every: int = 8
    persist_saves: int = 4  # the first is a warm-up, reported on its own
    restores: int = 5  # fresh restore processes, and as many torch.load processes


FULL = Sizes("full", layers=24)
QUICK = Sizes("quick", layers=6, reps=3, block=4, persist_every=4, persist_saves=3, restores=2)


class Step(NamedTuple):
    total: float  # the whole step, checkpointer included
    in_ckpt: float  # inside ckpt.step()
    in_ckpt_cpu: float  # CPU time of this thread inside ckpt.step() (the rest: waiting, e.g. for a core)
    wait: float  # inside optimizer.step(), in the Checkpointers' pre-step hooks (waiting for copies)
    ckpt_start: float  # perf_counter() when ckpt.step() was called


class Trainer:
    """The model and its optimizer; what optimizer.step() waits for in Checkpointer hooks is timed."""

    def __init__(self, sizes: Sizes) -> None:
        self.sizes = sizes
        self.model, self.optimizer = build(sizes.layers, sizes.width)
        self.generator = torch.Generator().manual_seed(1)
        self._mark = 0.0
        self._wait = 0.0
        self.optimizer.register_step_pre_hook(self._before)  # runs before every Checkpointer's hook ...

    def attach(self, job_id: str | None, **options: Any) -> convoy.Checkpointer:
        """A Checkpointer on this model (``job_id``: with in-memory snapshots in that job's segment)."""
        if job_id:
            os.environ["CONVOY_JOB_ID"] = job_id
        try:
            ckpt = convoy.Checkpointer(self.model, self.optimizer, **options)
        finally:
            os.environ.pop("CONVOY_JOB_ID", None)
        self.optimizer.register_step_pre_hook(self._after)  # ... and this one after all of them
        return ckpt

    def _before(self, *args: Any) -> None:
        self._mark = time.perf_counter()

    def _after(self, *args: Any) -> None:
        self._wait = time.perf_counter() - self._mark

    def step(self, ckpt: convoy.Checkpointer | None, step: int) -> Step:
        started = time.perf_counter()
        forward_backward(self.model, self.optimizer, self.sizes.batch, self.generator)
        self.optimizer.step()
        stepped, cpu = time.perf_counter(), time.thread_time()
        if ckpt is not None:
            ckpt.step(step)
        done = time.perf_counter()
        return Step(done - started, done - stepped, time.thread_time() - cpu, self._wait, stepped)

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}


def peer_save(trainer: Trainer, path: Path, fsync: bool) -> float:
    """Seconds for a plain synchronous torch.save of the same state (optionally fsynced)."""
    started = time.perf_counter()
    with open(path, "wb") as handle:
        torch.save(trainer.state(), handle)
        if fsync:
            handle.flush()
            os.fsync(handle.fileno())
    return time.perf_counter() - started


def measure_snapshots(trainer: Trainer, job_id: str, root: Path, peer_file: Path,
                      samples: dict[str, list[float]]) -> None:
    """Alternate blocks without and with in-memory snapshots; a peer torch.save after each pair."""
    sizes, ckpt = trainer.sizes, trainer.attach(job_id, directory=root / "unused")
    for _ in range(2):
        trainer.step(None, 0)  # Adam's state exists after the first step
    first = [trainer.step(ckpt, step) for step in range(3)]  # the first one allocates the segment
    samples["first_save"] = [first[0].in_ckpt + first[1].wait]
    ckpt.close()
    step = 3
    for _ in range(sizes.reps):
        samples["base_step"] += [trainer.step(None, 0).total for _ in range(sizes.block)][1:]
        timed = [trainer.step(ckpt, step + k) for k in range(sizes.block)]
        step += sizes.block
        started = time.perf_counter()
        ckpt.close()  # right after the last ckpt.step(): the whole copy, overlapping nothing
        samples["copy_alone"].append(time.perf_counter() - started)
        samples["snap_step"] += [s.total for s in timed[1:]]
        samples["snap_in_ckpt"] += [s.in_ckpt for s in timed[:-1]]  # the saves whose next step is timed
        samples["snap_in_ckpt_cpu"] += [s.in_ckpt_cpu for s in timed[:-1]]
        samples["snap_wait"] += [s.wait for s in timed[1:]]
        samples["snap_blocking"] += [timed[k].in_ckpt + timed[k + 1].wait for k in range(sizes.block - 1)]
        samples["torch_save"].append(peer_save(trainer, peer_file, fsync=False))
        samples["torch_save_fsync"].append(peer_save(trainer, peer_file, fsync=True))
    samples["torch_save"].append(peer_save(trainer, peer_file, fsync=False))  # leaves the file for `load`


def _watch(path: Path, started: float, found: list[float], stop: threading.Event) -> None:
    """Record when a persistent save's sealed directory appears (seconds after ``started``)."""
    while not stop.is_set():
        if path.exists():
            found.append(time.perf_counter() - started)
            return
        time.sleep(0.01)


def measure_persistent(trainer: Trainer, root: Path, samples: dict[str, list[float]]) -> None:
    """Train with ``persist_every`` async DCP saves: time ckpt.step and the next optimizer.step's wait
    at each save, the whole ``persist_every`` steps from each save on, and when the save is sealed."""
    sizes, directory, every = trainer.sizes, root / "checkpoints", trainer.sizes.persist_every
    ckpt = trainer.attach(None, persist_every=every, directory=directory,
                          log=lambda message: print(f"  [convoy] {message}", flush=True))
    stop, watchers, sealed, timed = threading.Event(), [], [], []
    for step in range(every * (sizes.persist_saves + 1) - 1):  # saves at every-1, 2*every-1, ...
        if (step + 1) % every == 0 and watchers:  # untimed: each save starts once the one before is sealed
            idle = time.perf_counter()
            watchers[-1].join(timeout=300)
            samples["persist_idle"].append(time.perf_counter() - idle)
        timed.append(trainer.step(ckpt, step))
        if (step + 1) % every == 0:
            found: list[float] = []
            sealed.append(found)
            path = step_dir(directory, step)
            watchers.append(threading.Thread(target=_watch, args=(path, timed[-1].ckpt_start, found, stop)))
            watchers[-1].start()
    for save in range(every - 1, len(timed), every):
        prefix = "persist_first_" if save == every - 1 else "persist_"  # the first save is a warm-up
        samples[prefix + "blocking"].append(timed[save].in_ckpt + timed[save + 1].wait)
        samples[prefix + "in_ckpt"].append(timed[save].in_ckpt)
        samples[prefix + "in_ckpt_cpu"].append(timed[save].in_ckpt_cpu)
        samples[prefix + "wait"].append(timed[save + 1].wait)
        samples[prefix + "period"].append(sum(t.total for t in timed[save : save + every]))
    ckpt.close()
    time.sleep(0.05)
    stop.set()
    for watcher in watchers:
        watcher.join()
    seconds = [found[0] if found else float("nan") for found in sealed]  # nan: never sealed
    samples["persist_first_sealed"], samples["persist_sealed"] = seconds[:1], seconds[1:]


def child_env(job_id: str | None) -> dict[str, str]:
    """This environment without the job variables (a child starts its own one-process group)."""
    env = {key: value for key, value in os.environ.items() if key not in JOB_ENV}
    if job_id:
        env["CONVOY_JOB_ID"] = job_id
    return env


def start_worker(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(WORKER), *args], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def await_line(proc: subprocess.Popen[str], prefix: str) -> str:
    """The first line of the worker's output that starts with ``prefix``; fails if it exits first."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(prefix):
            return line
    proc.wait()
    raise RuntimeError(f"ckpt_worker.py exited ({proc.returncode}) before '{prefix}':\n{proc.stderr.read()[-3000:]}")


def finish_worker(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """Let a ready worker measure; return the JSON it prints."""
    output, errors = proc.communicate("go\n", timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"ckpt_worker.py failed ({proc.returncode}):\n{errors[-3000:]}")
    return json.loads(output.strip().splitlines()[-1])


def measure_restore(sizes: Sizes, job_id: str, root: Path, peer_file: Path, samples: dict[str, list[float]]) -> str:
    """SIGKILL a worker that trains with snapshots, then time restores and torch.loads in fresh processes
    (started together with it, each measuring alone when its turn comes)."""
    model_args = ["--layers", str(sizes.layers), "--width", str(sizes.width), "--batch", str(sizes.batch)]
    ckpt_dir = ["--dir", str(root / "restore-checkpoints")]
    train = start_worker(["train", *model_args, *ckpt_dir], child_env(job_id))
    pairs = [(start_worker(["restore", *model_args, *ckpt_dir], child_env(job_id)),
              start_worker(["load", *model_args, "--file", str(peer_file)], child_env(None)))
             for _ in range(sizes.restores)]
    everyone = [train, *(proc for pair in pairs for proc in pair)]
    watchdog = threading.Timer(1200, lambda: [proc.kill() for proc in everyone])
    watchdog.start()
    try:
        last = -1
        while last < 3:  # both slots written at least once, so the kill hits the steady state
            last = int(await_line(train, "done ").split()[1])
        os.kill(train.pid, signal.SIGKILL)
        train.wait()
        for proc in everyone[1:]:
            await_line(proc, "ready")
        resumed = []
        for restorer, loader in pairs:
            restored = finish_worker(restorer)
            if not restored["from"].startswith("in-memory") or restored["optimizer_tensors"] == 0:
                raise RuntimeError(f"restore did not come from the snapshot: {restored}")
            samples["restore"].append(restored["restore_s"] + restored["first_wait_s"])
            samples["restore_call"].append(restored["restore_s"])
            samples["restore_cpu"].append(restored["restore_cpu_s"])
            samples["restore_wait"].append(restored["first_wait_s"])
            samples["restore_construct"].append(restored["construct_s"])
            resumed.append(restored["start"])
            loaded = finish_worker(loader)
            samples["torch_load"].append(loaded["load_s"])
            samples["torch_load_apply"].append(loaded["load_s"] + loaded["apply_s"])
    finally:
        watchdog.cancel()
        for proc in everyone:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
    return (f"the worker was SIGKILLed after it reported step {last} finished; the restores resumed at step "
            f"{', '.join(map(str, sorted(set(resumed))))} (newest complete snapshot + 1)")


def med(values: list[float]) -> float:
    return statistics.median(values)


def fmt(seconds: float) -> str:
    if seconds != seconds:
        return "n/a"
    return f"{seconds * 1000:.1f} ms" if abs(seconds) < 1 else f"{seconds:.2f} s"


def pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%"


def report(sizes: Sizes, trainer: Trainer, samples: dict[str, list[float]], restore_note: str, disk: Path) -> None:
    """Print the table (convoy beside the peer, medians) and one line per target."""
    s = {key: med(values) for key, values in samples.items() if values}
    params = sum(p.numel() for p in trainer.model.parameters())
    state_mb = sum(t.numel() * t.element_size() for v in trainer.optimizer.state.values() for t in v.values()
                   if isinstance(t, torch.Tensor)) / 1e6 + params * 4 / 1e6
    print(f"\nconvoy checkpoint benchmark ({sizes.name}): {sizes.layers} x Linear({sizes.width}, {sizes.width}) = "
          f"{params / 1e6:.1f}M params ({params * 4 / 1e6:.0f} MB), with Adam state {state_mb:.0f} MB; "
          f"batch {sizes.batch}, {torch.get_num_threads()} torch threads")
    print(f"medians of {sizes.reps} blocks x {sizes.block - 1} timed steps, {sizes.persist_saves - 1} persistent saves "
          f"after a warm-up one, {sizes.restores} restores; peer: torch.save / torch.load, same state, {disk}\n")
    save, base, every = s["torch_save"], s["base_step"], sizes.persist_every
    rows = [
        ("training step without checkpoints", fmt(base), "", ""),
        ("in-memory save: blocks the loop", fmt(s["snap_blocking"]), f"torch.save {fmt(save)}",
         pct(s["snap_blocking"], save)),
        ("  inside ckpt.step()", fmt(s["snap_in_ckpt"]), "", ""),
        ("    of which CPU time of this thread", fmt(s["snap_in_ckpt_cpu"]), "", ""),
        ("  waiting in the next optimizer.step()", fmt(s["snap_wait"]), "", ""),
        ("  step time with - without snapshots", fmt(s["snap_step"] - base), f"step {fmt(base)}",
         pct(s["snap_step"] - base, base)),
        ("  background copy alone (close() at once)", fmt(s["copy_alone"]), "", pct(s["copy_alone"], save)),
        ("  first save (allocates the segment)", fmt(s["first_save"]), "", pct(s["first_save"], save)),
        ("persistent save: blocks the loop", fmt(s["persist_blocking"]), f"torch.save {fmt(save)}",
         pct(s["persist_blocking"], save)),
        ("  against torch.save + fsync", "", f"+fsync {fmt(s['torch_save_fsync'])}",
         pct(s["persist_blocking"], s["torch_save_fsync"])),
        ("  inside ckpt.step()", fmt(s["persist_in_ckpt"]), "", ""),
        ("    of which CPU time of this thread", fmt(s["persist_in_ckpt_cpu"]), "", ""),
        ("  waiting in the next optimizer.step()", fmt(s["persist_wait"]), "", ""),
        ("  first save (warm-up): blocks the loop", fmt(s["persist_first_blocking"]), "",
         pct(s["persist_first_blocking"], save)),
        ("  background until step-N is sealed", fmt(s["persist_sealed"]), "", pct(s["persist_sealed"], save)),
        (f"  extra loop time over the {every} steps from a save", fmt(s["persist_period"] - every * base),
         f"{every} steps {fmt(every * base)}", pct(s["persist_period"] - every * base, every * base)),
        ("restore after SIGKILL: blocks the loop", fmt(s["restore"]), f"load+apply {fmt(s['torch_load_apply'])}",
         pct(s["restore"], s["torch_load_apply"])),
        ("  against torch.load alone", "", f"torch.load {fmt(s['torch_load'])}", pct(s["restore"], s["torch_load"])),
        ("  inside restore()", fmt(s["restore_call"]), "", ""),
        ("  CPU time in restore(), all threads", fmt(s["restore_cpu"]), "", ""),
        ("  waiting in the first optimizer.step()", fmt(s["restore_wait"]), "", ""),
        ("  Checkpointer() in the new process", fmt(s["restore_construct"]), "", ""),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in [("", "convoy", "peer", "convoy/peer"), *rows]:
        print(f"{row[0]:<{widths[0]}}  {row[1]:>{widths[1]}}  {row[2]:>{widths[2]}}  {row[3]:>11}")
    print(f"\nrestore: {restore_note}")
    print(f"persistent: a save is sealed {fmt(s['persist_sealed'])} after it starts (the loop waited up to "
          f"{fmt(max(samples['persist_idle']))}, untimed, for one before the next); saves closer together block")
    print()
    targets = [
        ("in-memory-save-blocking", 100 * s["snap_blocking"] / save, 5.0, "% of torch.save", "%"),
        ("restore-from-memory", s["restore"], 0.2, " s", " s"),
        ("persistent-save-blocking", 100 * s["persist_blocking"] / save, 10.0, "% of torch.save", "%"),
    ]
    for name, measured, goal, unit, goal_unit in targets:
        verdict = "met" if measured < goal else "missed"
        print(f"target {name}: {measured:.{1 if '%' in unit else 3}f}{unit} (goal < {goal:g}{goal_unit}) {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a quarter-size model and fewer reps (under a minute)")
    parser.add_argument("--tmp", default=None,
                        help="where the peer file and persistent checkpoints go (default: $TMPDIR)")
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # e.g. `timeout`: still clean up shm and workers
    job_id = f"bench-ckpt-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    kill_job_id = f"{job_id}-kill"  # the killed worker's own segment, apart from this process's
    root = Path(tempfile.mkdtemp(prefix="convoy-bench-ckpt-", dir=args.tmp))
    for key in JOB_ENV:
        os.environ.pop(key, None)
    convoy.init(backend="gloo")
    samples: dict[str, list[float]] = defaultdict(list)
    try:
        started = time.perf_counter()
        trainer = Trainer(sizes)
        peer_file = root / "peer.pt"
        measure_snapshots(trainer, job_id, root, peer_file, samples)
        print(f"[{time.perf_counter() - started:5.1f} s] in-memory snapshots and torch.save measured", flush=True)
        measure_persistent(trainer, root, samples)
        print(f"[{time.perf_counter() - started:5.1f} s] persistent saves measured", flush=True)
        note = measure_restore(sizes, kill_job_id, root, peer_file, samples)
        print(f"[{time.perf_counter() - started:5.1f} s] kill and restores measured", flush=True)
        report(sizes, trainer, samples, note, root)
    finally:
        remove_segments(job_id)
        remove_segments(kill_job_id)
        shutil.rmtree(root, ignore_errors=True)
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
