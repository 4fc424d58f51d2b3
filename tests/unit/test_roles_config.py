"""Role specs: counts, memory and CPUs parsed from what a file or a flag gives, the failure policy of each
well-known role, command-line counts over declared roles, and every bad input refused with its name."""

from __future__ import annotations

import pytest

from convoy.errors import ConfigError
from convoy.roles_config import (
    DEFAULT_FAILURE_POLICY,
    FAILURE_POLICIES,
    RESTART_JOB,
    RESTART_ONE,
    RESTORE_ONE,
    RoleCount,
    RoleSpec,
    apply_role_counts,
    check_roles,
    parse_count,
    parse_memory,
    parse_role_flag,
    role_counts_from_flags,
    role_from_table,
)


def at_line(key: str) -> str:
    """A stand-in for the job file's locator: it names the key, so a test sees which key an error is placed at."""
    return f"job.toml:<{key}>: "


@pytest.mark.parametrize(("value", "expected"), [
    (4, RoleCount(4, 4)), ("4", RoleCount(4, 4)), ("2:8", RoleCount(2, 8)), (" 3:3 ", RoleCount(3, 3)),
    ("auto", RoleCount(1, None, auto=True)), ("AUTO", RoleCount(1, None, auto=True)),
])
def test_counts_are_n_min_max_or_auto(value: object, expected: RoleCount) -> None:
    count = parse_count(value)
    assert count == expected
    assert parse_count(str(count)) == count, "a count prints as it is written"


