"""Benchmark: convoy.Checkpointer's saves and restore against the peers a user would pick instead.

    python benchmarks/checkpoint.py [--quick] [--tmp DIR]

A stack of ``Linear(1024, 1024)`` layers (~100 MB of float32 parameters, ~300 MB with Adam's
state; ``--quick``: a quarter) trains on random batches in this process. Every number is a median
over repetitions. The peers save the same state (``model.state_dict()`` and
``optimizer.state_dict()``) to the same disk or memory:

- ``torch.save`` (synchronous; also with an fsync), kept as the reference the old targets used;
- a plain copy into shared memory: buffers made once with ``tensor.share_memory_()``, each save
  ``copy_`` of every tensor of the state into them (pinned memory would be the GPU user's choice,
  but pinning needs CUDA and this benchmark runs on CPUs, so shared memory it is);
- ``torch.distributed.checkpoint.async_save`` on a 1-rank gloo group, writing ``step-N`` folders
  with its FileSystemWriter, in three set-ups: as it comes (it stages into new memory inside the
  call), with one ``DefaultStager`` kept across saves (its staging buffers are reused), and with
  that stager's ``use_async_staging`` (the copy runs on a thread; the loop must not change the
  state before it ends, so the next ``optimizer.step()`` first waits for ``staging_completion``).

In-memory snapshots and the shared-memory copy run in alternating blocks with plain training
blocks, with a torch.save after each round; persistent saves, convoy's and then the three
async_save set-ups in turn, each come every ``persist_every`` steps. What "blocks the loop":

- a save: the time inside ``ckpt.step()`` (or the peer's call) plus what the next
  ``optimizer.step()`` waits for in pre-step hooks (timed by hooks registered before and after
  them: the Checkpointer's, or the wait for async_save's staging); the background write is timed
  until ``step-N`` is sealed (convoy) or async_save's future is done, and the next save starts only
  after that (an untimed wait), so each save is measured on its own;
- a restore: a worker training with snapshots is SIGKILLed; fresh processes time ``restore()`` plus
  the first ``optimizer.step()``'s wait, and ``torch.load`` + ``load_state_dict`` of the peer file.

The targets compare convoy with the peer that blocks the loop least (for persistent saves: the
least of those that write files); the torch.save ratios are printed for reference.
CPU-time rows tell work from waiting for a core: on a busy 2-core machine the wall times swing.
The training loop and the in-process peers are benchmarks/scripts/ckpt_loop.py, the kill and the restores
ckpt_restore.py (both run in ckpt_worker.py's processes' stead only here; this file measures and reports).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import torch

import convoy
from convoy.runtime.persist import step_dir
from convoy.shm import remove_segments

SCRIPTS = Path(__file__).resolve().parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
from ckpt_loop import ASYNC_SAVE, FULL, QUICK, SharedCopy, Sizes, Trainer, measure_async_save, peer_save  # noqa: E402
from ckpt_restore import JOB_ENV, measure_restore  # noqa: E402

def measure_snapshots(trainer: Trainer, job_id: str, root: Path, peer_file: Path,
                      samples: dict[str, list[float]]) -> None:
    """Alternate blocks without checkpoints, with in-memory snapshots and with the shared-memory copy;
    a peer torch.save (and one with fsync) after each round."""
    sizes, ckpt = trainer.sizes, trainer.attach(job_id, directory=root / "unused")
    for _ in range(2):
        trainer.step(None, 0)  # Adam's state exists after the first step
    shared = SharedCopy(trainer)  # its buffers are made here, once
    first = [trainer.step(ckpt, step) for step in range(3)]  # the first one allocates the segment
    samples["first_save"] = [first[0].in_ckpt + first[1].wait]
    ckpt.wait()  # (close() would end the Checkpointer: the blocks below go on with it)
    step = 3
    for _ in range(sizes.reps):
        samples["base_step"] += [trainer.step(None, 0).total for _ in range(sizes.block)][1:]
        timed = [trainer.step(ckpt, step + k) for k in range(sizes.block)]
        step += sizes.block
        started = time.perf_counter()
        ckpt.wait()  # right after the last ckpt.step(): the whole copy, overlapping nothing
        samples["copy_alone"].append(time.perf_counter() - started)
        samples["snap_step"] += [s.total for s in timed[1:]]
        samples["snap_in_ckpt"] += [s.in_ckpt for s in timed[:-1]]  # the saves whose next step is timed
        samples["snap_in_ckpt_cpu"] += [s.in_ckpt_cpu for s in timed[:-1]]
        samples["snap_wait"] += [s.wait for s in timed[1:]]
        samples["snap_blocking"] += [timed[k].in_ckpt + timed[k + 1].wait for k in range(sizes.block - 1)]
        copies = [trainer.step(shared, 0) for _ in range(sizes.block)]
        samples["shm_step"] += [s.total for s in copies[1:]]
        samples["shm_blocking"] += [copies[k].in_ckpt + copies[k + 1].wait for k in range(sizes.block - 1)]
        samples["shm_in_call"] += [s.in_ckpt for s in copies[:-1]]
        samples["shm_in_call_cpu"] += [s.in_ckpt_cpu for s in copies[:-1]]
        samples["shm_wait"] += [s.wait for s in copies[1:]]
        samples["torch_save"].append(peer_save(trainer, peer_file, fsync=False))
        samples["torch_save_fsync"].append(peer_save(trainer, peer_file, fsync=True))
    samples["torch_save"].append(peer_save(trainer, peer_file, fsync=False))  # leaves the file for `load`
    ckpt.close()


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


def med(values: list[float]) -> float:
    return statistics.median(values)


def fmt(seconds: float) -> str:
    if seconds != seconds:
        return "n/a"
    return f"{seconds * 1000:.1f} ms" if abs(seconds) < 1 else f"{seconds:.2f} s"


def pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%"


class Peer(NamedTuple):
    """One peer's medians: what blocks the loop, and until its save is complete."""

    name: str
    blocking: float
    in_call: float
    wait: float
    done: float
    first: float  # the first (warm-up) save's blocking time; nan: not measured apart
    period: float  # the loop time over persist_every steps from a save; nan: not measured
    persists: bool  # writes a file (a peer for the persistent save)


