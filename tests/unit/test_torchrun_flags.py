"""torchrun's flags turned into convoy run's (pure): both spellings, values in either form, convoy's own options
and the script's arguments left as they are; and every flag of torchrun's own parser taken or refused by name."""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import pytest
from torch.distributed.run import determine_local_world_size, get_args_parser

from convoy.cli.main import build_parser
from convoy.cli.options import job_config
from convoy.cli.torchrun import REFUSED, count_devices, nproc_per_node, stop_signals, translate
from convoy.config import JobConfig
from convoy.errors import ConfigError

CPUS = str(len(os.sched_getaffinity(0)))
NO_DEVICES = {"cuda": 0, "xpu": 0, "auto": 0}.__getitem__
"""The device counts of a host without accelerators (what ``count_devices`` finds on this CPU-only host)."""


@pytest.mark.parametrize(("given", "wanted"), [
    (["--standalone", "--nproc_per_node=2", "t.py", "--lr", "1"], ["--nproc-per-node", "2", "t.py", "--lr", "1"]),
    (["--nproc-per-node", "cpu", "t.py"], ["--nproc-per-node", CPUS, "t.py"]),
    (["--nproc-per-node", "auto", "t.py"], ["--nproc-per-node", CPUS, "t.py"]),
    (["--rdzv_backend=c10d", "--rdzv_endpoint=localhost:29411", "--rdzv_id=7", "t.py"],
     ["--port", "29411", "--job-id", "7", "t.py"]),
    (["--master_addr", "127.0.0.1", "--master_port", "29500", "--node_rank", "0", "t.py"],
     ["--master-port", "29500", "t.py"]),
    (["--role", "trainer", "--role", "ps=2", "-r", "3", "-t", "0:3", "--run-path", "--monitor-interval", "5", "t.py"],
     ["--role-name", "trainer", "--role", "ps=2", "--redirects", "3", "--tee", "0:3", "t.py"]),
    (["--rdzv-conf", "join_timeout=60,last_call_timeout=2,read_timeout=9", "t.py"],
     ["--join-timeout", "60", "--rdzv-wait", "2", "t.py"]),
    (["--set", "steps=1", "--run-dir", "r", "--auto-apply", "nan", "--preload", "", "t.py", "--set", "x"],
     ["--set", "steps=1", "--run-dir", "r", "--auto-apply", "nan", "--preload", "", "t.py", "--set", "x"]),
    (["--strategy", "auto", "--nproc_per_node", "2", "t.py"], ["--strategy", "auto", "--nproc-per-node", "2", "t.py"]),
    (["-m", "pkg.train", "--standalone"], ["-m", "pkg.train", "--standalone"]),
    (["--no_python", "./run.sh", "-r", "1"], ["--no-python", "./run.sh", "-r", "1"]),
    (["--start_method=fork", "--event_log_handler", "console", "--duplicate_stdout_filters=", "t.py"], ["t.py"]),
    (["--shutdown_timeout", "7", "--signals_to_handle=SIGTERM,SIGUSR1", "--local_addr", "127.0.0.2", "t.py"],
     ["--stop-grace", "7", "--signals-to-handle", "SIGTERM,SIGUSR1", "--local-addr", "127.0.0.2", "t.py"]),
    # several hosts, the same command on each: convoy's --endpoint (the first to claim it serves the master)
    (["--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.5:29400", "--rdzv-id=7", "t.py"],
     ["--nnodes", "2", "--endpoint", "10.0.0.5:29400", "--job-id", "7", "t.py"]),
    (["--nnodes", "1:4", "--rdzv_endpoint", "node0", "--rdzv-conf", "token=abc,join_timeout=30", "t.py"],
     ["--nnodes", "1:4", "--endpoint", "node0:29400", "--join-token", "abc", "--join-timeout", "30", "t.py"]),
    (["--rdzv-endpoint", "10.0.0.5:29400", "--rdzv-conf", "token_file=/shared/tok", "t.py"],
     ["--endpoint", "10.0.0.5:29400", "--token-file", "/shared/tok", "t.py"]),
    (["--nnodes=2", "--node_rank=1", "--master_addr=10.0.0.5", "--master_port=1234", "t.py"],
     ["--nnodes", "2", "--node-rank", "1", "--endpoint", "10.0.0.5:1234", "t.py"]),
    (["--nnodes", "2", "--node-rank", "0", "--master-addr", "10.0.0.5", "t.py"],
     ["--nnodes", "2", "--node-rank", "0", "--endpoint", "10.0.0.5:29500", "t.py"]),
])
def test_torchrun_flags_become_convoys(given: list[str], wanted: list[str]) -> None:
    assert translate(given, devices=NO_DEVICES) == wanted