@pytest.mark.parametrize(("value", "expected"), [
    (0, "count 0: need at least 1"), ("0", "count 0: need at least 1"), ("0:2", "need at least 1"),
    ("4:2", "MIN 4 > MAX 2"), ("x", "is not N, MIN:MAX or auto"), ("1:2:3", "is not N"), ("-1", "is not N"),
    (True, "count True"), (1.5, "count 1.5"), ("", "is not N"),
])
def test_bad_counts_are_refused_naming_the_count(value: object, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        parse_count(value)


@pytest.mark.parametrize(("value", "expected"), [
    ("12GiB", (12 << 30, False)), ("512MB", (512 * 10**6, False)), ("1.5 gib", (3 << 29, False)),
    ("100B", (100, False)), ("8Mi", (8 << 20, False)), ("2G", (2 * 10**9, False)), ("auto", (None, True)),
])
def test_memory_sizes_with_decimal_or_binary_units(value: str, expected: tuple[int | None, bool]) -> None:
    assert parse_memory(value) == expected


@pytest.mark.parametrize(("value", "expected"), [
    ("12 parsecs", "memory '12 parsecs' is not a size"), ("12", "memory '12' is not a size"),
    ("GiB", "is not a size"), ("-1GiB", "is not a size"), ("0GiB", "need a positive size"),
    (12, "memory 12: give a size with its unit as a string"), (None, "memory None"),
])
def test_bad_memory_is_refused_saying_what_a_size_is(value: object, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        parse_memory(value)


def test_each_well_known_role_has_its_failure_policy() -> None:
    assert RoleSpec("worker").failure_policy == RESTART_ONE, "a worker failure restarts that worker"
    assert RoleSpec("ps").failure_policy == RESTORE_ONE, "a PS failure restores that PS"
    assert RoleSpec("chief").failure_policy == RESTART_JOB, "a chief failure restarts the job"
    assert RoleSpec("actor").failure_policy == RESTART_JOB, "any other role does what a job without roles does"
    assert RoleSpec("worker", failure_policy=RESTART_JOB).failure_policy == RESTART_JOB, "a declared one wins"
    assert set(DEFAULT_FAILURE_POLICY.values()) <= set(FAILURE_POLICIES)


@pytest.mark.parametrize(("spec", "expected"), [
    (RoleSpec("worker", cpus=0.0), "role 'worker': cpus 0.0: need a positive number"),
    (RoleSpec("worker", cpus=-2.0), "cpus -2.0"),
    (RoleSpec("worker", cpus=float("nan")), "cpus nan"),
    (RoleSpec("worker", count=RoleCount(0, 0)), "role 'worker': count 0: need at least 1"),
    (RoleSpec("worker", count=RoleCount(3, 2)), "count 3:2: MIN 3 > MAX 2"),
    (RoleSpec("ps", memory_bytes=0), "role 'ps': memory 0 bytes"),
    (RoleSpec("ps", memory_bytes=10, memory_auto=True), "give auto or a size"),
    (RoleSpec("ps", failure_policy="pray"), "failure_policy 'pray': use one of restart-job"),
    (RoleSpec("9lives"), "role '9lives': a role name is a letter"),
    (RoleSpec("has space"), "a role name is a letter"),
])
def test_a_spec_built_in_python_gets_the_same_checks(spec: RoleSpec, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(")):
        spec.validate()


def test_a_role_table_with_every_key() -> None:
    table = {"entrypoint": "eval.py", "args": ["--shards", "2"], "module": False, "count": "1:3", "memory": "512MB",
             "cpus": 2, "gpus": 1, "failure_policy": "restart-job"}
    spec = role_from_table("evaluator", table, at_line)
    assert spec == RoleSpec("evaluator", entrypoint="eval.py", args=("--shards", "2"), count=RoleCount(1, 3),
                            memory_bytes=512 * 10**6, cpus=2.0, gpus=1, failure_policy=RESTART_JOB)
    assert spec.memory == f"{512 * 10**6}B"


def test_an_empty_role_table_is_one_process_of_the_jobs_script() -> None:
    spec = role_from_table("worker", {}, at_line)
    assert (spec.entrypoint, spec.count, spec.memory_bytes, spec.memory_auto, spec.cpus) == ("", RoleCount(), None,
                                                                                            False, None)
    assert role_from_table("worker", {"memory": "auto"}, at_line).memory_auto


@pytest.mark.parametrize(("table", "expected"), [
    ({"mem": "12GiB"}, "job.toml:<mem>: unknown key 'mem' in [roles.worker]: did you mean 'memory'?"),
    ({"replicas": 2}, "job.toml:<replicas>: unknown key 'replicas' in [roles.worker]: a role takes entrypoint"),
    ({"count": 0}, "job.toml:<count>: roles.worker.count: count 0: need at least 1"),
    ({"count": "4:2"}, "job.toml:<count>: roles.worker.count: count 4:2: MIN 4 > MAX 2"),
    ({"memory": "12 parsecs"}, "job.toml:<memory>: roles.worker.memory: memory '12 parsecs' is not a size"),
    ({"cpus": 0}, "job.toml:<cpus>: roles.worker.cpus: cpus 0: need a positive number"),
    ({"gpus": -1}, "job.toml:<gpus>: roles.worker.gpus: gpus -1: need a whole number of devices"),
    ({"gpus": 0.5}, "job.toml:<gpus>: roles.worker.gpus: gpus 0.5: need a whole number of devices"),
    ({"cpus": -1.5}, "job.toml:<cpus>: roles.worker.cpus: cpus -1.5"),
    ({"cpus": "2"}, "job.toml:<cpus>: roles.worker.cpus: cpus '2'"),
    ({"cpus": True}, "job.toml:<cpus>: roles.worker.cpus: cpus True"),
    ({"failure_policy": "retry"}, "job.toml:<failure_policy>: roles.worker.failure_policy: failure_policy 'retry'"),
    ({"args": "--lr 0.1"}, "job.toml:<args>: roles.worker.args: '--lr 0.1' is not a list of strings"),
    ({"entrypoint": 3}, "job.toml:<entrypoint>: roles.worker.entrypoint: 3 is not a string"),
    ({"module": "yes"}, "job.toml:<module>: roles.worker.module: 'yes' is not true or false"),
])
def test_a_bad_role_table_names_the_key_and_its_place(table: dict[str, object], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        role_from_table("worker", table, at_line)
    assert str(info.value).startswith(expected), str(info.value)


def test_the_ps_count_is_fixed_since_its_layout_is() -> None:
    with pytest.raises(ConfigError, match=r"^role 'ps': count 1:3: give one count; the parameter servers' layout .* "
                                          r"is fixed when the workers set it up$"):
        role_from_table("ps", {"count": "1:3"}, at_line)
    with pytest.raises(ConfigError, match=r"^role 'ps': count auto: give one count"):
        check_roles((RoleSpec("ps", count=parse_count("auto")),), True)


def test_a_bad_role_name_is_placed_at_its_table() -> None:
    with pytest.raises(ConfigError, match=r"job.toml:<>: \[roles.2ps\]: a role name is a letter"):
        role_from_table("2ps", {}, at_line)


@pytest.mark.parametrize(("flag", "expected"), [
    ("actor=4", ("actor", RoleCount(4, 4))), ("learner=1:2", ("learner", RoleCount(1, 2))),
    ("rollout=auto", ("rollout", RoleCount(1, None, auto=True))),
])
def test_role_flags(flag: str, expected: tuple[str, RoleCount]) -> None:
    assert parse_role_flag(flag) == expected


@pytest.mark.parametrize(("flag", "expected"), [
    ("actor", "--role 'actor' is not NAME=COUNT"), ("=4", "--role '=4' is not NAME=COUNT"),
    ("actor=0", "--role 'actor=0': count 0: need at least 1"),
    ("actor=5:2", "--role 'actor=5:2': count 5:2: MIN 5 > MAX 2"),
    ("act or=2", "is not NAME=COUNT"),
])
def test_bad_role_flags_name_the_flag(flag: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        parse_role_flag(flag)


def test_a_flag_overrides_the_count_of_a_declared_role_and_keeps_the_rest() -> None:
    declared = (RoleSpec("ps", count=RoleCount(1, 1), memory_bytes=1 << 30), RoleSpec("worker", entrypoint="w.py"))
    roles = apply_role_counts(declared, [("ps", RoleCount(2, 2), "--ps 2")], job_has_script=False)
    assert roles == (RoleSpec("ps", count=RoleCount(2, 2), memory_bytes=1 << 30), declared[1])


def test_a_flag_adds_a_role_that_runs_the_jobs_script() -> None:
    roles = apply_role_counts((), [("ps", RoleCount(2, 2), "--ps 2"), ("worker", RoleCount(1, None, True),
                                                                       "--workers auto")], job_has_script=True)
    assert [(role.name, str(role.count), role.entrypoint) for role in roles] == [("ps", "2", ""),
                                                                                ("worker", "auto", "")]


def test_workers_with_no_worker_role_possible() -> None:
    declared = (RoleSpec("ps", entrypoint="ps.py"),)
    with pytest.raises(ConfigError, match=r"--workers 4: no worker role possible: the job declares no "
                                          r"\[roles.worker\] and gives no script"):
        apply_role_counts(declared, [("worker", RoleCount(4, 4), "--workers 4")], job_has_script=False)


def test_a_role_given_twice_on_the_command_line() -> None:
    with pytest.raises(ConfigError, match="role 'worker' given twice: by --workers 2 and by --role worker=3"):
        apply_role_counts((), [("worker", RoleCount(2, 2), "--workers 2"), ("worker", RoleCount(3, 3),
                                                                           "--role worker=3")], job_has_script=True)


def test_check_roles_refuses_a_name_twice_and_a_role_with_nothing_to_run() -> None:
    check_roles((RoleSpec("ps", entrypoint="ps.py"), RoleSpec("worker", entrypoint="w.py")), job_has_script=False)
    check_roles((RoleSpec("ps"), RoleSpec("worker")), job_has_script=True)
    with pytest.raises(ConfigError, match="role 'ps' given twice"):
        check_roles((RoleSpec("ps"), RoleSpec("ps", count=RoleCount(2, 2))), job_has_script=True)
    with pytest.raises(ConfigError, match="role 'worker' has no entrypoint and the job gives no script"):
        check_roles((RoleSpec("ps", entrypoint="ps.py"), RoleSpec("worker")), job_has_script=False)
    with pytest.raises(ConfigError, match="role 'worker': cpus 0.0"):
        check_roles((RoleSpec("worker", cpus=0.0),), job_has_script=True)


def test_role_counts_from_flags_keep_the_flag_as_given() -> None:
    counts = role_counts_from_flags({"ps": "2", "workers": None}, ["actor=1:3"])
    assert counts == [("ps", RoleCount(2, 2), "--ps 2"), ("actor", RoleCount(1, 3), "--role actor=1:3")]
    with pytest.raises(ConfigError, match="--workers 'x': count 'x' is not N"):
        role_counts_from_flags({"workers": "x"}, [])