def peers_of(s: dict[str, float]) -> list[Peer]:
    nan = float("nan")
    peers = [Peer("torch.save", s["torch_save"], s["torch_save"], 0.0, s["torch_save"], nan, nan, True),
             Peer("torch.save + fsync", s["torch_save_fsync"], s["torch_save_fsync"], 0.0, s["torch_save_fsync"],
                  nan, nan, True),
             Peer("copy_ into share_memory_() buffers", s["shm_blocking"], s["shm_in_call"], s["shm_wait"],
                  s["shm_in_call"], nan, nan, False)]
    for key, (label, _) in ASYNC_SAVE.items():
        peers.append(Peer(label, s[key + "_blocking"], s[key + "_in_call"], s[key + "_wait"], s[key + "_done"],
                          s[key + "_first_blocking"], s[key + "_period"], True))
    return peers


def table(rows: list[tuple[str, ...]]) -> None:
    """Left-aligned first column, the others right-aligned, each as wide as its widest cell."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [f"{row[0]:<{widths[0]}}", *(f"{cell:>{width}}" for cell, width in zip(row[1:], widths[1:]))]
        print("  ".join(cells).rstrip())


def report(sizes: Sizes, trainer: Trainer, samples: dict[str, list[float]], restore_note: str, disk: Path) -> None:
    """Print the peers' table, convoy's table beside the best peer (medians) and one line per target."""
    s = {key: med(values) for key, values in samples.items() if values}
    params = sum(p.numel() for p in trainer.model.parameters())
    state_mb = sum(t.numel() * t.element_size() for v in trainer.optimizer.state.values() for t in v.values()
                   if isinstance(t, torch.Tensor)) / 1e6 + params * 4 / 1e6
    save, base, every = s["torch_save"], s["base_step"], sizes.persist_every
    peers = peers_of(s)
    best = min(peers, key=lambda peer: peer.blocking)
    best_file = min((peer for peer in peers if peer.persists), key=lambda peer: peer.blocking)
    print(f"\nconvoy checkpoint benchmark ({sizes.name}): {sizes.layers} x Linear({sizes.width}, {sizes.width}) = "
          f"{params / 1e6:.1f}M params ({params * 4 / 1e6:.0f} MB), with Adam state {state_mb:.0f} MB; "
          f"batch {sizes.batch}, {torch.get_num_threads()} torch threads, torch {torch.__version__}")
    print(f"medians of {sizes.reps} blocks x {sizes.block - 1} timed steps (in-memory), {sizes.persist_saves - 1} "
          f"persistent saves each after a warm-up one, {sizes.restores} restores; same state, disk {disk}")
    print("no CUDA here: no pinned-memory peer (pinning needs CUDA); the plain copy goes to shared memory\n")

    print("peers (the same state)")
    rows: list[tuple[str, ...]] = [("", "blocks the loop", "in the call", "next step waits", "until done",
                                    "first save blocks", f"extra over {every} steps")]
    for peer in peers:
        extra = peer.period - every * base
        rows.append((peer.name, fmt(peer.blocking), fmt(peer.in_call), fmt(peer.wait), fmt(peer.done),
                     fmt(peer.first), fmt(extra)))
    table(rows)
    print(f"best (least blocking): {best.name} {fmt(best.blocking)}; of those that write a file: "
          f"{best_file.name} {fmt(best_file.blocking)}\n")

    vs_best = f"{best.name} {fmt(best.blocking)}"
    vs_file = f"{best_file.name} {fmt(best_file.blocking)}"
    rows = [
        ("", "convoy", "peer", "convoy/peer"),
        ("training step without checkpoints", fmt(base), "", ""),
        ("in-memory save: blocks the loop", fmt(s["snap_blocking"]), vs_best, pct(s["snap_blocking"], best.blocking)),
        ("  against the shared-memory copy", "", f"copy_ {fmt(s['shm_blocking'])}",
         pct(s["snap_blocking"], s["shm_blocking"])),
        ("  against torch.save (reference)", "", f"torch.save {fmt(save)}", pct(s["snap_blocking"], save)),
        ("  inside ckpt.step()", fmt(s["snap_in_ckpt"]), "", ""),
        ("    of which CPU time of this thread", fmt(s["snap_in_ckpt_cpu"]), f"copy_ {fmt(s['shm_in_call_cpu'])}",
         ""),
        ("  waiting in the next optimizer.step()", fmt(s["snap_wait"]), "", ""),
        ("  step time with - without snapshots", fmt(s["snap_step"] - base),
         f"copy_ {fmt(s['shm_step'] - base)}", pct(s["snap_step"] - base, base) + " of a step"),
        ("  background copy alone (close() at once)", fmt(s["copy_alone"]), "", pct(s["copy_alone"], save)),
        ("  first save (allocates the segment)", fmt(s["first_save"]), "", pct(s["first_save"], save)),
        ("persistent save: blocks the loop", fmt(s["persist_blocking"]), vs_file,
         pct(s["persist_blocking"], best_file.blocking)),
        ("  against torch.save (reference)", "", f"torch.save {fmt(save)}", pct(s["persist_blocking"], save)),
        ("  against torch.save + fsync", "", f"+fsync {fmt(s['torch_save_fsync'])}",
         pct(s["persist_blocking"], s["torch_save_fsync"])),
        ("  inside ckpt.step()", fmt(s["persist_in_ckpt"]), "", ""),
        ("    of which CPU time of this thread", fmt(s["persist_in_ckpt_cpu"]), "", ""),
        ("  waiting in the next optimizer.step()", fmt(s["persist_wait"]), "", ""),
        ("  first save (warm-up): blocks the loop", fmt(s["persist_first_blocking"]),
         f"first save {fmt(best_file.first)}",
         pct(s["persist_first_blocking"], best_file.first)),
        ("  background until step-N is sealed", fmt(s["persist_sealed"]), f"until done {fmt(best_file.done)}",
         pct(s["persist_sealed"], best_file.done)),
        (f"  extra loop time over the {every} steps from a save", fmt(s["persist_period"] - every * base),
         f"extra {fmt(best_file.period - every * base)}",
         pct(s["persist_period"] - every * base, every * base) + " of them"),
        ("restore after SIGKILL: blocks the loop", fmt(s["restore"]), f"load+apply {fmt(s['torch_load_apply'])}",
         pct(s["restore"], s["torch_load_apply"])),
        ("  against torch.load alone", "", f"torch.load {fmt(s['torch_load'])}", pct(s["restore"], s["torch_load"])),
        ("  inside restore()", fmt(s["restore_call"]), "", ""),
        ("  CPU time in restore(), all threads", fmt(s["restore_cpu"]), "", ""),
        ("  waiting in the first optimizer.step()", fmt(s["restore_wait"]), "", ""),
        ("  Checkpointer() in the new process", fmt(s["restore_construct"]), "", ""),
    ]
    table(rows)
    print(f"\nrestore: {restore_note}")
    print(f"persistent: a save is sealed {fmt(s['persist_sealed'])} after it starts (the loop waited up to "
          f"{fmt(max(samples['persist_idle']))}, untimed, for one before the next); saves closer together block")
    print(f"reference, not targets: in-memory save {pct(s['snap_blocking'], save)}, persistent save "
          f"{pct(s['persist_blocking'], save)} of a torch.save")
    print()
    targets = [
        ("in-memory-save-blocking", 100 * s["snap_blocking"] / best.blocking, 5.0, f"% of {best.name}", "%"),
        ("restore-from-memory", s["restore"], 0.2, " s", " s"),
        ("persistent-save-blocking", 100 * s["persist_blocking"] / best_file.blocking, 10.0,
         f"% of {best_file.name}", "%"),
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
        print(f"[{time.perf_counter() - started:5.1f} s] snapshots, shared-memory copies, torch.save measured",
              flush=True)
        measure_persistent(trainer, root, samples)
        print(f"[{time.perf_counter() - started:5.1f} s] persistent saves measured", flush=True)
        measure_async_save(trainer, root, samples)
        print(f"[{time.perf_counter() - started:5.1f} s] dcp.async_save measured", flush=True)
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
