"""The GRPO job's settings: what cannot run is refused at the start, naming the setting and what to do."""

from __future__ import annotations

import pytest

from convoy.errors import ConfigError
from convoy.workloads.rlhf.config import GRPOConfig, reward_function


@pytest.mark.parametrize(("changes", "named"), [
    ({"capacity": 3, "groups_per_step": 4}, "capacity 3 < groups_per_step 4: the store could never hold one step's"),
    ({"low": 9, "high": 2}, "low 9 > high 2"),
    ({"reward": "no_colon"}, "give it as module:function"),
    ({"reward": "convoy_no_such_module:score"}, "cannot be imported"),
    ({"reward": "convoy.errors:ConfigError.__doc__"}, "cannot be imported"),
])
def test_settings_that_cannot_run_are_refused_by_name(changes: dict[str, object], named: str) -> None:
    cfg = GRPOConfig(**changes)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=named.replace("(", "\\(")):
        cfg.validate()


def test_a_reward_function_is_found_by_its_module_and_name() -> None:
    assert reward_function("convoy.workloads.rlhf.task:reward")("7", 7) == 1.0
    assert GRPOConfig().scorer() is None, "the task's checker by default"
    with pytest.raises(ConfigError, match="is not a function"):
        reward_function("convoy.workloads.rlhf.task:HELD_OUT_EVERY")
