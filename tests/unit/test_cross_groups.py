"""Groups across roles, the master's side (pure): members in the order the roles are given, a version that moves
with any member, each caller's rank, and who may publish the group's store."""

from __future__ import annotations

import pytest

from convoy.control.roles.groups import CrossGroups
from convoy.errors import ConfigError

ROLES = ["trainer", "rollout"]
KNOWN = ["trainer", "rollout", "store"]


def test_members_their_ranks_and_a_version_that_moves_with_them() -> None:
    groups = CrossGroups()
    before = groups.view("g", ROLES, {"trainer": [0, 1], "rollout": [2], "store": [3]}, KNOWN, ("rollout", 0, 2))
    assert (before.rank, before.world_size, before.members) == (2, 3, ["trainer:0", "trainer:1", "rollout:0"])
    same = groups.view("g", ROLES, {"trainer": [0, 1], "rollout": [2], "store": [9]}, KNOWN, ("trainer", 0, 0))
    assert same.version == before.version and same.rank == 0, "another role's change is not the group's"
    replaced = groups.view("g", ROLES, {"trainer": [0, 5], "rollout": [2]}, KNOWN, ("trainer", 1, 5))
    grown = groups.view("g", ROLES, {"trainer": [0, 1], "rollout": [2, 6]}, KNOWN, ("rollout", 1, 6))
    assert len({before.version, replaced.version, grown.version}) == 3 and grown.rank == 3
    assert groups.view("g", ROLES, {"trainer": [0, 1], "rollout": [2]}, KNOWN, ("store", 0, 3)).rank == -1


def test_only_rank_0_of_the_current_version_publishes_and_only_for_that_version() -> None:
    groups = CrossGroups()
    incarnations = {"trainer": [0, 1], "rollout": [2]}
    first = groups.view("g", ROLES, incarnations, KNOWN, ("trainer", 0, 0))
    with pytest.raises(ConfigError, match="only rank 0 of group 'g' publishes its store"):
        groups.publish(groups.view("g", ROLES, incarnations, KNOWN, ("trainer", 1, 1)), first.version, "h:1")
    with pytest.raises(ConfigError, match="is at version .*, not old: its members changed; join again"):
        groups.publish(first, "old", "h:1")
    groups.publish(first, first.version, "h:1")
    assert groups.view("g", ROLES, incarnations, KNOWN, ("rollout", 0, 2)).address == "h:1"
    grown = groups.view("g", ROLES, {"trainer": [0, 1], "rollout": [2, 3]}, KNOWN, ("rollout", 0, 2))
    assert grown.address == "", "an address is for its version only"


def test_a_role_the_job_lacks_or_named_twice_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"no role 'learner' in this job \(roles: trainer, rollout, store\)"):
        CrossGroups().view("g", ["trainer", "learner"], {}, KNOWN, ("trainer", 0, 0))
    with pytest.raises(ConfigError, match="name each role once"):
        CrossGroups().view("g", ["trainer", "trainer"], {}, KNOWN, ("trainer", 0, 0))
