"""The faults of issue 22 that benchmarks/faults.py adds to its matrix, each with the outcome it must have.

``stale_agent``: SIGSTOP one agent of an elastic 2-node job past the heartbeat timeout, then SIGCONT it:
the other node goes on, the stopped node's worker records no step after the loss, the node is readmitted,
0 steps lost. ``full_run_dir``: the run dir on a small tmpfs, filled while the job trains (a worker killed
while it is full, so the master has a restart to record), freed a few seconds later: the job ends, finished
or failed with one line. ``full_dev_shm``: the whole job in a mount namespace whose /dev/shm is smaller than
two snapshots: it says the snapshots are off, trains on with persistent saves, and a killed worker resumes
from the persistent checkpoint. ``lost_join_reply``: the reply to one agent's first join after the job
trained is dropped by a proxy: no extra restart. ``flapping_node``: one node's agent killed again and again
(relaunched each time) past the regroup budget: the node is excluded with a message, the job finishes.
Every run has a time bound; a job still running at its end counts as hung.
"""

from __future__ import annotations

import errno
import os
import shlex
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil
from fault_job import LEFTOVERS, Job, LocalJob, wait_for
from fault_outcome import WAIT_S, CaseOutcome, broken, ended_text, event_time, finish, fmt, guarded, restart_count
from fault_proxy import ProxiedJob
from steplog import first, steps_lost

CASES = ("stale_agent", "full_run_dir", "full_dev_shm", "lost_join_reply", "flapping_node")
HEARTBEAT_TIMEOUT_S = 3.0
STOPPED_PAST_LOSS_S = 2.0
RUN_DIR_TMPFS = "8m"
FULL_HOLD_S = 4.0
DEV_SHM_TMPFS = "16m"
WIDE_HIDDEN = 32768
"""fault_train.py's hidden width for ``full_dev_shm``: about 13 MiB of model and Adam state per snapshot slot."""
PERSIST_EVERY = 20
MAX_REGROUPS = 2


