"""The held-out evaluation: the policy's greedy answers to problems no training prompt asks (``Arithmetic.held_out``),
scored by the task's checker, in batches, through convoy's lookahead decoder (the trainer's: its memory of earlier
answers drafts the next evaluation's) or Hugging Face ``generate`` left-padded; and the reward curve as a PNG."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from convoy.workloads.lookahead.generator import LookaheadGenerator
from convoy.workloads.rl.plot import plot_curve
from convoy.workloads.rlhf.generate import left_padded, prompt_ids
from convoy.workloads.rlhf.task import Prompt

BATCH = 32


def scored(score: Callable[[str, int], float], text: str, answer: int) -> float | None:
    """The reward, None where the reward function raises (the evaluation counts it as 0 and says how many)."""
    try:
        return float(score(text, answer))
    except Exception:  # noqa: BLE001 (any error of the task's function)
        return None


@torch.no_grad()
def held_out_reward(model: Any, tokenizer: Any, prompts: Sequence[Prompt], max_new_tokens: int,
                    score: Callable[[str, int], float], decoder: LookaheadGenerator | None = None) -> tuple[float, int]:
    """The mean reward of the greedy answers (the task's accuracy, for its checker), and how many answers the reward
    function raised on (each counted as 0). ``decoder``: convoy's lookahead decoder over ``model`` (the same
    answers, token for token, in fewer passes where its drafts are accepted), else Hugging Face ``generate``."""
    was_training = model.training
    model.eval()
    total, failed = 0.0, 0
    try:
        for first in range(0, len(prompts), BATCH):
            chunk = prompts[first:first + BATCH]
            rows = [prompt_ids(tokenizer, prompt.text)[0] for prompt in chunk]
            texts = _greedy(model, tokenizer, rows, max_new_tokens, decoder)
            for text, prompt in zip(texts, chunk, strict=True):
                value = scored(score, text, prompt.answer)
                total += value or 0.0
                failed += value is None
    finally:
        model.train(was_training)
    return total / len(prompts), failed


def _greedy(model: Any, tokenizer: Any, rows: list[torch.Tensor], max_new_tokens: int,
            decoder: LookaheadGenerator | None) -> list[str]:
    if decoder is not None:
        texts = decoder.generate([row.tolist() for row in rows], max_new_tokens).texts
        assert texts is not None  # the decoder holds the tokenizer
        return texts
    ids, mask = left_padded(rows, tokenizer.eos_token_id)
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                         pad_token_id=tokenizer.eos_token_id)
    return list(tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True))


def plot_reward(points: Sequence[tuple[int, float]], path: Path, title: str) -> None:
    """Held-out reward (in %) against samples trained on (``points``: (samples, reward in 0..1))."""
    plot_curve([(samples, 100 * value) for samples, value in points], path, title,
               "samples trained on (responses)", "held-out reward (% right)", marker="o")
