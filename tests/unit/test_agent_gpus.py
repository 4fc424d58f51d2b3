"""The GPUs an agent hands out, found without torch: CUDA_VISIBLE_DEVICES first, else the driver's devices; a role
asking for more per process than a local job's host has is refused before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from convoy.agent.gpus import check_local_gpus, node_gpus, visible_devices
from convoy.errors import ConfigError


def test_visible_devices_are_taken_as_listed_up_to_a_minus_one(tmp_path: Path) -> None:
    assert node_gpus({"CUDA_VISIBLE_DEVICES": "2, 3,-1,4"}, tmp_path, tmp_path) == ["2", "3"]
    assert node_gpus({"CUDA_VISIBLE_DEVICES": "GPU-8f1c,GPU-77aa"}, tmp_path, tmp_path) == ["GPU-8f1c", "GPU-77aa"]
    assert node_gpus({"CUDA_VISIBLE_DEVICES": ""}, tmp_path, tmp_path) == [], "an empty list hides every device"


def test_without_the_variable_the_drivers_devices_count(tmp_path: Path) -> None:
    driver, dev = tmp_path / "gpus", tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "null"):
        (dev / name).touch()
    assert node_gpus({}, driver, dev) == ["0", "1"], "no driver folder: /dev's nvidiaN entries"
    driver.mkdir()
    for bus in ("0000:17:00.0", "0000:65:00.0", "0000:ca:00.0"):
        (driver / bus).mkdir()
    assert node_gpus({}, driver, dev) == ["0", "1", "2"], "the driver's list when it has one"
    assert node_gpus({}, tmp_path / "none", tmp_path / "none") == []


def test_a_process_sees_the_devices_at_the_indices_it_was_handed() -> None:
    assert visible_devices(["4", "5", "6"], [2, 0]) == "6,4"
    assert visible_devices(["4", "5"], []) == ""


def test_a_role_asking_more_gpus_than_the_host_has_is_one_line() -> None:
    check_local_gpus([("trainer", 2), ("ps", 0)], {"CUDA_VISIBLE_DEVICES": "0,1"})
    with pytest.raises(ConfigError, match=r"^role 'trainer': gpus 2: each process takes 2 GPU\(s\) and this host has 1 "
                                          r"\(CUDA_VISIBLE_DEVICES='3'\); lower the role's gpus"):
        check_local_gpus([("ps", 0), ("trainer", 2)], {"CUDA_VISIBLE_DEVICES": "3"})