@pytest.mark.parametrize(("given", "named"), [
    (["--nnodes", "2", "--rdzv-endpoint", "10.0.0.5:port"], "--rdzv-endpoint 10.0.0.5:port"),
    (["--nnodes", "2", "--node-rank", "first", "--master-addr", "h"], "--node-rank first"),
    (["--rdzv-conf", "tokn=abc"], "--rdzv-conf tokn"),
    (["--nnodes", "2", "--standalone"], "--standalone runs one node"),
    (["--rdzv-backend", "etcd-v2"], "--rdzv-backend etcd-v2"),
    (["--tee", "2"], "--tee 2"),
    (["--nproc-per-node", "gpu"], "--nproc-per-node gpu: this host has no CUDA device"),
    (["--nproc-per-node", "xpu"], "--nproc-per-node xpu: this host has no XPU device"),
    (["--nproc-per-node", "many"], "--nproc-per-node 'many'"),
    (["--master-port", "0"], "--master-port 0"),
    (["--monitor-interval", "-1"], "--monitor-interval -1"),
    (["--rdzv-id"], "--rdzv-id needs a value"),
    (["--start-method", "thread"], "--start-method thread"),
    (["--event-log-handler", "kafka"], "--event-log-handler kafka"),
    (["--duplicate-stdout-filters", "loss"], "--duplicate-stdout-filters loss"),
    (["--duplicate_stderr_filters", "nan,,inf"], "--duplicate-stderr-filters nan,,inf"),
    (["--signals-to-handle", "SIGTERM,SIGFOO"], "--signals-to-handle SIGFOO"),
    (["--signals-to-handle", "SIGKILL"], "--signals-to-handle SIGKILL"),
    (["--signals-to-handle", "SIGCHLD"], "--signals-to-handle SIGCHLD"),
    (["--shutdown-timeout", "soon"], "--shutdown-timeout soon"),
    (["--logs-specs", "mine"], "--logs-specs"),
    (["--numa_binding", "node"], "--numa-binding"),
    (["--virtual_local_rank"], "--virtual-local-rank"),
])
def test_a_flag_that_cannot_be_honoured_is_named(given: list[str], named: str) -> None:
    with pytest.raises(ConfigError) as refused:
        translate([*given, "t.py"] if given != ["--rdzv-id"] else given, devices=NO_DEVICES)
    assert named in str(refused.value) and "\n" not in str(refused.value)


def test_devices_count_for_gpu_xpu_and_auto() -> None:
    eight_gpus = {"cuda": 8, "xpu": 0, "auto": 8}.__getitem__
    assert translate(["--nproc-per-node", "gpu", "t.py"], devices=eight_gpus)[:2] == ["--nproc-per-node", "8"]
    assert translate(["--nproc-per-node", "auto", "t.py"], devices=eight_gpus)[:2] == ["--nproc-per-node", "8"]
    four_xpus = {"cuda": 0, "xpu": 4, "auto": 4}.__getitem__
    assert translate(["--nproc-per-node", "xpu", "t.py"], devices=four_xpus)[:2] == ["--nproc-per-node", "4"]


@pytest.mark.parametrize("value", ["3", "cpu", "auto", "gpu", "xpu"])
def test_nproc_per_node_counts_what_torchrun_counts_on_this_host(value: str) -> None:
    """torchrun's own count (its determine_local_world_size) against convoy's, on this host's real devices;
    a value this host cannot give (gpu without CUDA) is refused by both."""
    try:
        theirs: int | None = determine_local_world_size(value)
    except ValueError:
        theirs = None
    try:
        ours: int | None = nproc_per_node(value, count_devices)
    except ConfigError:
        ours = None
    assert ours == theirs


