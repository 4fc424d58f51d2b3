"""convoy.role(): the role a process reads from its environment, and the env the agent writes for it."""

from __future__ import annotations

import pytest

from convoy.errors import ConfigError
from convoy.worker.role_env import role, role_env


def test_the_agent_env_and_role_agree() -> None:
    env = role_env("worker", 2, 4, {"ps": ["10.0.0.1:7000", "10.0.0.2:7000"], "worker": []})
    info = role(env)
    assert (info.name, info.rank, info.world_size) == ("worker", 2, 4)
    assert info.peers("ps") == ("10.0.0.1:7000", "10.0.0.2:7000")
    with pytest.raises(ConfigError, match=r"no addresses of role 'learner'.*roles with addresses: ps"):
        info.peers("learner")


def test_outside_convoy_a_script_is_the_one_default_role_or_torchruns_rank() -> None:
    assert role({}) == role({"ROLE_NAME": "default", "ROLE_RANK": "0", "ROLE_WORLD_SIZE": "1"})
    assert (role({"RANK": "3", "WORLD_SIZE": "8"}).rank, role({"RANK": "3", "WORLD_SIZE": "8"}).world_size) == (3, 8)


@pytest.mark.parametrize(("env", "message"), [
    ({"ROLE_RANK": "x", "ROLE_WORLD_SIZE": "2"}, "not whole numbers"),
    ({"ROLE_RANK": "2", "ROLE_WORLD_SIZE": "2"}, "outside ROLE_WORLD_SIZE 2"),
    ({"CONVOY_ROLE_ADDRESSES": "[1, 2]"}, "not a JSON object"),
])
def test_a_broken_role_env_is_a_clear_error(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        role(env)


def test_convoy_role_is_the_function_even_after_the_module_is_imported() -> None:
    import convoy
    import convoy.worker.role_env

    assert convoy.role({"ROLE_NAME": "ps", "ROLE_RANK": "1", "ROLE_WORLD_SIZE": "2"}).name == "ps"
    assert convoy.role is convoy.worker.role_env.role
