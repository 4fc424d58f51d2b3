"""One verification pass: the root token and its draft tree through the model at once, greedy acceptance, and the
KV cache cut back to what was accepted.

The batch layout: row ``b`` of the KV cache holds its ``cache_lens[b]`` tokens in slots ``0..cache_lens[b]-1``; the
slots after that are stale and masked out. A pass appends ``1 + max draft`` slots to every row.

Inputs are put together on the host and sent to the model's device once per pass, without waiting for it (a
host-to-device copy that does not synchronise); the additive mask is made on the device from a boolean one (one
byte an entry crosses, not four). The one wait a pass needs is for the argmax of its logits (``.tolist()``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from convoy.workloads.lookahead.errors import DecodingError
from convoy.workloads.lookahead.draft import DraftTree


def cache_argument(model: torch.nn.Module) -> str:
    """The keyword the model's forward takes its KV cache by (transformers renamed it), or a clear error."""
    parameters = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    raise DecodingError(f"{type(model).__name__}.forward takes no KV cache (no 'cache' or 'past_key_values' "
                        "argument); lookahead decoding needs a causal LM with KV cache support")


def new_cache(model: torch.nn.Module) -> Any:
    """An empty dynamic KV cache for ``model``."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:
        return DynamicCache()


def model_device(model: torch.nn.Module) -> torch.device:
    """Where the model takes its inputs: the device of its first parameter (CPU for a model with none)."""
    parameters = getattr(model, "parameters", None)
    first = next(iter(parameters()), None) if callable(parameters) else None
    return first.device if first is not None else torch.device("cpu")


def cache_tensors(cache: Any) -> list[tuple[Any, str]]:
    """Every (holder, attribute) pair that holds a [batch, heads, slots, dim] key or value tensor of ``cache``."""
    if not hasattr(cache, "layers"):
        raise DecodingError(f"KV cache {type(cache).__name__} has no per-layer tensors; use transformers >= 5")
    holders = []
    for layer in cache.layers:
        if type(layer).__name__ != "DynamicLayer":
            raise DecodingError(f"KV cache layer {type(layer).__name__} is not a full dynamic cache (sliding-window "
                                "or quantised caches cannot drop rejected draft entries); use a model with full "
                                "attention")
        holders.extend([(layer, "keys"), (layer, "values")])
    return holders


@dataclass
class PassInputs:
    """What one verification pass feeds the model."""

    input_ids: torch.Tensor  # [batch, 1 + width]
    position_ids: torch.Tensor  # [batch, 1 + width]
    attention_mask: torch.Tensor | None  # [batch, 1, 1 + width, slots + 1 + width], additive; None: plain causal


def prefill_inputs(prompts: Sequence[Sequence[int]], dtype: torch.dtype,
                   device: torch.device | None = None) -> PassInputs:
    """Inputs for the prompts' pass, right-padded on ``device``: a 4-D additive mask only when lengths differ
    (padding sees no real token of its row and no real token sees padding)."""
    longest = max(len(prompt) for prompt in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, :len(prompt)] = torch.tensor(prompt)
    positions = torch.arange(longest, device=device).expand(len(prompts), longest)
    mask = None
    if any(len(prompt) < longest for prompt in prompts):
        causal = torch.ones(longest, longest, dtype=torch.bool).tril()
        allowed = causal.expand(len(prompts), longest, longest).clone()
        for row, prompt in enumerate(prompts):
            allowed[row, :, len(prompt):] = False
            allowed[row, len(prompt):, 0] = True  # padding queries see one slot; their output is ignored
        mask = additive_mask(allowed, dtype, device)[:, None]
    return PassInputs(_to(ids, device), positions, mask)


def pass_inputs(roots: Sequence[int], trees: Sequence[DraftTree], cache_lens: Sequence[int], slots: int,
                dtype: torch.dtype, device: torch.device | None = None) -> PassInputs:
    """Inputs for one pass, on ``device``: each row's root, then its draft tree; each token sees the row's cached
    tokens, the root and its own ancestors, at position ``cache_len + depth``."""
    width = max(len(tree) for tree in trees)
    batch = len(roots)
    ids = torch.zeros(batch, 1 + width, dtype=torch.long)
    positions = torch.zeros(batch, 1 + width, dtype=torch.long)
    plain = width == 0 and all(length == slots for length in cache_lens)
    if plain:  # one token per row over full rows: the model's own causal mask is exact (and the fastest path)
        ids[:, 0] = torch.tensor(list(roots))
        positions[:, 0] = torch.tensor(list(cache_lens))
        return PassInputs(_to(ids, device), _to(positions, device), None)
    allowed = torch.zeros(batch, 1 + width, slots + 1 + width, dtype=torch.bool)
    for row, (root, tree, length) in enumerate(zip(roots, trees, cache_lens, strict=True)):
        ids[row, 0] = root
        positions[row] = length
        allowed[row, :, :length] = True
        allowed[row, :, slots] = True  # everything sees the root
        if len(tree):
            ids[row, 1:1 + len(tree)] = torch.tensor(tree.tokens)
            positions[row, 1:1 + len(tree)] += torch.tensor(tree.depths())
            for node in range(len(tree)):
                allowed[row, 1 + node, [slots + 1 + a for a in tree.ancestors(node)]] = True
        for pad in range(1 + len(tree), 1 + width):  # unused tail: sees only itself (its output is ignored)
            allowed[row, pad, :] = False
            allowed[row, pad, slots + pad] = True
    mask = additive_mask(allowed, dtype, device)
    return PassInputs(_to(ids, device), _to(positions, device), mask.unsqueeze(1))


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """0 where ``allowed`` (a host boolean tensor), the dtype's lowest value elsewhere, made on ``device``."""
    allowed = _to(allowed, device)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


