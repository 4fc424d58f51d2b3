"""convoy's own messages through ``logging``: info to stdout, warnings and errors to stderr, the level from
``setup`` or ``$CONVOY_LOG_LEVEL`` (and handed to the job's children through it)."""

from __future__ import annotations

import os

import pytest

from convoy import log


@pytest.fixture(autouse=True)
def _level_back() -> object:
    saved = os.environ.get(log.LEVEL_ENV)
    yield
    if saved is None:
        os.environ.pop(log.LEVEL_ENV, None)
    else:
        os.environ[log.LEVEL_ENV] = saved
    log.setup("info")


def test_info_goes_to_stdout_warnings_and_errors_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    log.setup("info")
    log.debug("convoy: a detail")
    log.info("convoy: round 1: 2 nodes")
    log.warning("convoy agent n0: cannot write the lease")
    log.error("convoy: error: bad input")
    out, err = capsys.readouterr()
    assert out == "convoy: round 1: 2 nodes\n"
    assert err == "convoy agent n0: cannot write the lease\nconvoy: error: bad input\n"


def test_the_level_hides_what_is_below_it_and_children_inherit_it(capsys: pytest.CaptureFixture[str]) -> None:
    log.setup("warning")
    assert os.environ[log.LEVEL_ENV] == "warning"
    log.info("hidden")
    log.warning("shown")
    assert capsys.readouterr() == ("", "shown\n")
    os.environ[log.LEVEL_ENV] = "error"
    log.setup()  # a child: no flag, the launcher's level
    log.warning("hidden too")
    log.error("only this")
    assert capsys.readouterr() == ("", "only this\n")


def test_debug_shows_details_with_time_and_level(capsys: pytest.CaptureFixture[str]) -> None:
    log.setup("debug")
    log.debug("convoy agent n0: joined job j1")
    out = capsys.readouterr().out
    assert out.endswith(" DEBUG convoy agent n0: joined job j1\n") and out[:4].isdigit(), out


def test_an_unknown_level_in_the_environment_falls_back_to_info(capsys: pytest.CaptureFixture[str]) -> None:
    os.environ[log.LEVEL_ENV] = "chatty"
    log.setup()
    log.info("shown")
    assert capsys.readouterr().out == "shown\n"
    assert os.environ[log.LEVEL_ENV] == "info"
