"""What a user types first: ``convoy --version``; a command whose optional extra is missing says which to install,
in one line; and ``convoy run`` works with none of the extras (their modules made unimportable here, as in an
environment where only ``pip install convoy`` ran)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import ProcessScope

import convoy
from convoy.control.store import read_status

EXTRA_MODULES = ("transformers", "gguf", "safetensors", "accelerate", "lightgbm", "sklearn", "xgboost",
                 "cryptography", "matplotlib", "psutil", "hypothesis")


def without_extras(tmp_path: Path) -> dict[str, str]:
    """An environment in which importing any extra's module fails as if it were not installed."""
    blocked = tmp_path / "blocked"
    for name in EXTRA_MODULES:
        (blocked / name).mkdir(parents=True)
        (blocked / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{name}'\", name={name!r})\n")
    return {"PYTHONPATH": str(blocked)}


def test_version(procs: ProcessScope) -> None:
    result = procs.run(["--version"], timeout=30)
    assert result.returncode == 0 and result.stdout.strip() == f"convoy {convoy.__version__}", result.explain()


@pytest.mark.parametrize(("argv", "extra", "module"), [
    (["gbdt", "train", "--data", "rows.csv", "--model", "m.json"], "gbdt", "lightgbm"),
    (["decode", "--prompt-file", "prompt.txt"], "llm", "transformers"),
])
def test_a_command_without_its_extra_names_the_extra(procs: ProcessScope, tmp_path: Path, argv: list[str],
                                                     extra: str, module: str) -> None:
    (tmp_path / "rows.csv").write_text("a,b,target\n1,2,3\n4,5,6\n")
    (tmp_path / "prompt.txt").write_text("hello\n")
    result = procs.run(argv, timeout=60, env=without_extras(tmp_path))
    assert result.returncode == 2, result.explain()
    assert result.stderr == (f"convoy: error: convoy {argv[0]} needs {module}, which is not installed: pip install "
                             f"'convoy[{extra}]'\n"), result.explain()


@pytest.mark.slow
def test_convoy_run_needs_no_extra(procs: ProcessScope, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import torch, convoy\nctx = convoy.init()\nt = torch.ones(1)\n"
                      "torch.distributed.all_reduce(t)\nconvoy.report(0, loss=float(t))\n"
                      "print('sum', int(t.item()), flush=True)\n")
    result = procs.run(["run", "--nproc-per-node", "2", "--run-dir", tmp_path / "run", script], timeout=120,
                       env=without_extras(tmp_path))
    assert result.returncode == 0, result.explain()
    assert result.stdout.count("sum 2") == 2, result.explain()
    lines = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    recorded = read_status(tmp_path / "run", recent=10_000)["events"]
    assert [(e["kind"], e["message"]) for e in lines] == [(e["kind"], e["message"]) for e in recorded]
    assert lines[-1]["kind"] == "job_succeeded", "every event is a JSON line of RUN_DIR/events.jsonl too"