def _to(tensor: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """``tensor`` (on the host) on ``device``, copied without waiting for the device; itself when already there."""
    return tensor if device is None else tensor.to(device, non_blocking=True)


def split_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """``(decoder, output head)`` when the model's logits are exactly ``head(decoder(x))``, so a pass can run the
    head (a vocabulary-sized matrix: a large share of a small model's cost per token) only on the draft nodes the
    greedy walk can reach; None when that does not hold (logit scaling, soft-capping, exotic heads)."""
    try:
        decoder, head = model.get_decoder(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError, ValueError):
        return None
    if decoder is model or not isinstance(head, torch.nn.Linear):
        return None
    probe = torch.arange(3, device=model_device(model)).view(1, 3) % head.out_features
    with torch.inference_mode():
        full = model(input_ids=probe, use_cache=False).logits
        hidden = decoder(input_ids=probe, use_cache=False).last_hidden_state
        if not torch.equal(full, head(hidden)):
            return None
    return decoder, head


def chain_length(tree: DraftTree) -> int:
    """How many leading nodes form one branch from the root (node i the child of node i - 1): the best branch."""
    length = 0
    while length < len(tree) and tree.parents[length] == length - 1:
        length += 1
    return length


class LazyPredictions:
    """The greedy choice after each input of a pass, per row: the head runs at once on the first ``ready`` inputs
    (root + best branch) and on the rest only if some walk leaves the best branch."""

    def __init__(self, hidden: torch.Tensor, head: torch.nn.Module, ready: int) -> None:
        self.hidden, self.head = hidden, head
        self.rows = head(hidden[:, :ready]).argmax(-1).tolist()
        self.complete = ready >= hidden.shape[1]

    def row(self, index: int) -> _Row:
        return _Row(self, index)

    def fill(self) -> None:
        if not self.complete:
            rest = self.head(self.hidden[:, len(self.rows[0]):]).argmax(-1).tolist()
            self.rows = [done + more for done, more in zip(self.rows, rest, strict=True)]
            self.complete = True


class _Row:
    def __init__(self, predictions: LazyPredictions, index: int) -> None:
        self.predictions, self.index = predictions, index

    def __getitem__(self, query: int) -> int:
        if query >= len(self.predictions.rows[self.index]):
            self.predictions.fill()
        return self.predictions.rows[self.index][query]


def greedy_walk(predictions: Sequence[int], tree: DraftTree) -> tuple[list[int], int]:
    """Follow the tree along the model's greedy choices; ``predictions[q]`` is the argmax after input ``q``
    (0 = root, 1 + i = node i). Returns the accepted node indices and the next (bonus) token."""
    children = tree.children_by_token()
    path, query = [], 0
    while True:
        choice = predictions[query]
        node = children[query].get(choice)  # children[0] are the root's, children[1 + i] node i's
        if node is None:
            return path, choice
        path.append(node)
        query = node + 1


def keep_accepted(cache: Any, rows: Sequence[int], cache_lens: Sequence[int], paths: Sequence[Sequence[int]],
                  slots: int) -> list[int]:
    """Cut the cache back to the rows in ``rows`` (indices into the current batch), each keeping its old tokens,
    its root and its accepted draft nodes, in that order. Returns the new ``cache_lens``."""
    holders = cache_tensors(cache)
    new_lens = [cache_lens[row] + 1 + len(paths[row]) for row in rows]
    new_slots = max(new_lens)
    contiguous = (list(rows) == list(range(len(cache_lens)))
                  and all(cache_lens[row] == slots and list(paths[row]) == list(range(len(paths[row])))
                          for row in rows))
    if contiguous:  # the common single-sequence case: the accepted entries already follow the old ones
        for holder, name in holders:
            setattr(holder, name, getattr(holder, name)[:, :, :new_slots])
        return new_lens
    sources = [torch.tensor([slots] + [slots + 1 + node for node in paths[row]]) for row in rows]
    on_device: dict[torch.device, list[torch.Tensor]] = {}  # the slot indices, sent once to each cache device
    for holder, name in holders:
        tensor = getattr(holder, name)
        if tensor.device not in on_device:
            on_device[tensor.device] = [_to(source, tensor.device) for source in sources]
        kept = tensor.new_zeros(len(rows), tensor.shape[1], new_slots, tensor.shape[3])  # stale slots: finite
        for out, (row, source) in enumerate(zip(rows, on_device[tensor.device], strict=True)):
            length = cache_lens[row]
            kept[out, :, :length] = tensor[row, :, :length]
            kept[out, :, length:length + len(source)] = tensor[row, :, source]
        setattr(holder, name, kept)
    return new_lens
