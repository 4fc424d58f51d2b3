"""The live dashboard's cost and speed (issue 30), in headless Chromium against real jobs.

    python benchmarks/dashboard.py [--quick]

1. A 4-rank job (2 nodes x 2 workers): the master's RSS and CPU time over alternating windows (A/B, 4 pairs of
   10 s), the 3 browser contexts (each its own session, at 1 s refresh) away on about:blank, then on the metrics
   page; the cost is the median of the pairs' differences (a job's own CPU drifts over minutes, and a 10 ms tick
   is 0.1% of a 10 s window). Plus what importing the dashboard's modules costs a process. Screenshots of the
   pages go to benchmarks/results/dashboard_PAGE.png.
2. The same job: from a rank's ``convoy.report`` (the point's time) to that point drawn in the page (default
   refresh 0.25 s; the report's own batching, FLUSH_S = 0.5 s, is inside the measurement).
3. A finished job of 10,000 events and 100,000 metric points (a synthetic state file, served by ``convoy
   dashboard``): page load to first paint, and to the job's data drawn.
Ray's dashboard (``scripts/ray_dashboard.py``) is measured in the same run when a ``ray`` executable is given
(``--ray``, default: ray on PATH).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import ray_dashboard  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
EXAMPLE = str(ROOT / "examples" / "train_live_config.py")
CHROMIUM = "/usr/bin/chromium"
CONVOY = [sys.executable, "-m", "convoy"]
PAGES = ("overview", "nodes", "events", "metrics", "config", "rounds")


def wait_link(out: Path, proc: subprocess.Popen[bytes], pattern: str, timeout: float = 90) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = re.search(pattern, out.read_text(errors="replace"))
        if match:
            return match
        if proc.poll() is not None:
            raise RuntimeError(f"exited before printing the link:\n{out.read_text()}")
        time.sleep(0.1)
    raise RuntimeError("no dashboard link printed")


def new_code(base: str, token: str) -> str:
    request = urllib.request.Request(f"{base}/ui/code", method="POST", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        return str(json.loads(reply.read())["url"])


def sample(proc: psutil.Process, seconds: float) -> tuple[float, float]:
    """(CPU seconds spent, RSS in MiB at the end) over a window."""
    before = sum(proc.cpu_times()[:2])
    time.sleep(seconds)
    return sum(proc.cpu_times()[:2]) - before, proc.memory_info().rss / 2**20


def import_cost() -> float:
    """MiB a process grows by importing the dashboard's modules on top of the rest of the master's."""
    code = ("import resource, convoy.control.api, convoy.control.store, convoy.control.roles.calls, "
            "convoy.control.training.calls;"
            "import psutil; p = psutil.Process(); a = p.memory_info().rss;"
            "import convoy.control.dashboard.server, convoy.control.dashboard.actions;"
            "print((p.memory_info().rss - a) / 2**20)")
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def live_job(playwright, work: Path, window_s: float, pairs: int) -> dict[str, Any]:
    run_dir, out = work / "run", work / "job.out"
    with open(out, "wb") as sink:
        job = subprocess.Popen([*CONVOY, "run", "--nnodes", "2", "--nproc-per-node", "2", "--run-dir", str(run_dir),
                                "--set", "steps=100000", EXAMPLE, "--step-time", "0.05"], stdout=sink,
                               stderr=subprocess.STDOUT, start_new_session=True)
    numbers: dict[str, Any] = {}
    try:
        base = wait_link(out, job, r"dashboard at (http://[\d.:]+)/\?code=")[1]
        wait_link(out, job, r"config version 1 .* runs on all 4 ranks")
        token = (run_dir / "token").read_text().strip()
        job_id = wait_link(out, job, r"convoy: job (\w+):")[1]  # the dashboard's key of the job
        master, = [p for p in psutil.Process(job.pid).children() if "master" in p.cmdline()]
        time.sleep(3)
        browser = playwright.chromium.launch(executable_path=CHROMIUM)
        contexts = []
        for index in range(3):
            context = browser.new_context(viewport={"width": 1280, "height": 860})
            context.add_init_script("localStorage.setItem('convoy-refresh', '1');")
            page = context.new_page()
            page.goto(new_code(base, token))  # the login: later visits carry the context's session cookie
            page.wait_for_selector("body[data-ready='1']", timeout=30_000)
            contexts.append((context, page))
        # A/B windows: the pages away (about:blank: no stream, no request), then back on the metrics page
        off, on = [], []
        for _ in range(pairs):
            for _, page in contexts:
                page.goto("about:blank")
            time.sleep(1)
            off.append(sample(master, window_s))
            for _, page in contexts:
                page.goto(f"{base}/#/{job_id}/metrics")
                page.wait_for_selector("body[data-ready='1']", timeout=30_000)
            time.sleep(2)
            on.append(sample(master, window_s))
        cpu0 = statistics.median(cpu for cpu, _ in off)
        cpu1 = statistics.median(cpu for cpu, _ in on)
        rss0, rss1 = off[0][1], max(rss for _, rss in on)
        numbers["cpu_pairs"] = [(a / window_s * 100, b / window_s * 100) for (a, _), (b, _) in zip(off, on)]
        _, page = contexts[0]
        for name in PAGES:
            page.click(f"#tab-{name}")
            time.sleep(0.8)
            page.screenshot(path=str(RESULTS / f"dashboard_{name}.png"), full_page=name != "events")
        for context, _ in contexts:
            context.close()
        numbers.update(rss_before=rss0, rss_with=rss1, cpu_before=cpu0 / window_s * 100,
                       cpu_with=cpu1 / window_s * 100)
        context = browser.new_context()
        context.add_init_script("window.convoyArrivals = [];")
        page = context.new_page()
        page.goto(new_code(base, token))
        page.wait_for_selector("body[data-ready='1']", timeout=30_000)
        page.click("#tab-metrics")
        time.sleep(window_s)
        delays = sorted(page.evaluate("convoyArrivals"))
        context.close()
        browser.close()
        numbers.update(points=len(delays), p50=statistics.median(delays) if delays else float("nan"),
                       p95=delays[int(0.95 * (len(delays) - 1))] if delays else float("nan"))
    finally:
        os.killpg(job.pid, signal.SIGTERM)
        try:
            job.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    return numbers


def synthetic_job(run_dir: Path, events: int, points: int, ranks: int = 8) -> None:
    """A finished job's state file of ``events`` events and ``points`` status rows, written by the master's own
    store classes (the status store unbounded for it)."""
    from convoy.control.store import Store
    from convoy.control.training.status_store import COLUMNS, StatusStore

    run_dir.mkdir(parents=True)
    Store(run_dir, "{}").close()
    db = sqlite3.connect(run_dir / "state.db")
    now = time.time()
    db.execute("INSERT INTO job VALUES ('synthetic', 'succeeded', 3, 3, 4, 2, 2, '127.0.0.1:1', 'done', ?, ?, 0, "
               "'[]', '{}', '{}', 0)", (now - 3600, now))
    for round_id in range(1, 5):
        db.execute("INSERT INTO rounds VALUES (?, ?, 4, '127.0.0.1', 1, ?)",
                   (round_id, now - 3600 + 900 * (round_id - 1), json.dumps([[0, "n0", "h", 2], [1, "n1", "h", 2]])))
    kinds = ("node_joined", "round_closed", "proposal", "worker_failed", "restart", "config_applied")
    db.executemany("INSERT INTO events (ts, kind, node_id, round_id, message) VALUES (?,?,?,?,?)",
                   [(now - 3600 + i * 0.36, kinds[i % len(kinds)], f"n{i % 2}", 1 + i * 4 // events,
                     f"synthetic event {i}") for i in range(events)])
    db.commit()
    db.close()
    store = StatusStore(run_dir, max_per_task=points)
    per_rank = points // ranks
    rows = [(f"default:{rank}", "default", rank, step, now - 3600 + step * 0.03, 5.0 / (1 + step * 0.01), 0.03, 900.0,
             2**28, 1.0, "") for rank in range(ranks) for step in range(per_rank)]
    assert len(COLUMNS) == len(rows[0])
    for start in range(0, len(rows), 20_000):
        store.add(rows[start:start + 20_000])
    store.close()


def big_job(playwright, work: Path, runs: int) -> tuple[list[float], list[float]]:
    run_dir, out = work / "big", work / "dash.out"
    synthetic_job(run_dir, 10_000, 100_000)
    with open(out, "wb") as sink:
        server = subprocess.Popen([*CONVOY, "dashboard", "--run-dirs", str(run_dir)], stdout=sink,
                                  stderr=subprocess.STDOUT)
    paints, ready = [], []
    try:
        match = wait_link(out, server, r"at (http://[\d.:]+)/\?code=(\S+)", 30)
        base = match[1]
        browser = playwright.chromium.launch(executable_path=CHROMIUM)
        login = browser.new_context()
        login.new_page().goto(f"{base}/?code={match[2]}")
        cookies = login.cookies()  # one session; each load below is a fresh context (no cache) with its cookie
        login.close()
        for _ in range(runs):
            context = browser.new_context(viewport={"width": 1280, "height": 860})
            context.add_cookies(cookies)
            page = context.new_page()
            page.goto(f"{base}/#/synthetic/metrics")
            page.wait_for_selector("body[data-ready='1']", timeout=30_000)
            page.wait_for_selector("#chart-loss svg[data-points]")
            paint, drawn = page.evaluate("[performance.getEntriesByName('first-contentful-paint')[0].startTime, "
                                         "performance.getEntriesByName('convoy-ready')[0].startTime]")
            paints.append(paint / 1000)
            ready.append(drawn / 1000)
            page.screenshot(path=str(RESULTS / "dashboard_big_metrics.png"))
            context.close()
        browser.close()
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(10)
    return paints, ready


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="shorter windows, fewer page loads")
    on_path = shutil.which("ray")
    parser.add_argument("--ray", type=Path, default=Path(on_path) if on_path else None,
                        help="the ray executable of an environment with ray[default], to measure Ray's dashboard "
                        "in the same run (default: ray on PATH)")
    args = parser.parse_args()
    window_s, runs, pairs = (5.0, 3, 2) if args.quick else (10.0, 5, 4)
    from playwright.sync_api import sync_playwright

    imported = import_cost()
    with tempfile.TemporaryDirectory(prefix="convoy-dash-bench-") as tmp, sync_playwright() as playwright:
        live = live_job(playwright, Path(tmp), window_s, pairs)
        paints, ready = big_job(playwright, Path(tmp), runs)
        peer = ray_dashboard.measure(args.ray, playwright, CHROMIUM, window_s) if args.ray else \
            "not measured: no ray executable (give --ray PATH of an environment with ray[default])"
    added_rss = imported + max(0.0, live["rss_with"] - live["rss_before"])
    added_cpu = statistics.median(with_pages - before for before, with_pages in live["cpu_pairs"])
    print(f"4-rank job, master process, {pairs} pairs of {window_s:.0f} s windows, alternating (pages away, pages on)")
    for number, (before, with_pages) in enumerate(live["cpu_pairs"], 1):
        print(f"  pair {number}: CPU % of a core, pages away {before:.2f}, 3 pages on the metrics tab {with_pages:.2f}")
    print(f"  {'medians':38} {'RSS MiB':>9} {'CPU % of a core':>16}")
    print(f"  {'no page open':38} {live['rss_before']:9.1f} {live['cpu_before']:16.2f}")
    print(f"  {'3 browser contexts, 1 s refresh':38} {live['rss_with']:9.1f} {live['cpu_with']:16.2f}")
    print(f"  importing the dashboard's modules: {imported:.1f} MiB")
    if isinstance(peer, str):
        print(f"  Ray's dashboard: {peer}")
    else:
        print(f"  Ray's dashboard ({peer['version']}, `ray start --head`, one node; {peer['processes']:.0f} "
              f"processes): RSS {peer['rss_idle']:.0f} MiB (USS {peer['uss_idle']:.0f}) idle, CPU "
              f"{peer['cpu_idle']:.2f}% of a core; with 3 browser contexts on its overview: RSS "
              f"{peer['rss_pages']:.0f} MiB (USS {peer['uss_pages']:.0f}), CPU {peer['cpu_pages']:.2f}%")
    print(f"report -> point drawn in the page: {live['points']:.0f} points, p50 {live['p50'] * 1000:.0f} ms, "
          f"p95 {live['p95'] * 1000:.0f} ms (includes convoy.report's 0.5 s batching and the 0.25 s refresh)")
    print(f"10,000 events + 100,000 points, {len(ready)} page loads: first paint median "
          f"{statistics.median(paints) * 1000:.0f} ms; data drawn median {statistics.median(ready) * 1000:.0f} ms, "
          f"max {max(ready) * 1000:.0f} ms")
    print()
    verdict = lambda ok: "met" if ok else "missed"  # noqa: E731
    beside = "" if isinstance(peer, str) else f"; Ray's dashboard processes: {peer['rss_pages']:.0f} MiB RSS"
    print(f"target dashboard RSS added to the master: {added_rss:.1f} MiB (goal <= 30 MB{beside}) "
          f"{verdict(added_rss <= 28.6)}")
    print(f"target dashboard CPU with 3 browsers at 1 s: {added_cpu:.2f}% of a core, the median of the pairs' "
          f"differences (goal <= 2%) "
          f"{verdict(added_cpu <= 2.0)}")
    print(f"target convoy.report to the browser p95: {live['p95'] * 1000:.0f} ms (goal <= 500 ms) "
          f"{verdict(live['p95'] <= 0.5)}")
    print(f"target page load to first paint, 10k events + 100k points: {statistics.median(paints) * 1000:.0f} ms "
          f"(goal <= 1000 ms) {verdict(statistics.median(paints) <= 1.0)}")
    print(f"target page load to the job's data drawn, 10k events + 100k points: {statistics.median(ready) * 1000:.0f}"
          f" ms (goal <= 1000 ms; stricter than first paint) {verdict(statistics.median(ready) <= 1.0)}")


if __name__ == "__main__":
    main()
