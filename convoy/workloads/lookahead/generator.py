"""``LookaheadGenerator``: greedy decoding that drafts multi-branch continuations from token tries and verifies them
in one forward pass, so it emits exactly what greedy decoding would, in fewer passes."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from convoy.workloads.lookahead.errors import DecodingError
from convoy.workloads.lookahead.adaptive import DraftSizer, prior_cost_slope
from convoy.workloads.lookahead.draft import DraftTree, build_draft
from convoy.workloads.lookahead.packed import PackedLinears, use_packing
from convoy.workloads.lookahead.trie import TokenTrie
from convoy.workloads.lookahead.verify import (
    LazyPredictions, cache_argument, cache_tensors, chain_length, greedy_walk, keep_accepted, model_device, new_cache,
    pass_inputs, prefill_inputs, split_head,
)


@dataclass
class DecodeStats:
    """What one ``generate`` call did."""

    requests: int = 0
    new_tokens: int = 0
    passes: int = 0  # forward passes after the prompt's (one per step of every row together)
    row_passes: int = 0  # passes summed over rows (a row finished early stops counting)
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens accepted
    seconds: float = 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Tokens each row got per pass: 1 for plain greedy decoding."""
        return (self.new_tokens - self.requests) / self.row_passes if self.row_passes else 1.0  # minus the prefill's

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0


@dataclass
class Generation:
    """New tokens per request (prompt not included; EOS included when reached), their text, and the stats."""

    tokens: list[list[int]]
    texts: list[str] | None
    stats: DecodeStats


