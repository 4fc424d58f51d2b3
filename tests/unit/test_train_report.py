"""``convoy.report`` through a real agent API and JobMaster: the points reach the master's SQLite status with
their metrics and the process's memory, the sender's sends carry many steps each, and bad input is a
ConfigError naming what is wrong, before anything is recorded."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

import pytest

from convoy.agent.local_api import ClientPool, LocalApi
from convoy.config import MasterConfig, RendezvousConfig
from convoy.control.master import JobMaster
from convoy.control.protocol.client import MasterClient
from convoy.control.training.status_store import read_metrics
from convoy.errors import ConfigError
from convoy.worker import agent_link
from convoy.worker import report as train_report


@pytest.fixture
def reporting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[JobMaster]:
    """A master, an agent API forwarding to it, and this process linked to that agent as rank 0 of the round."""
    config = MasterConfig(host="127.0.0.1", port=0, run_dir=tmp_path / "run", rendezvous=RendezvousConfig(1, 1, 0, 60))
    config.validate()
    master = JobMaster(config, console=lambda line: None)
    master.start()
    host, port = master.api.address
    api = LocalApi(ClientPool(lambda: MasterClient(host, port, master.token, 5.0)).forward).start()
    for name, value in {**api.env(), "ROLE_NAME": "default", "ROLE_RANK": "0", "ROLE_WORLD_SIZE": "1",
                        "CONVOY_ROUND": str(master.job.round_id), "CONVOY_RUN_DIR": str(tmp_path / "run")}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(agent_link, "_link", None)
    monkeypatch.setattr(agent_link, "_link_made", False)
    monkeypatch.setattr(train_report, "_reporter", None)
    monkeypatch.setattr(train_report, "_last_report", None)
    yield master
    if train_report._reporter is not None:
        train_report._reporter.refused = "the test ended"  # its thread (a daemon) sends nothing more
    api.stop()
    master.stop()


def rows(master: JobMaster, count: int) -> list[dict[str, object]]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = read_metrics(master.config.run_dir, "default:0")
        if len(found) >= count:
            return found
        time.sleep(0.05)
    raise AssertionError(f"the master holds {len(found)} of {count} points")


def test_points_reach_the_master_with_their_metrics_in_few_sends(reporting: JobMaster) -> None:
    for step in range(30):
        train_report.report(step, loss=1.0 / (step + 1), samples=8, grad_norm=0.5, accuracy=step / 30)
        time.sleep(0.01)
    reporter = train_report._reporter
    assert reporter is not None and reporter.flush(10)
    found = rows(reporting, 30)
    assert [row["step"] for row in found] == list(range(30))
    assert found[4]["loss"] == pytest.approx(0.2) and found[4]["metrics"] == {"accuracy": pytest.approx(4 / 30)}
    assert found[-1]["grad_norm"] == 0.5 and found[-1]["memory_bytes"] > 10 * 2**20
    assert found[-1]["samples_per_s"] > 0
    assert reporter.sends < 10, f"{reporter.sends} sends for 30 steps: the points are not batched"


def test_a_numpy_or_tensor_integer_is_a_step(reporting: JobMaster) -> None:
    import numpy
    import torch

    train_report.report(numpy.int64(0), loss=numpy.float32(0.5))
    train_report.report(torch.tensor(1), loss=torch.tensor(0.25))
    reporter = train_report._reporter
    assert reporter is not None and reporter.flush(10)
    assert [(row["step"], row["loss"]) for row in rows(reporting, 2)] == [(0, 0.5), (1, 0.25)]


@pytest.mark.parametrize(("args", "kwargs", "words"), [
    ((-1,), {}, "step=-1 is not a whole number"),
    ((True,), {}, "step=True is not a whole number"),
    ((2.0,), {}, "step=2.0 is not a whole number"),
    ((2**63,), {}, "step=9223372036854775808 is not a whole number from 0 to 2..62"),
    ((3,), {"loss": "low"}, "loss='low' is not a number"),
    ((3,), {"lr": [0.1]}, r"lr=\[0.1\] is not a number"),
    ((3,), {f"m{i}": i for i in range(33)}, "33 metrics given; at most 32"),
    ((3,), {"x" * 65: 1.0}, "is over 64 characters"),
])
def test_bad_input_is_a_config_error_and_records_nothing(reporting: JobMaster, args: tuple[object, ...],
                                                           kwargs: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        train_report.report(*args, **kwargs)  # type: ignore[arg-type]
    reporter = train_report._reporter
    assert reporter is not None and not reporter.points
