"""Pipeline timelines: the PNG from simulated and measured spans, and ``convoy pipeline plan``."""

from __future__ import annotations

import builtins
from pathlib import Path

import pytest

from convoy.cli.main import main
from convoy.cli.pipeline import PIPELINE_SCHEDULES
from convoy.errors import ConfigError
from convoy.parallel.pipeline.schedule import GENERATORS, Action, Kind, build
from convoy.parallel.pipeline.simulate import Span, simulate
from convoy.parallel.pipeline.timeline import draw, draw_schedule

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _is_png(path: Path) -> bool:
    data = path.read_bytes()
    return data.startswith(PNG_MAGIC) and len(data) > 5000


@pytest.mark.parametrize("name", list(GENERATORS))
def test_draw_schedule_writes_a_png(tmp_path: Path, name: str) -> None:
    out = draw_schedule(build(name, 4, 8), tmp_path / f"{name}.png")
    assert out == tmp_path / f"{name}.png" and _is_png(out)


def test_draw_takes_simulated_spans_and_a_str_path(tmp_path: Path) -> None:
    result = simulate(build("1f1b", 2, 4))
    out = draw(result.spans, str(tmp_path / "t.png"), title="1f1b", n_ranks=2)
    assert isinstance(out, Path) and _is_png(out)


def test_draw_takes_measured_spans_made_by_hand(tmp_path: Path) -> None:
    t = 1.7e9  # wall-clock seconds, as a runtime would record them
    spans = [
        Span(0, Action(Kind.F, 0, 0, peer=1), t, t + 0.01),
        Span(1, Action(Kind.H, 0, 0, peer=0), t + 0.001, t + 0.009),
        Span(0, Action(Kind.SEND_F, 0, 0), t + 0.01, t + 0.011),  # not compute: skipped
        Span(1, Action(Kind.F, 1, 0), t + 0.012, t + 0.02),
        Span(1, Action(Kind.I, 1, 0), t + 0.02, t + 0.03),
        Span(1, Action(Kind.W, 1, 0), t + 0.03, t + 0.04),
        Span(0, Action(Kind.B, 0, 0), t + 0.032, t + 0.05),
    ]
    assert _is_png(draw(spans, tmp_path / "measured.png", n_ranks=3))
    assert _is_png(draw([], tmp_path / "empty.png", n_ranks=2))


def test_missing_matplotlib_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: object, **kwargs: object) -> object:
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ConfigError, match=r"pip install 'convoy\[plot\]'"):
        draw([], tmp_path / "x.png")


def test_unwritable_path_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="writable"):
        draw([], tmp_path / "no" / "such" / "dir" / "x.png")


def test_cli_knows_every_generator() -> None:
    assert tuple(GENERATORS) == PIPELINE_SCHEDULES


def test_plan_prints_the_grid_and_writes_the_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "plan.png"
    assert main(["pipeline", "plan", "--ranks", "3", "--microbatches", "6", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "1f1b: 3 stages on 3 ranks, 6 micro-batches" in out
    for rank in range(3):
        assert f"rank {rank}: {rank}F0" in out
    assert "SEND_F" not in out
    assert "makespan" in out and "bubble" in out and "peak activations" in out
    assert f"wrote {png}" in out and _is_png(png)


def test_plan_defaults_to_1f1b_in_the_current_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["pipeline", "plan", "--comms", "--comm", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "rank 3:" in out and "0SEND_F0" in out and "3RECV_F0" in out
    assert _is_png(tmp_path / "pipeline-1f1b.png")


def test_plan_all_compares_and_writes_one_png_each(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pipeline", "plan", "--schedule", "all", "--png", str(tmp_path / "cmp.png")]) == 0
    out = capsys.readouterr().out
    assert "schedule       stages  makespan" in out
    for name in ("gpipe", "1f1b", "interleaved2", "two-group"):
        assert f"\n{name} " in out
    for name in PIPELINE_SCHEDULES:
        assert _is_png(tmp_path / f"cmp-{name}.png")
    assert len(list(tmp_path.iterdir())) == 4


@pytest.mark.parametrize("argv, message", [
    (["--ranks", "0"], "at least 1 rank"),
    (["--microbatches", "0"], "at least 1 micro-batch"),
    (["--schedule", "interleaved", "--microbatches", "6", "--ranks", "4"], "not a multiple of 4"),
    (["--schedule", "all", "--microbatches", "6", "--ranks", "4"], "not a multiple of 4"),
    (["--forward", "0"], "--forward"),
])
def test_bad_plans_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       argv: list[str], message: str) -> None:
    assert main(["pipeline", "plan", "--png", str(tmp_path / "p.png"), *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.err.startswith("convoy: error: ")
    assert message in captured.err
    assert captured.out == "" and not list(tmp_path.iterdir())  # nothing printed or written before the check


def test_pipeline_needs_a_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["pipeline"])
    assert exc.value.code == 2