def mount_problem(in_namespace: bool) -> str | None:
    """Why a small tmpfs can't be mounted here (on a scratch dir, or on /dev/shm in a new mount namespace)."""
    scratch = Path(f"/tmp/convoy-faults-mount-probe-{os.getpid()}")
    scratch.mkdir(exist_ok=True)
    if in_namespace:
        argv = ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m convoy-probe /dev/shm"]
    else:
        argv = ["sh", "-c", f"mount -t tmpfs -o size=1m convoy-probe {scratch} && umount {scratch}"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{argv[0]}: {exc}"
    finally:
        scratch.rmdir()
    return None if done.returncode == 0 else f"mount failed: {(done.stderr or done.stdout).strip()[:120]}"


def both_ranks_after(job: Job, when: float, after_round: int) -> float | None:
    """When both ranks have finished a step of one round later than ``after_round``, after ``when``."""
    seen: dict[int, dict[int, float]] = {}
    for s in job.steps.steps:
        if s.t > when and s.round_id > after_round:
            seen.setdefault(s.round_id, {}).setdefault(s.rank, s.t)
            if len(seen[s.round_id]) == 2:
                return max(seen[s.round_id].values())
    return None


def committed_steps(job: Job, node_id: str) -> list[int]:
    """Steps of the complete snapshots in the node's segment (its one worker's), newest first."""
    from convoy.runtime.slots import SnapshotFile  # torch: only where this fault runs
    from convoy.shm import segment_path

    job.master_url()  # learns the job id
    snapshot = SnapshotFile(segment_path(job.job_id, f"{node_id}-local0"))
    try:
        return snapshot.steps()
    finally:
        snapshot.close()


# --- the faults: each starts its job, injects, waits for the outcome and judges it ---


def run_stale_agent(tmp: Path, index: int, sleep_s: float, seed: int) -> CaseOutcome:
    job = LocalJob(tmp, elastic=True, sleep_s=sleep_s, seed=seed,
                   options=["--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)])
    return guarded(job, lambda began: _stale_agent(job, index, began))


def _stale_agent(job: LocalJob, index: int, began: float) -> CaseOutcome:
    node_rank = index % 2
    fault_round = max(s.round_id for s in job.steps.steps)
    node_id = job.node_holding(node_rank) or "?"
    agent = job.child("agent", node_id)
    stale_pid = job.steps.current()[node_rank].pid
    if agent is None:
        return broken(job, f"no agent of node {node_id}")
    at = time.time()
    agent.suspend()
    lost_at = wait_for(job, lambda: event_time(job, "regroup", f"node {node_id} sent no heartbeat", at),
                       HEARTBEAT_TIMEOUT_S + WAIT_S["event"])
    if lost_at is not None:
        wait_for(job, lambda: first(job.steps.steps, lambda s: s.t > lost_at and s.round_id > fault_round),
                 WAIT_S["train"])
        time.sleep(max(0.0, lost_at + STOPPED_PAST_LOSS_S - time.time()))
    newest = max(committed_steps(job, node_id), default=-1)  # what the stopped node's worker committed by now
    resumed_at = time.time()
    agent.resume()
    readmitted = wait_for(job, lambda: both_ranks_after(job, resumed_at, fault_round + 1), WAIT_S["train"] * 1.5)
    code, ended = finish(job, began)
    steps = job.steps.steps
    cutoff = lost_at if lost_at is not None else resumed_at
    before = max((s.step for s in steps if s.pid == stale_pid and s.t <= cutoff), default=-1)
    survivor = max((s.step for s in steps if s.round_id == fault_round and s.pid != stale_pid), default=-1)
    alone = [s for s in steps if s.pid == stale_pid and s.t > cutoff and s.step > survivor]
    stale = newest > before  # a snapshot of a step it finished only after the loss
    lost = steps_lost(steps)
    ok = code == 0 and lost_at is not None and readmitted is not None and not stale and not alone and lost == 0
    result = ended_text(code, job) if code != 0 else (
        "never declared lost" if lost_at is None else
        f"the stopped node committed the snapshot of step {newest} after the loss (at step {before})" if stale else
        f"the stopped node's worker trained {len(alone)} steps alone after the loss" if alone else
        "not readmitted" if readmitted is None else "finished")
    return CaseOutcome(ok, lost, None if readmitted is None else readmitted - at, None, ended, result,
                       f"node rank {node_rank} ({node_id}), lost {fmt(lost_at and lost_at - at)} s after SIGSTOP; "
                       f"its newest snapshot: step {newest}, its last step before the loss: {before}")


def run_full_run_dir(tmp: Path, index: int, sleep_s: float, seed: int) -> CaseOutcome:
    run_dir = tmp / "run"
    run_dir.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={RUN_DIR_TMPFS}", "convoy-faults-run", str(run_dir)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        return CaseOutcome(False, 0, None, None, True, f"could not mount the run dir: {mounted.stderr.strip()}")
    try:
        job = LocalJob(tmp, elastic=False, sleep_s=sleep_s, seed=seed)
        return guarded(job, lambda began: _full_run_dir(job, index, began))
    finally:
        subprocess.run(["umount", "-l", str(run_dir)], capture_output=True)


def _fill(directory: Path) -> Path:
    """Write a file until the disk under ``directory`` is full; the file."""
    filler = directory / "filler"
    block = bytes(1 << 20)
    with open(filler, "wb", buffering=0) as handle:
        try:
            while True:
                handle.write(block)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
        for size in (4096, 512, 1):  # the last pages too
            try:
                while True:
                    handle.write(bytes(size))
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
    return filler


def _full_run_dir(job: LocalJob, index: int, began: float) -> CaseOutcome:
    rank = index % 2
    fault_round = max(s.round_id for s in job.steps.steps)
    at = time.time()
    filler = _fill(job.run_dir)
    victim = job.steps.current()[rank].pid
    try:
        psutil.Process(victim).kill()  # the master now has a restart to record on a full disk
    except psutil.Error:
        pass
    wait_for(job, lambda: None, FULL_HOLD_S)
    filler.unlink()
    freed = time.time()
    restarted = wait_for(job, lambda: first(job.steps.steps, lambda s: s.t > at and s.round_id > fault_round),
                         WAIT_S["train"])
    code, ended = finish(job, began)
    lost = steps_lost(job.steps.steps)
    reasons = [line for line in job.console.read_text(errors="replace").splitlines()
               if line.startswith(("convoy: job failed:", "convoy: error:"))]
    one_line = code not in (None, 0) and len(reasons) >= 1
    ok = ended and ((code == 0 and lost == 0) or one_line)
    recover = (restarted.t - at) if restarted is not None and code == 0 else None
    result = ended_text(code, job) if code == 0 or not reasons else f"failed (exit {code}): {reasons[-1][:160]}"
    return CaseOutcome(ok, lost if code == 0 else 0, recover, None, ended, result,
                       f"disk full for {freed - at:.1f} s, rank {rank} killed while full")


def run_full_dev_shm(tmp: Path, index: int, sleep_s: float, seed: int) -> CaseOutcome:
    left_file = tmp / "dev_shm_left.txt"
    script = (f"mount -t tmpfs -o size={DEV_SHM_TMPFS} convoy-faults-shm /dev/shm || exit 97; "
              f'"$@"; code=$?; ls -A /dev/shm > {shlex.quote(str(left_file))}; exit $code')
    job = LocalJob(tmp, elastic=False, sleep_s=sleep_s, seed=seed, wrap=["unshare", "-m", "sh", "-c", script, "sh"],
                   train_extra=["--hidden", str(WIDE_HIDDEN), "--persist-every", str(PERSIST_EVERY)])
    outcome = guarded(job, lambda began: _full_dev_shm(job, index, began))
    if left_file.exists():
        left = left_file.read_text().split()
        if left:
            LEFTOVERS.extend(f"/dev/shm (the job's own) {name}" for name in left)
    elif outcome.ended:
        outcome.detail += "; could not list the job's /dev/shm"
    return outcome


def complete_saves(run_dir: Path) -> list[tuple[int, float]]:
    """(step, wall time it was complete) of each persistent checkpoint: a ``step-N`` dir with its manifest."""
    saves = []
    for manifest in (run_dir / "checkpoints").glob("step-*/convoy-manifest.json"):
        name = manifest.parent.name.removeprefix("step-")
        if name.isdigit():
            try:
                saves.append((int(name), manifest.stat().st_mtime))
            except OSError:
                continue
    return sorted(saves)


def _full_dev_shm(job: LocalJob, index: int, began: float) -> CaseOutcome:
    rank = index % 2
    if not wait_for(job, lambda: complete_saves(job.run_dir) or None, WAIT_S["train"]):
        return broken(job, "no persistent checkpoint was completed")
    fault_round = max(s.round_id for s in job.steps.steps)
    victim = job.steps.current()[rank].pid
    at = time.time()
    psutil.Process(victim).kill()
    restarted = wait_for(job, lambda: first(job.steps.steps, lambda s: s.t > at and s.round_id > fault_round),
                         WAIT_S["train"])
    code, ended = finish(job, began)
    console = job.console.read_text(errors="replace")
    said_off = "in-memory snapshots turned off" in console
    from_persistent = "restored from persistent checkpoint" in console
    redone = steps_lost(job.steps.steps)
    # lost: finished steps before the newest persistent save complete when the workers restarted, done again
    newest = max((step for step, done in complete_saves(job.run_dir) if restarted and done < restarted.t),
                 default=-1)
    lost = max(0, newest + 1 - restarted.step) if restarted is not None else 0
    ok = code == 0 and said_off and from_persistent and restarted is not None and lost == 0
    result = ended_text(code, job) if code != 0 else (
        "did not say the snapshots are off" if not said_off else
        "did not resume from the persistent checkpoint" if not from_persistent else
        f"resumed {lost} steps before the newest persistent save" if lost else "finished")
    return CaseOutcome(ok, lost, None if restarted is None else restarted.t - at, None, ended, result,
                       f"rank {rank} killed; {redone} steps redone since the last persistent save "
                       f"(every {PERSIST_EVERY} steps)", redone=redone)


def run_lost_join_reply(tmp: Path, index: int, sleep_s: float, seed: int) -> CaseOutcome:
    job = ProxiedJob(tmp, sleep_s, seed, proxied=index % 2)
    return guarded(job, lambda began: _lost_join_reply(job, began))


def _lost_join_reply(job: ProxiedJob, began: float) -> CaseOutcome:
    assert job.proxy is not None
    fault_round = max(s.round_id for s in job.steps.steps)
    rank = next((r for r in (0, 1) if job.node_holding(r) == job.proxied_node), None)
    if rank is None:
        return broken(job, f"no rank on {job.proxied_node}")
    before = restart_count(job)
    job.proxy.arm()
    at = time.time()
    psutil.Process(job.steps.current()[rank].pid).kill()  # the round restarts: the agents join again
    restarted = wait_for(job, lambda: first(job.steps.steps, lambda s: s.t > at and s.round_id > fault_round),
                         WAIT_S["train"])
    wait_for(job, lambda: None, 2.0)  # an extra restart from the retried join would come now
    code, ended = finish(job, began)
    extra = restart_count(job) - before - 1
    lost = steps_lost(job.steps.steps)
    dropped = bool(job.proxy.dropped_at)
    ok = code == 0 and dropped and restarted is not None and extra == 0 and lost == 0
    result = ended_text(code, job) if code != 0 else (
        "no join reply was dropped" if not dropped else f"{extra} extra restart(s)" if extra else "finished")
    return CaseOutcome(ok, lost, None if restarted is None else restarted.t - at, None, ended, result,
                       f"rank {rank} killed, reply to {job.proxied_node}'s join dropped; joins seen {job.proxy.joins}")


def run_flapping_node(tmp: Path, index: int, sleep_s: float, seed: int) -> CaseOutcome:
    job = LocalJob(tmp, elastic=True, sleep_s=sleep_s, seed=seed,
                   options=["--max-regroups", str(MAX_REGROUPS), "--regroup-window", "600"])
    return guarded(job, lambda began: _flapping_node(job, index, began))


def _flapping_node(job: LocalJob, index: int, began: float) -> CaseOutcome:
    node_id = job.node_holding(index % 2) or "?"
    at, kills, excluded = time.time(), 0, None
    for _ in range(MAX_REGROUPS + 2):
        agent = wait_for(job, lambda: job.child("agent", node_id), WAIT_S["train"])
        if agent is None:
            break
        kill_at = time.time()
        agent.kill()
        kills += 1
        back = wait_for(job, lambda: event_time(job, "node_excluded", f"node {node_id}", at)
                        or (-1.0 if both_ranks_after(job, kill_at, 0) else None), WAIT_S["train"])
        if back is not None and back > 0:
            excluded = back
            break
    if excluded is not None:
        wait_for(job, lambda: first(job.steps.steps, lambda s: s.t > excluded + 1.0), WAIT_S["train"])
    code, ended = finish(job, began)
    console = job.console.read_text(errors="replace")
    said = f"node {node_id} caused" in console and "excluded" in console
    lost = steps_lost(job.steps.steps)
    ok = code == 0 and excluded is not None and said and lost == 0
    result = ended_text(code, job) if code != 0 else (
        f"not excluded after {kills} kills" if excluded is None else
        "excluded without a console message" if not said else "finished")
    return CaseOutcome(ok, lost, None if excluded is None else excluded - at, None, ended, result,
                       f"node {node_id}'s agent killed {kills} times (budget {MAX_REGROUPS} regroups)")


RUN: dict[str, Callable[[Path, int, float, int], CaseOutcome]] = {
    "stale_agent": run_stale_agent, "full_run_dir": run_full_run_dir, "full_dev_shm": run_full_dev_shm,
    "lost_join_reply": run_lost_join_reply, "flapping_node": run_flapping_node,
}


def case_problem(fault: str) -> str | None:
    """Why ``fault`` can't run on this machine (None: it can)."""
    if fault == "full_run_dir":
        return mount_problem(in_namespace=False)
    if fault == "full_dev_shm":
        return mount_problem(in_namespace=True)
    return None
