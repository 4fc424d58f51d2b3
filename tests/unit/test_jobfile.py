"""The job file: every ``convoy run`` option and the roles from TOML, and each bad key or value refused with the
file, the line and the key (tomllib gives no lines; ``key_lines`` finds them in the text)."""

from __future__ import annotations

from pathlib import Path

import pytest

from convoy.cli.jobfile import JOB_FILE_OPTIONS, key_lines, load_job_file
from convoy.errors import ConfigError
from convoy.roles_config import RESTORE_ONE, RoleCount, RoleSpec


def job_file(tmp_path: Path, text: str, name: str = "job.toml") -> Path:
    (tmp_path / "train.py").write_text("print('hi')\n")
    path = tmp_path / name
    path.write_text(text)
    return path


def error_of(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_job_file(path)
    return str(info.value)


EVERY_OPTION = """\
entrypoint = "train.py"
args = ["--lr", "0.1"]
nnodes = "1:2"
nproc_per_node = 2
max_restarts = 5
run_dir = "runs/a"
host = "0.0.0.0"
port = 29500
rdzv_wait = 1.5
join_timeout = 60
heartbeat_timeout = 20
max_regroups = 4
regroup_window = 120
relaunch = true
stop_grace = 2
preload = ["torch", "numpy"]
module = false
auto_apply = ["nan", "divergence"]
priority = 5
preempt_grace = 3
scheduler = "ray"
address = "10.0.0.1:6379"
placement_timeout = 20
ray_cpus = 2
ray_gpus = 1
ray_memory = "2GiB"
ray_resource = ["trainer_node=1"]

[train]
lr = 0.05
warm = true
name = "a"
"""


def test_every_option_reads_as_the_flag_would(tmp_path: Path) -> None:
    loaded = load_job_file(job_file(tmp_path, EVERY_OPTION))
    assert loaded.options == {
        "script": str(tmp_path / "train.py"), "args": ["--lr", "0.1"], "nnodes": "1:2", "nproc_per_node": 2,
        "max_restarts": 5, "run_dir": tmp_path / "runs" / "a", "host": "0.0.0.0", "port": 29500, "rdzv_wait": 1.5,
        "join_timeout": 60.0, "heartbeat_timeout": 20.0, "max_regroups": 4, "regroup_window": 120.0,
        "relaunch": True, "stop_grace": 2.0, "preload": "torch,numpy", "module": False, "auto_apply": "nan,divergence",
        "priority": 5, "preempt_grace": 3.0, "scheduler": "ray", "address": "10.0.0.1:6379",
        "placement_timeout": 20.0, "ray_cpus": 2.0, "ray_gpus": 1.0, "ray_memory": "2GiB",
        "ray_resource": ["trainer_node=1"], "set": ["lr=0.05", "warm=true", "name=a"],
    }
    assert loaded.roles == ()
    assert set(JOB_FILE_OPTIONS) - {"ps", "workers", "role"} == {line.split(" =")[0] for line in
                                                                EVERY_OPTION.split("[train]")[0].splitlines()
                                                                if line.strip()}


def test_a_module_entrypoint_is_not_a_path(tmp_path: Path) -> None:
    loaded = load_job_file(job_file(tmp_path, 'entrypoint = "json.tool"\nmodule = true\nnnodes = 2\n'))
    assert (loaded.options["script"], loaded.options["nnodes"]) == ("json.tool", "2")


def test_roles_from_tables_and_from_the_flag_keys(tmp_path: Path) -> None:
    (tmp_path / "ps.py").write_text("")
    text = """\
entrypoint = "train.py"
workers = "auto"
role = ["evaluator=1"]

[roles.ps]
entrypoint = "ps.py"
count = 2
memory = "12GiB"
cpus = 1.5

[roles.chief]
"""
    roles = load_job_file(job_file(tmp_path, text)).roles
    assert roles == (
        RoleSpec("ps", entrypoint=str(tmp_path / "ps.py"), count=RoleCount(2, 2), memory_bytes=12 << 30, cpus=1.5),
        RoleSpec("chief"),
        RoleSpec("worker", count=RoleCount(1, None, auto=True)),
        RoleSpec("evaluator"),
    )
    assert roles[0].failure_policy == RESTORE_ONE


def test_key_lines_follow_tables_dotted_and_quoted_keys() -> None:
    text = """\
# a comment
nnodes = 2
[roles.ps]
count = 2
"memory" = "1GiB"
[ roles . "worker" ]
count.extra = 1
doc = '''
fake = 1
'''
after = 3
"""
    lines = key_lines(text)
    assert lines[("nnodes",)] == 2
    assert lines[("roles", "ps")] == 3 and lines[("roles", "ps", "count")] == 4
    assert lines[("roles", "ps", "memory")] == 5
    assert lines[("roles", "worker")] == 6 and lines[("roles", "worker", "count", "extra")] == 7
    assert ("roles", "worker", "fake") not in lines, "a line inside a multi-line string is no key"
    assert lines[("roles", "worker", "after")] == 11


@pytest.mark.parametrize(("text", "expected"), [
    ('entrypoint = "train.py"\nnproc_per_nod = 2\n', ":2: unknown key 'nproc_per_nod': did you mean 'nproc_per_node'?"),
    ('nproc-per-node = 2\n', ":1: unknown key 'nproc-per-node': did you mean 'nproc_per_node'?"),
    ('colour = "red"\n', ":1: unknown key 'colour': a job file takes the `convoy run` options"),
    ('entrypoint = "train.py"\n\nnproc_per_node = 0\n', ":3: nproc_per_node: 0: need 1 or more"),
    ('nproc_per_node = "two"\n', ":1: nproc_per_node: 'two' is not a whole number"),
    ('max_restarts = -1\n', ":1: max_restarts: -1: need 0 or more"),
    ('port = 70000\n', ":1: port: 70000: need 0..65535"),
    ('nnodes = "3:1"\n', ":1: nnodes: --nnodes '3:1': need 1 <= MIN <= MAX"),
    ('nnodes = 1.5\n', ":1: nnodes: 1.5 is not N or 'MIN:MAX'"),
    ('relaunch = "yes"\n', ":1: relaunch: 'yes' is not true or false"),
    ('preload = "torch"\n', ":1: preload: 'torch' is not a list of strings"),
    ('args = "--lr 0.1"\n', ":1: args: '--lr 0.1' is not a list of strings"),
    ('stop_grace = -1\n', ":1: stop_grace: -1: need seconds >= 0"),
    ('join_timeout = 0\n', ":1: join_timeout: 0: need seconds > 0"),
    ('regroup_window = nan\n', ":1: regroup_window: nan is not a number of seconds"),
    ('host = ""\n', ":1: host: '' is not a non-empty string"),
    ('entrypoint = "missing.py"\n', ":1: entrypoint: script '{tmp}/missing.py' not found"),
    ('entrypoint = "no_such_module_xyz"\nmodule = true\n', ":1: entrypoint: module 'no_such_module_xyz' not found"),
    ('nnodes = 2\nnnodes = 3\n', ":2: not valid TOML: Cannot overwrite a value (at line 2"),
    ('nnodes = = 2\n', ":1: not valid TOML: Invalid value (at line 1"),
])
def test_a_bad_option_names_the_file_line_and_key(tmp_path: Path, text: str, expected: str) -> None:
    path = job_file(tmp_path, text)
    assert error_of(path).startswith(f"{path}{expected.format(tmp=tmp_path)}"), error_of(path)


ROLE_ERRORS = [
    ("[roles.worker]\ncount = 0\n", ":2: roles.worker.count: count 0: need at least 1"),
    ("[roles.worker]\ncount = \"4:2\"\n", ":2: roles.worker.count: count 4:2: MIN 4 > MAX 2"),
    ("[roles.ps]\ncount = 1\nmemory = \"12 parsecs\"\n", ":3: roles.ps.memory: memory '12 parsecs' is not a size"),
    ("[roles.worker]\nmem = \"1GiB\"\n", ":2: unknown key 'mem' in [roles.worker]: did you mean 'memory'?"),
    ("[roles.worker]\ncpus = 0\n", ":2: roles.worker.cpus: cpus 0: need a positive number"),
    ("[roles.worker]\ncpus = -4\n", ":2: roles.worker.cpus: cpus -4"),
    ("ps = 2\nentrypoint = \"train.py\"\n[roles.ps]\ncount = 1\n",
     ":1: ps: role 'ps' given twice: by [roles.ps] (line 3) and by ps"),
    ("entrypoint = \"train.py\"\nrole = [\"ps=1\"]\nps = 2\n", ":2: role: role 'ps' given twice: by ps and by role"),
    ("roles.worker.count = 0\n", ":1: roles.worker.count: count 0"),
    ("roles = { worker = { count = \"2:1\" } }\n", ":1: roles.worker.count: count 2:1"),
    ("roles = 3\n", ":1: roles: declare each role as a table, [roles.NAME]"),
    ("[roles]\nworker = 3\n", ":2: roles.worker: declare the role as a table, [roles.worker]"),
    ("[roles.ps]\nentrypoint = \"ps_missing.py\"\n", ":2: roles.ps.entrypoint: script '{tmp}/ps_missing.py' not found"),
    ("role = [\"actor\"]\n", ":1: role: --role 'actor' is not NAME=COUNT"),
    ("workers = 0\n", ":1: workers: count 0: need at least 1"),
    ("workers = \"3:1\"\n", ":1: workers: count 3:1: MIN 3 > MAX 1"),
    ("[roles.\"2x\"]\n", ":1: [roles.2x]: a role name is a letter"),
]


@pytest.mark.parametrize(("text", "expected"), ROLE_ERRORS)
def test_a_bad_role_names_the_file_line_and_key(tmp_path: Path, text: str, expected: str) -> None:
    path = job_file(tmp_path, text)
    assert error_of(path).startswith(f"{path}{expected.format(tmp=tmp_path)}"), error_of(path)


def test_workers_with_no_worker_role_possible_names_the_key(tmp_path: Path) -> None:
    (tmp_path / "ps.py").write_text("")
    path = job_file(tmp_path, 'workers = 3\n[roles.ps]\nentrypoint = "ps.py"\n')
    assert error_of(path).startswith(f"{path}:1: workers: no worker role possible"), error_of(path)
    misplaced = job_file(tmp_path, '[roles.ps]\nentrypoint = "ps.py"\nworkers = 3\n', "misplaced.toml")
    assert error_of(misplaced).startswith(f"{misplaced}:3: unknown key 'workers' in [roles.ps]"), \
        "a key after a table header belongs to the table, as TOML says"


def test_a_job_file_that_cannot_be_read(tmp_path: Path) -> None:
    assert error_of(tmp_path / "absent.toml") == (f"job file '{tmp_path / 'absent.toml'}' cannot be read: "
                                                  "No such file or directory")
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe\x00")
    assert "cannot be read: not UTF-8 text" in error_of(binary)


def test_the_train_table_takes_only_plain_values(tmp_path: Path) -> None:
    message = error_of(job_file(tmp_path, 'entrypoint = "train.py"\n[train]\nlr = [1, 2]\n'))
    assert "train.lr: a value of the training config is a number, a bool or a string (got list)" in message
    assert message.startswith(f"{tmp_path / 'job.toml'}:3: "), message
