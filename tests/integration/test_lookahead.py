"""Lookahead decoding is lossless: on a tiny random Llama, token for token what greedy ``generate`` gives, for many
prompts, EOS and ``max_new_tokens`` inside an accepted draft, and a batch of 3; bad input gets a clear error."""

from __future__ import annotations

import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from convoy.workloads.lookahead.errors import DecodingError  # noqa: E402
from convoy.workloads.lookahead.generator import LookaheadGenerator  # noqa: E402

EOS = 3


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=48, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=EOS, pad_token_id=0)
    return transformers.LlamaForCausalLM(config).eval()


def greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int, eos: int = EOS) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_random_prompts_decode_exactly_as_greedy_and_drafts_get_accepted(model: torch.nn.Module) -> None:
    rng = random.Random(1)
    generator = LookaheadGenerator(model, decoding_length=16, branch_length=6)
    fixed = LookaheadGenerator(model, decoding_length=12, branch_length=4, adaptive=False)
    whole_logits = LookaheadGenerator(model, decoding_length=12, branch_length=4, adaptive=False, pack_weights=False)
    assert generator.packed is not None and whole_logits.packed is None  # packed weights (this CPU build) and stock
    assert fixed._split is not None  # Llama's logits are lm_head(decoder): the head runs on reachable nodes only
    whole_logits._split = None  # the path for models where they are not: logits for every input
    accepted = 0
    for trial in range(24):
        period = [rng.randrange(4, 48) for _ in range(rng.randrange(2, 9))]
        prompt = (period * 8)[:rng.randrange(1, 50)] if trial % 3 else [rng.randrange(4, 48) for _ in range(20)]
        max_new = rng.randrange(1, 70)
        expected = greedy(model, prompt, max_new)
        for decoder in (generator, fixed, whole_logits):
            result = decoder.generate(prompt, max_new_tokens=max_new)
            assert result.tokens == [expected], f"trial {trial}: prompt {prompt}, max_new_tokens {max_new}"
            accepted += result.stats.accepted
    assert accepted > 100  # the drafts did real work (a random model loops, and loops repeat spans)


def test_eos_and_max_new_tokens_inside_an_accepted_draft(model: torch.nn.Module) -> None:
    prompt = [5, 9, 14, 22, 31, 40]
    output = greedy(model, prompt, 40, eos=-1)  # no EOS: the full 40 tokens
    stop = next(i for i in range(8, 40) if output[i] not in output[:i])  # a token first seen well inside the output
    decoder = LookaheadGenerator(model, decoding_length=32, branch_length=32, adaptive=False,
                                 eos_token_id=output[stop])
    decoder.memory.insert_windows(output)  # an earlier answer: the whole continuation is drafted at once
    result = decoder.generate(prompt, max_new_tokens=40)
    assert result.tokens == [greedy(model, prompt, 40, eos=output[stop])] == [output[:stop + 1]]
    assert result.stats.passes == 1 and result.stats.accepted >= stop  # EOS came inside the accepted draft
    capped = LookaheadGenerator(model, decoding_length=32, branch_length=32, adaptive=False, eos_token_id=-1)
    capped.memory.insert_windows(output)
    result = capped.generate(prompt, max_new_tokens=7)
    assert result.tokens == [output[:7]] and result.stats.passes == 1


def test_a_batch_of_three_equals_each_prompt_alone(model: torch.nn.Module) -> None:
    rng = random.Random(7)
    prompts = [[rng.randrange(4, 48) for _ in range(length)] for length in (4, 23, 11)]
    prompts[1] = (prompts[1][:5] * 5)[:23]  # one row drafts a lot, the others little: ragged caches
    decoder = LookaheadGenerator(model, decoding_length=16, branch_length=6, adaptive=False)
    result = decoder.generate(prompts, max_new_tokens=45)
    assert result.tokens == [greedy(model, prompt, 45) for prompt in prompts]
    padded = torch.zeros(3, 23, dtype=torch.long)
    mask = torch.zeros(3, 23, dtype=torch.long)
    for row, prompt in enumerate(prompts):  # a left-padded input_ids tensor, as a tokenizer gives for a batch
        padded[row, 23 - len(prompt):] = torch.tensor(prompt)
        mask[row, 23 - len(prompt):] = 1
    assert decoder.generate(padded, max_new_tokens=45, attention_mask=mask).tokens == result.tokens


def test_bad_input_gets_a_clear_error(model: torch.nn.Module) -> None:
    decoder = LookaheadGenerator(model)
    with pytest.raises(DecodingError, match="prompt 0 is empty"):
        decoder.generate([[]])
    with pytest.raises(DecodingError, match="no prompt given"):
        decoder.generate([])
    with pytest.raises(DecodingError, match="exceeds the model's context of 256 tokens"):
        decoder.generate([5] * 250, max_new_tokens=10)
    with pytest.raises(DecodingError, match="max_new_tokens must be >= 1"):
        decoder.generate([5, 6], max_new_tokens=0)
    with pytest.raises(DecodingError, match="need a tokenizer"):
        decoder.generate("some text")
    with pytest.raises(DecodingError, match="decoding_length must be >= 0"):
        LookaheadGenerator(model, decoding_length=-1)
    no_eos = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        eos_token_id=None, bos_token_id=None, pad_token_id=None))
    no_eos.generation_config.eos_token_id = None
    with pytest.raises(DecodingError, match="names an EOS token"):
        LookaheadGenerator(no_eos)

    class NoCache(torch.nn.Module):
        config = model.config

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return input_ids

    with pytest.raises(DecodingError, match="takes no KV cache"):
        LookaheadGenerator(NoCache())
