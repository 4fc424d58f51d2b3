"""Startup of torchrun's own command lines, under torchrun and under ``convoy run`` with the same flags.

Each line of the torchrun table (``tests/integration/test_torchrun_cli.py``'s cases that start workers, plus a
two-host line run as two launchers on loopback) starts ``scripts/first_collective.py``: import torch, join the
process group from the launcher's variables, build DDP and take its first step. Timed: from the launcher's start
to rank 0 past that step (when training is under way), and to the last launcher's exit. Runs alternate between the two
launchers (A/B/A/B) so that drift of the machine falls on both; medians per line, and the ratio convoy/torchrun.

Target (issue 28): convoy's startup <= 0.8x torchrun's for every line. Exits 0 whether it is met or missed.
"""

from __future__ import annotations

import argparse
import compileall
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import convoy

HERE = Path(__file__).resolve().parent
SCRIPT = str(HERE / "scripts" / "first_collective.py")
TORCHRUN = [str(Path(sys.executable).parent / "torchrun")]
CONVOY = [sys.executable, "-m", "convoy", "run"]
TARGET = 0.8


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def lines(port: int) -> dict[str, list[list[str]]]:
    """Each case: the launcher flags of each host's command (one host, or two for the two-host line)."""
    return {
        "standalone": [["--standalone", "--nproc_per_node=2"]],
        "rdzv": [["--nnodes=1", "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}",
                  "--rdzv-id=job42"]],
        "static": [["--nnodes", "1", "--node_rank", "0", "--master_addr", "127.0.0.1", "--master_port", str(port),
                    "--nproc_per_node", "2"]],
        "streams": [["--standalone", "--nproc-per-node", "2", "--role", "trainer", "-r", "3", "-t", "0:3",
                     "--local-ranks-filter", "0", "--run-path"]],
        "two-hosts": [["--nnodes=2", "--nproc-per-node=1", f"--node-rank={rank}", "--master-addr=127.0.0.1",
                       f"--master-port={port}"] for rank in (0, 1)],
    }


def one_run(launcher: str, case: str, tmp: Path) -> tuple[float, float] | None:
    """(seconds to rank 0 past its first step, seconds to the last launcher's exit); None: the line failed."""
    out = tmp / f"{launcher}-{case}-{time.monotonic_ns()}.t"
    run_dir = tmp / f"run-{out.stem}"
    procs = []
    start = time.time()
    for flags in lines(free_port())[case]:
        if launcher == "torchrun":
            command = [*TORCHRUN, *flags, SCRIPT, "--out", str(out)]
        else:
            command = [*CONVOY, "--run-dir", str(run_dir), *flags, SCRIPT, "--out", str(out)]
        log = open(tmp / f"{out.stem}-{len(procs)}.log", "wb")  # noqa: SIM115 (closed below)
        procs.append((subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                       env={**os.environ, "LOGLEVEL": "WARNING"}), log))
    deadline = time.monotonic() + 60  # a run takes a few seconds
    codes: list[int | None] = []
    for proc, _ in procs:
        try:
            codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:  # a launcher that hangs is a failed run, and is ended here
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            codes.append(None)
    done = time.time()
    for _, log in procs:
        log.close()
    if any(codes) or not out.exists():
        text = [line for _, log in procs for line in Path(log.name).read_text(errors="replace").splitlines()]
        causes = ("exitcode", "terminate called", "Error")  # a worker's end (torchrun's summary) before any error
        last = next(([line.strip()] for mark in causes for line in reversed(text) if mark in line), [])
        when = "after rank 0's first step" if out.exists() else "before rank 0's first step"
        print(f"  {case}: {launcher} FAILED {when}, exit codes {codes}: {last[0][:160] if last else 'no error line'}")
        return None
    return float(out.read_text()) - start, done - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per launcher and line (default 5)")
    parser.add_argument("--quick", action="store_true", help="one run per launcher and line")
    parser.add_argument("--only", choices=list(lines(0)), action="append", help="run only this line (repeatable)")
    args = parser.parse_args()
    runs = 1 if args.quick else args.runs
    # convoy as `pip install` leaves it: its modules byte-compiled, as torch's are. An editable install under
    # PYTHONDONTWRITEBYTECODE=1 (this machine's default) would compile every module in every process it starts.
    compiled = compileall.compile_dir(str(Path(convoy.__file__).parent), quiet=1)
    print(f"convoy's modules byte-compiled first ({'ok' if compiled else 'FAILED'}), as torch's are at install")
    print(f"{runs} run(s) per launcher and line, alternating; {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}")
    results: dict[str, dict[str, list[tuple[float, float]]]] = {}
    failures = {"convoy": 0, "torchrun": 0}
    with tempfile.TemporaryDirectory(prefix="convoy-lines-") as tmp:
        for case in args.only or lines(0):
            results[case] = {"convoy": [], "torchrun": []}
            for index in range(runs):
                order = ("convoy", "torchrun") if index % 2 == 0 else ("torchrun", "convoy")
                for launcher in order:
                    timed = one_run(launcher, case, Path(tmp))
                    if timed is None:
                        failures[launcher] += 1
                        continue
                    first, total = timed
                    results[case][launcher].append((first, total))
                    print(f"  {case} run {index + 1}: {launcher} first step {first:.2f} s, exit {total:.2f} s",
                          flush=True)
    print(f"\n{'line':<12} {'convoy s':>9} {'torchrun s':>11} {'ratio':>6}   {'convoy exit':>11} {'torchrun exit':>13}")
    worst = 0.0
    for case, by in results.items():
        if not by["convoy"] or not by["torchrun"]:
            print(f"{case:<12} no successful run of one launcher")
            continue
        ours = statistics.median(first for first, _ in by["convoy"])
        theirs = statistics.median(first for first, _ in by["torchrun"])
        ours_exit = statistics.median(total for _, total in by["convoy"])
        theirs_exit = statistics.median(total for _, total in by["torchrun"])
        worst = max(worst, ours / theirs)
        print(f"{case:<12} {ours:>9.2f} {theirs:>11.2f} {ours / theirs:>6.2f}   {ours_exit:>11.2f} "
              f"{theirs_exit:>13.2f}")
    print(f"\nfailed runs: convoy {failures['convoy']}, torchrun {failures['torchrun']}")
    print(f"target startup <= {TARGET}x torchrun's on every line: worst {worst:.2f}x "
          f"{'met' if worst <= TARGET else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
