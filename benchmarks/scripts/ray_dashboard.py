"""Ray's dashboard, measured as ``benchmarks/dashboard.py`` measures convoy's: a one-node Ray cluster started the
way its users start one (``ray start --head``, dashboard included), the RSS and USS of every process of its
dashboard (the head's dashboard server, its module subprocesses, the node's dashboard agent), idle and with 3
browser contexts on its overview page, and their CPU over the same windows. ``ray`` is not a dependency of
convoy: give the ``ray`` executable of an environment that has ``ray[default]`` (``--ray``)."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

START_TIMEOUT_S = 180.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _dashboard_processes() -> list[psutil.Process]:
    """Ray's dashboard processes: their command lines run a file under ray's ``dashboard`` package."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        command = " ".join(proc.info["cmdline"] or [])
        if "/ray/dashboard/" in command or "ray-dashboard" in command:
            found.append(proc)
    return found


def _memory(procs: list[psutil.Process]) -> tuple[float, float]:
    """(RSS, USS) summed, MiB."""
    rss = uss = 0.0
    for proc in procs:
        try:
            info = proc.memory_full_info()
        except psutil.Error:
            continue
        rss, uss = rss + info.rss / 2**20, uss + info.uss / 2**20
    return rss, uss


def _cpu(procs: list[psutil.Process], seconds: float) -> float:
    """Their CPU over a window, % of one core."""
    def total() -> float:
        spent = 0.0
        for proc in procs:
            try:
                spent += sum(proc.cpu_times()[:2])
            except psutil.Error:
                pass
        return spent
    before = total()
    time.sleep(seconds)
    return (total() - before) / seconds * 100


def _wait_up(url: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                if reply.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.5)
    return False


def measure(ray: Path, playwright: Any, chromium: str, window_s: float) -> dict[str, float] | str:
    """The numbers, or why they could not be taken."""
    if not ray.is_file():
        return f"no ray executable at {ray} (give --ray PATH of an environment with ray[default])"
    port = _free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    started = subprocess.run([str(ray), "start", "--head", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                              f"--dashboard-port={port}", "--port", str(_free_port()), "--num-cpus=1",
                              "--disable-usage-stats"], capture_output=True, text=True, env=env,
                             timeout=START_TIMEOUT_S)
    if started.returncode != 0:
        return f"ray start failed ({started.returncode}): {started.stderr.strip()[-300:]}"
    try:
        base = f"http://127.0.0.1:{port}"
        if not _wait_up(base, 60):
            return f"ray's dashboard did not answer at {base} within 60 s"
        time.sleep(5)  # its modules finish starting
        procs = _dashboard_processes()
        rss_idle, uss_idle = _memory(procs)
        cpu_idle = _cpu(procs, window_s)
        browser = playwright.chromium.launch(executable_path=chromium)
        try:
            for _ in range(3):
                page = browser.new_context(viewport={"width": 1280, "height": 860}).new_page()
                page.goto(f"{base}/#/overview")
                page.wait_for_load_state("networkidle", timeout=60_000)
            time.sleep(3)
            procs = _dashboard_processes()
            cpu_pages = _cpu(procs, window_s)
            rss_pages, uss_pages = _memory(procs)
        finally:
            browser.close()
        return {"processes": len(procs), "rss_idle": rss_idle, "uss_idle": uss_idle, "cpu_idle": cpu_idle,
                "rss_pages": rss_pages, "uss_pages": uss_pages, "cpu_pages": cpu_pages,
                "version": subprocess.run([str(ray), "--version"], capture_output=True, text=True).stdout.strip()}
    finally:
        subprocess.run([str(ray), "stop", "--force"], capture_output=True, env=env, timeout=120)