def test_stop_signals_are_torchruns_list_by_name() -> None:
    assert stop_signals("SIGTERM,SIGINT,SIGHUP,SIGQUIT") == [signal.SIGTERM, signal.SIGINT, signal.SIGHUP,
                                                            signal.SIGQUIT]
    assert stop_signals(" SIGUSR1 , SIGUSR2") == [signal.SIGUSR1, signal.SIGUSR2]


# --- every flag of torchrun's own --help, read from torch's parser ---

TORCHRUN = get_args_parser()
OPTIONS = {option: action for action in TORCHRUN._actions for option in action.option_strings}
"""Each spelling of each torchrun option (``--nproc-per-node`` and ``--nproc_per_node`` both) -> its action."""
EXAMPLES = {"master_port": "29500", "shutdown_timeout": "5", "log_dir": "logs", "local_addr": "127.0.0.1",
            "logs_specs": "default"}
"""A value for the options whose torchrun default is None (any other option gets its default, or first choice)."""


def torchrun_value(action: argparse.Action) -> list[str]:
    """A value torchrun takes for the option: its default, else its first choice, else an example of its type."""
    if action.nargs == 0:
        return []
    if action.choices:
        return [str(next(iter(action.choices)))]
    if isinstance(action.default, list):
        return [",".join(action.default)]
    if action.default is not None:
        return [str(action.default)]
    return [EXAMPLES.get(action.dest, "1")]


def convoy_run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> JobConfig | ConfigError | str:
    """What ``convoy run ARGV`` makes of a command line before it starts anything: the job, the refusal, or what
    argparse printed as it exited (help, or an error)."""
    try:
        translated = translate(argv, devices=NO_DEVICES)
        args = build_parser("run").parse_args(["run", *translated])
        config, _ = job_config(args, translated)
        config.validate()
        return config
    except ConfigError as refused:
        return refused
    except SystemExit as exited:
        captured = capsys.readouterr()
        return f"exit {exited.code}: {captured.out}{captured.err}"


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_every_torchrun_flag_is_taken_or_refused_by_name(option: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Given a value torchrun takes, each spelling of each flag of torchrun's own parser is taken (a job), or refused
    in one line that names the flag and says why (REFUSED); never argparse's "unrecognized arguments"."""
    action = OPTIONS[option]
    script = tmp_path / "train.py"
    script.write_text("")
    script.chmod(0o755)
    argv = [option, *torchrun_value(action), "json" if action.dest == "module" else str(script)]
    outcome = convoy_run(argv, capsys)
    dashed = "--" + action.dest.replace("_", "-")
    if isinstance(action, argparse._HelpAction):
        assert isinstance(outcome, str) and outcome.startswith("exit 0: usage: convoy run"), outcome
    elif dashed in REFUSED:
        assert isinstance(outcome, ConfigError), f"{argv}: {outcome}"
        assert str(outcome).startswith(dashed) and "\n" not in str(outcome), outcome
    else:
        assert isinstance(outcome, JobConfig), f"{argv}: {outcome}"


def test_refused_flags_are_torchruns_and_say_why() -> None:
    """Each refusal names a flag torchrun has, and what to do instead."""
    assert set(REFUSED) <= {"--" + action.dest.replace("_", "-") for action in OPTIONS.values()}
    for flag, why in REFUSED.items():
        assert len(why) > 40 and "\n" not in why, (flag, why)


@pytest.mark.parametrize(("flags", "field", "value"), [
    (["--shutdown-timeout", "7"], "stop_grace_s", 7.0),
    (["--shutdown_timeout", "0"], "stop_grace_s", 0.0),
    (["--max_restarts", "5"], "max_restarts", 5),
    (["--nproc-per-node", "cpu"], "nproc_per_node", int(CPUS)),
])
def test_a_taken_flag_sets_what_torchrun_sets(flags: list[str], field: str, value: object, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    config = convoy_run([*flags, str(script)], capsys)
    assert isinstance(config, JobConfig), config
    assert getattr(config.workers, field, getattr(config.master, field, None)) == value