class LookaheadGenerator:
    """Lossless lookahead decoding with a Hugging Face causal LM (greedy; output equals ``generate(do_sample=False)``).

    Drafts come from a per-request trie of the prompt and the output so far, and from a memory trie of earlier
    outputs (``memory_nodes`` cap, ``decay`` per request). ``decoding_length`` bounds the draft tokens per pass,
    ``branch_length`` their depth, ``max_match`` the context suffix matched. With ``adaptive`` the draft size per
    pass follows measured acceptance and pass time, down to plain decoding when drafting does not pay.
    ``pack_weights`` (default: where this torch build can) runs the float32 linear layers on copies of their
    weights packed for oneDNN while decoding, which makes a pass of a few tokens cheaper on CPU (``packed.py``); it
    is off for a model on a GPU. Every input is made on the model's device (``device``, its first parameter's).
    """

    def __init__(self, model: Any, tokenizer: Any = None, *, decoding_length: int = 64, branch_length: int = 16,
                 max_match: int = 4, memory_nodes: int = 500_000, decay: float = 0.8, adaptive: bool = True,
                 eos_token_id: int | Sequence[int] | None = None, pack_weights: bool | None = None) -> None:
        for name, value, low in (("decoding_length", decoding_length, 0), ("branch_length", branch_length, 1),
                                 ("max_match", max_match, 1), ("memory_nodes", memory_nodes, 1)):
            if value < low:
                raise DecodingError(f"{name} must be >= {low}, got {value}")
        self.model, self.tokenizer = model, tokenizer
        self.cache_argument = cache_argument(model)
        config = getattr(model, "config", None)
        if config is None or getattr(config, "is_encoder_decoder", False):
            raise DecodingError(f"{type(model).__name__} is not a decoder-only causal LM with a config; "
                                "load one with transformers.AutoModelForCausalLM")
        self.context_length = getattr(config, "max_position_embeddings", None)
        self.eos = _eos_ids(model, tokenizer, eos_token_id)
        self.decoding_length, self.branch_length, self.max_match = decoding_length, branch_length, max_match
        self.adaptive = adaptive
        self.window = max_match + branch_length
        self.memory = TokenTrie(self.window, max_nodes=memory_nodes, decay=decay)
        self._sizers: dict[int, DraftSizer] = {}
        self.device = model_device(model)
        self.packed = PackedLinears.of(model) if use_packing(pack_weights, self.device) else None
        self._split = split_head(model)
        self._decoder_cache_argument = cache_argument(self._split[0]) if self._split else ""

    def generate(self, prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]] | torch.Tensor,
                 max_new_tokens: int = 128, attention_mask: torch.Tensor | None = None) -> Generation:
        """Decode greedily for one prompt or a batch: text (needs the tokenizer), token ids, or an ``input_ids``
        tensor (left or right padding marked by ``attention_mask``)."""
        rows = self._token_rows(prompts, attention_mask)
        if max_new_tokens < 1:
            raise DecodingError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        for index, row in enumerate(rows):
            if not row:
                raise DecodingError(f"prompt {index} is empty; give at least one token")
            if self.context_length and len(row) + max_new_tokens > self.context_length:
                raise DecodingError(f"prompt {index} has {len(row)} tokens; with max_new_tokens={max_new_tokens} "
                                    f"that exceeds the model's context of {self.context_length} tokens; shorten the "
                                    "prompt or lower max_new_tokens")
        started = time.perf_counter()
        with torch.inference_mode(), self.packed or contextlib.nullcontext():
            tokens, stats = self._decode(rows, max_new_tokens)
        stats.seconds = time.perf_counter() - started
        texts = None
        if self.tokenizer is not None:
            texts = [self.tokenizer.decode(row, skip_special_tokens=True) for row in tokens]
        return Generation(tokens, texts, stats)

    def _decode(self, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], DecodeStats]:
        stats = DecodeStats(requests=len(prompts))
        sizer = self._sizers.get(len(prompts))
        if sizer is None:
            sizer = self._sizers[len(prompts)] = DraftSizer(self.decoding_length,
                                                            cost_slope=prior_cost_slope(self.device.type))
        sizer.reset()
        sequences = [list(prompt) for prompt in prompts]
        outputs: list[list[int]] = [[] for _ in prompts]
        tries = []
        for prompt in prompts:
            trie = TokenTrie(self.window)
            trie.insert_windows(prompt)
            tries.append(trie)
        cache = new_cache(self.model)
        roots = self._prefill(cache, prompts)
        cache_lens = [len(prompt) for prompt in prompts]
        live = []  # rows still decoding, in cache batch order
        for row, root in enumerate(roots):
            if self._emit(row, [root], sequences, outputs, max_new_tokens, tries):
                live.append(row)
        while live:
            started = time.perf_counter()
            fulls = []
            for row in live:
                full = build_draft((tries[row], self.memory), sequences[row], self.decoding_length,
                                   self.branch_length, self.max_match)
                sizer.propose(row, len(sequences[row]), full)
                fulls.append(full)
            size = sizer.choose([full.match_length for full in fulls]) if self.adaptive else self.decoding_length
            trees = []
            for row, full in zip(live, fulls, strict=True):
                room = max_new_tokens - len(outputs[row]) - 1  # the bonus token always comes on top
                trees.append(full.truncate(min(size, room)) if room > 0 else DraftTree())
            predictions = self._verify(cache, [sequences[row][-1] for row in live], trees, cache_lens)
            paths, still = [], []
            for index, (row, tree) in enumerate(zip(live, trees, strict=True)):
                path, bonus = greedy_walk(predictions[index], tree)
                paths.append(path)
                stats.row_passes += 1
                stats.drafted += len(tree)
                stats.accepted += len(path)
                if self._emit(row, [tree.tokens[node] for node in path] + [bonus], sequences, outputs,
                              max_new_tokens, tries):
                    still.append(index)
                sizer.observe(row, sequences[row], finished=index not in still)
            stats.passes += 1
            if still:
                cache_lens = keep_accepted(cache, still, cache_lens, paths, max(cache_lens))
            live = [live[index] for index in still]
            if self.device.type == "cuda":  # the cache cut above runs asynchronously: charge it to this pass
                torch.cuda.synchronize(self.device)
            sizer.record_time(max(len(tree) for tree in trees), time.perf_counter() - started)
        for output in outputs:
            self.memory.insert_windows(output)
            stats.new_tokens += len(output)
        self.memory.new_epoch()
        return outputs, stats

    def _emit(self, row: int, new: list[int], sequences: list[list[int]], outputs: list[list[int]],
              max_new_tokens: int, tries: list[TokenTrie]) -> bool:
        """Append a row's new tokens, cut at EOS and ``max_new_tokens``; return whether the row goes on."""
        new = new[:max_new_tokens - len(outputs[row])]
        for index, token in enumerate(new):
            if token in self.eos:
                new = new[:index + 1]
                break
        before = len(sequences[row])
        sequences[row].extend(new)
        outputs[row].extend(new)
        tries[row].insert_windows(sequences[row], known=before)
        return len(outputs[row]) < max_new_tokens and not (new and new[-1] in self.eos)

    def _forward(self, cache: Any, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 attention_mask: torch.Tensor | None) -> torch.Tensor:
        kwargs = {self.cache_argument: cache, "use_cache": True, "position_ids": position_ids}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        return self.model(input_ids=input_ids, **kwargs).logits

    def _prefill(self, cache: Any, prompts: list[list[int]]) -> list[int]:
        """Run the prompts (right-padded), fill the cache; the greedy first token of each."""
        inputs = prefill_inputs(prompts, self.model.dtype, self.device)
        logits = self._forward(cache, inputs.input_ids, inputs.position_ids, inputs.attention_mask)
        cache_tensors(cache)  # refuse caches we cannot cut back before any drafting
        last = torch.stack([logits[row, len(prompt) - 1] for row, prompt in enumerate(prompts)])
        return last.argmax(-1).tolist()  # one wait for the device, not one per row

    def _verify(self, cache: Any, roots: list[int], trees: list[DraftTree], cache_lens: list[int]) -> list[Any]:
        """One pass; per row, the greedy choice after each of its inputs (indexable by input position)."""
        slots = max(cache_lens)
        inputs = pass_inputs(roots, trees, cache_lens, slots, self.model.dtype, self.device)
        if self._split is None:
            logits = self._forward(cache, inputs.input_ids, inputs.position_ids, inputs.attention_mask)
            return logits.argmax(-1).tolist()
        decoder, head = self._split
        kwargs = {self._decoder_cache_argument: cache, "use_cache": True, "position_ids": inputs.position_ids}
        if inputs.attention_mask is not None:
            kwargs["attention_mask"] = inputs.attention_mask
        hidden = decoder(input_ids=inputs.input_ids, **kwargs).last_hidden_state
        predictions = LazyPredictions(hidden, head, 1 + max(chain_length(tree) for tree in trees))
        return [predictions.row(index) for index in range(len(trees))]

    def _token_rows(self, prompts: Any, attention_mask: torch.Tensor | None) -> list[list[int]]:
        if isinstance(prompts, torch.Tensor):
            if prompts.dim() != 2:
                raise DecodingError(f"input_ids must be [batch, length], got shape {tuple(prompts.shape)}")
            if attention_mask is None:
                return [row.tolist() for row in prompts]
            return [row[keep.bool()].tolist() for row, keep in zip(prompts, attention_mask, strict=True)]
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], str)):
            if self.tokenizer is None:
                raise DecodingError("text prompts need a tokenizer: LookaheadGenerator(model, tokenizer)")
            texts = [prompts] if isinstance(prompts, str) else list(prompts)
            return [self.tokenizer(text, add_special_tokens=True)["input_ids"] for text in texts]
        if isinstance(prompts, Sequence) and prompts and all(isinstance(token, int) for token in prompts):
            return [list(prompts)]
        if isinstance(prompts, Sequence) and prompts:
            return [list(row) for row in prompts]
        raise DecodingError("no prompt given: pass text, token ids, a list of either, or an input_ids tensor")


def _eos_ids(model: Any, tokenizer: Any, eos_token_id: int | Sequence[int] | None) -> set[int]:
    """The tokens that end a sequence, as ``generate`` would take them (generation config, then tokenizer)."""
    if eos_token_id is None:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos_token_id is None and tokenizer is not None:
        eos_token_id = getattr(tokenizer, "eos_token_id", None)
    if eos_token_id is None:
        raise DecodingError("neither the model's generation config nor the tokenizer names an EOS token; pass "
                            "eos_token_id= so decoding knows where a sequence ends")
    return {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
