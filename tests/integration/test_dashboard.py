"""The dashboard in a real headless Chromium against one real 2-node job, shared by the checks of this module (in
order): the login link, refusals without the cookie or token, the job's pages, the loss chart growing, a new round
within 2 s of a worker's SIGKILL, ``convoy dashboard`` over several run dirs, and the abort button ending the job."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest
from helpers import Launched, ProcessScope, wait_for

pytestmark = pytest.mark.slow
EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "train_live_config.py")
CHROMIUM = "/usr/bin/chromium"
LINK = r"dashboard at (http://127\.0\.0\.1:\d+)/\?code=(\S+)"


class Job:
    def __init__(self, scope: ProcessScope, launched: Launched, run_dir: Path, base: str, code: str) -> None:
        self.scope, self.launched, self.run_dir, self.base, self.code = scope, launched, run_dir, base, code
        self.token = (run_dir / "token").read_text().strip()


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    tmp = tmp_path_factory.mktemp("dashboard")
    scope = ProcessScope(tmp)
    run_dir = tmp / "run"
    launched = scope.start(["run", "--nnodes", "2", "--nproc-per-node", "1", "--run-dir", run_dir, "--stop-grace",
                            "2", "--set", "steps=100000", EXAMPLE, "--step-time", "0.05"])
    try:
        match = launched.wait_output(LINK, 60)
        yield Job(scope, launched, run_dir, match.group(1), match.group(2))
    finally:
        scope.kill_all()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: `make setup` installs Debian's chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def page(job: Job, browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(20_000)
    page.on("pageerror", lambda error: print(f"page error: {error}"))  # shown with a failing check's output
    yield page
    context.close()


def fetch(url: str, method: str = "GET", headers: dict[str, str] | None = None,
          body: bytes | None = None) -> tuple[int, dict[str, Any] | str]:
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            code, text = reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        code, text = exc.code, exc.read().decode()
    try:
        return code, json.loads(text)
    except ValueError:
        return code, text


def new_code(job: Job) -> str:
    code, reply = fetch(f"{job.base}/ui/code", "POST", {"Authorization": f"Bearer {job.token}"})
    assert code == 200, reply
    return str(reply["url"])  # type: ignore[index]


def test_the_login_link_opens_a_session_once(job: Job, page: Any) -> None:
    page.goto(f"{job.base}/?code={job.code}")
    page.wait_for_selector("body[data-ready='1']")
    assert "code=" not in page.url, "the code stays out of the URL after the login"
    cookie, = [c for c in page.context.cookies() if c["name"] == "convoy_session"]
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert page.inner_text("#job-status") == "running"
    code, text = fetch(f"{job.base}/?code={job.code}")
    assert code == 401 and "used already" in str(text)
    code, text = fetch(f"{job.base}/?code=not-a-code")
    assert code == 401 and "unknown login code" in str(text)
    fresh = urllib.parse.urlsplit(new_code(job))
    connection = http.client.HTTPConnection(fresh.netloc, timeout=10)
    connection.request("GET", f"/?{fresh.query}")
    reply = connection.getresponse()
    assert reply.status == 303 and reply.getheader("Location") == "/" and "HttpOnly" in reply.getheader("Set-Cookie")
    connection.close()


def test_requests_without_the_cookie_or_token_get_401(job: Job, page: Any) -> None:
    for path in ("/", "/ui/api/jobs", "/static/app.js", "/v1/status"):
        code, reply = fetch(job.base + path)
        assert code == 401, (path, reply)
    code, reply = fetch(f"{job.base}/ui/api/jobs", headers={"Cookie": "convoy_session=forged"})
    assert code == 401 and "unknown session" in reply["error"]  # type: ignore[index]
    session = {"Cookie": f"convoy_session={page.context.cookies()[0]['value']}", "Content-Type": "application/json"}
    key = json.loads(page.evaluate("JSON.stringify(app.key)"))
    abort = f"{job.base}/ui/api/jobs/{key}/abort"
    code, reply = fetch(abort, "POST", {**session, "Origin": "http://evil.example"}, b"{}")
    assert code == 403 and "cross-site" in reply["error"]  # type: ignore[index]
    code, reply = fetch(abort, "POST", {**session, "Origin": job.base}, b"{}")
    assert code == 403 and "X-Convoy-CSRF" in reply["error"]  # type: ignore[index]
    code, reply = fetch(f"{job.base}/ui/api/jobs/nope/overview", headers=session)
    assert code == 404 and "no job 'nope'" in reply["error"]  # type: ignore[index]
    code, reply = fetch(f"{job.base}/v1/status", headers={"Authorization": f"Bearer {job.token}"})
    assert code == 200 and reply["status"] == "running", "the master keeps serving"  # type: ignore[index]


def test_the_pages_show_the_two_node_job(job: Job, page: Any) -> None:
    page.click("#tab-nodes")
    page.wait_for_selector("#page-nodes")
    wait_for(lambda: page.inner_text("#page-nodes").count("alive") == 2, 10, "both nodes alive in the table")
    text = page.inner_text("#page-nodes")
    assert "local0" in text and "local1" in text, text
    page.click("#tab-overview")
    assert page.inner_text("#o-world-size") == "2"
    page.click("#tab-rounds")
    wait_for(lambda: page.locator("#timeline rect[data-round='round 1']").count() == 1, 10, "round 1 drawn")
    page.click("#tab-events")
    page.wait_for_selector("#event-kind option[value='node_joined']", state="attached")
    page.select_option("#event-kind", "node_joined")
    rows = lambda: page.inner_text("#event-rows")  # noqa: E731
    wait_for(lambda: rows().count("node_joined") == 2 and "round_closed" not in rows(), 10, "only node_joined events")
    page.select_option("#event-kind", "")


def test_the_loss_chart_grows_as_steps_arrive(job: Job, page: Any) -> None:
    page.click("#tab-metrics")
    points = lambda: int(page.get_attribute("#chart-loss svg", "data-points") or 0)  # noqa: E731
    wait_for(lambda: points() > 0, 30, "the first loss points")
    first = points()
    wait_for(lambda: points() >= first + 10, 10, "ten more loss points without a reload")
    assert page.locator("#chart-loss g.series").count() == 2, "one line per rank"


def test_a_killed_worker_shows_as_a_new_round_within_2_s(job: Job, page: Any) -> None:
    page.click("#tab-overview")
    assert page.inner_text("#job-round") == "1"
    agent, = [proc for proc in psutil.Process(job.launched.pid).children() if "local1" in proc.cmdline()]
    server = int(agent.cmdline()[agent.cmdline().index("--fork-server") + 1].partition(":")[2])
    workers = psutil.Process(server).children()  # forked from the fork server the launcher started for the node
    assert workers, "no worker process found"
    killed = time.monotonic()
    os.kill(workers[0].pid, signal.SIGKILL)
    wait_for(lambda: page.inner_text("#job-round") == "2", 10, "round 2 on the page", interval=0.02)
    took = time.monotonic() - killed
    assert took <= 2.0, f"the new round showed {took:.2f} s after the kill"


def test_convoy_dashboard_serves_several_run_dirs(job: Job, browser: Any, tmp_path: Path) -> None:
    empty = tmp_path / "not-a-job"
    empty.mkdir()
    index = job.scope.start(["dashboard", "--run-dirs", job.run_dir, empty])
    try:
        match = index.wait_output(LINK.replace("dashboard at", r"dashboard of 2 run dir\(s\) at"), 30)
        context = browser.new_context()
        page = context.new_page()
        page.goto(f"{match.group(1)}/?code={match.group(2)}")
        page.wait_for_selector("#page-index")
        text = page.inner_text("#page-index")
        assert "holds no convoy job" in text and "running" in text
        session = {"Cookie": f"convoy_session={context.cookies()[0]['value']}"}
        code, reply = fetch(f"{match.group(1)}/ui/api/jobs/dir2/overview", headers=session)
        assert code == 404 and "not a job" in reply["error"]  # type: ignore[index]
        page.click("#page-index a")
        page.wait_for_selector("body[data-ready='1']")
        assert page.inner_text("#job-status") == "running"
        context.close()
    finally:
        index.proc.send_signal(signal.SIGTERM)
        assert index.wait(10).returncode == 0


def test_the_abort_button_ends_the_job(job: Job, page: Any) -> None:
    page.click("#tab-overview")
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#abort")
    result = job.launched.wait(60)
    assert result.returncode == 1, result.explain()
    wait_for(lambda: page.inner_text("#job-status") == "failed", 10, "the job shown as failed")
    assert not job.scope.wait_no_leftovers(10), "processes left after the abort"
    assert re.search(r"aborted from the dashboard by dashboard session \w+ from 127\.0\.0\.1", result.stdout)
