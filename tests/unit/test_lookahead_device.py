"""Lookahead decoding on a device other than the CPU, checked without one: the per-device cost prior, inputs made on
the device asked for (the meta device stands in for a GPU), device names refused with a clear error, packing
refused off the CPU, and the KV cache cut with index tensors on the cache's device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from convoy.workloads.lookahead.adaptive import DraftSizer, prior_cost_slope
from convoy.workloads.lookahead.draft import DraftTree
from convoy.workloads.lookahead.errors import DecodingError
from convoy.workloads.lookahead.model import load_model, resolve_device
from convoy.workloads.lookahead.packed import packing_available, use_packing
from convoy.workloads.lookahead.verify import keep_accepted, model_device, pass_inputs, prefill_inputs

META = torch.device("meta")


def tiny_config():
    transformers = pytest.importorskip("transformers")
    return transformers, transformers.LlamaConfig(
        vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, bos_token_id=1, eos_token_id=3, pad_token_id=0)


def test_the_cost_prior_is_much_smaller_on_a_gpu_and_the_sizer_drafts_more_with_it() -> None:
    assert prior_cost_slope("cpu") == 1 / 16
    assert prior_cost_slope("cuda") == 1 / 512
    assert prior_cost_slope("xpu") == prior_cost_slope("cpu")  # not listed: the cautious CPU guess
    chosen = {}
    for device_type in ("cpu", "cuda"):
        sizer = DraftSizer(64, cost_slope=prior_cost_slope(device_type))
        sizer.record_time(0, 0.01)  # only the plain pass timed: every draft size costs the prior
        sizer.gain = {(4, size): accepted for size, accepted in
                      ((2, 1.5), (4, 2.5), (8, 3.5), (16, 4.5), (32, 5.5), (64, 6.0))}
        chosen[device_type] = sizer.choose([4])
    assert chosen == {"cpu": 8, "cuda": 64}  # on a GPU more draft tokens cost (almost) nothing


def tree(tokens: list[int], parents: list[int]) -> DraftTree:
    return DraftTree(tokens=tokens, parents=parents)


@pytest.mark.parametrize("device", [None, torch.device("cpu"), META])
def test_pass_inputs_are_made_on_the_device_asked_for(device: torch.device | None) -> None:
    trees = [tree([7, 8, 9], [-1, 0, 0]), tree([5], [-1])]
    inputs = pass_inputs([4, 6], trees, cache_lens=[5, 3], slots=5, dtype=torch.float32, device=device)
    expected = torch.device("cpu") if device is None else device
    assert inputs.attention_mask is not None
    for tensor in (inputs.input_ids, inputs.position_ids, inputs.attention_mask):
        assert tensor.device == expected
    assert inputs.attention_mask.shape == (2, 1, 4, 9) and inputs.attention_mask.dtype == torch.float32
    plain = pass_inputs([4, 6], [DraftTree(), DraftTree()], [5, 5], 5, torch.float32, device)
    assert plain.attention_mask is None
    assert plain.input_ids.device == plain.position_ids.device == expected
    if expected.type == "cpu":  # values only where they can be read
        host = pass_inputs([4, 6], trees, [5, 3], 5, torch.float32)
        assert torch.equal(inputs.attention_mask, host.attention_mask)
        assert inputs.input_ids.tolist() == [[4, 7, 8, 9], [6, 5, 0, 0]]
        assert inputs.position_ids.tolist() == [[5, 6, 7, 7], [3, 4, 3, 3]]
        assert plain.input_ids.tolist() == [[4], [6]] and plain.position_ids.tolist() == [[5], [5]]


@pytest.mark.parametrize("device", [None, META])
def test_prefill_inputs_are_made_on_the_device_asked_for(device: torch.device | None) -> None:
    expected = torch.device("cpu") if device is None else device
    even = prefill_inputs([[5, 6, 7], [8, 9, 10]], torch.float32, device)
    assert even.attention_mask is None
    ragged = prefill_inputs([[5, 6, 7], [8]], torch.float32, device)
    assert ragged.attention_mask is not None and ragged.attention_mask.shape == (2, 1, 3, 3)
    for tensor in (even.input_ids, even.position_ids, ragged.input_ids, ragged.position_ids, ragged.attention_mask):
        assert tensor.device == expected
    if device is None:
        assert ragged.input_ids.tolist() == [[5, 6, 7], [8, 0, 0]]
        assert ragged.position_ids.tolist() == [[0, 1, 2], [0, 1, 2]]
        seen = (ragged.attention_mask[:, 0] == 0).tolist()
        assert seen[0] == [[True, False, False], [True, True, False], [True, True, True]]
        assert seen[1] == [[True, False, False], [True, False, False], [True, False, False]]  # padding: slot 0


def test_a_device_this_machine_lacks_is_refused_before_any_loading(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_device(None) == resolve_device("cpu") == torch.device("cpu")
    missing = tmp_path / "no-model"  # never read: the device is checked first
    if not torch.cuda.is_available():
        with pytest.raises(DecodingError, match=r"device 'cuda' asked for.*use --device cpu"):
            load_model(str(missing), device="cuda")
    with pytest.raises(DecodingError, match="device 'gpu' is not a device name torch knows"):
        load_model(str(missing), device="gpu")
    with pytest.raises(DecodingError, match="device 'meta': lookahead decoding runs on cpu or cuda devices only"):
        resolve_device("meta")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the index check, as on a one-GPU machine
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda:0") == torch.device("cuda:0") and resolve_device("cuda") == torch.device("cuda")
    with pytest.raises(DecodingError, match=r"device 'cuda:1' does not exist: torch sees 1 CUDA device\(s\), "
                                            r"cuda:0 to cuda:0"):
        load_model(str(missing), device=torch.device("cuda", 1))


def test_load_model_on_the_cpu_keeps_float32(tmp_path: Path) -> None:
    transformers, config = tiny_config()
    tokenizers = pytest.importorskip("tokenizers")
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    vocabulary = {"<unk>": 0, "hello": 1}
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token="<unk>"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>").save_pretrained(tmp_path)
    for device in (None, "cpu", torch.device("cpu")):
        model, _ = load_model(str(tmp_path), device=device)
        assert {(p.device.type, p.dtype) for p in model.parameters()} == {("cpu", torch.float32)}


def test_packing_is_refused_off_the_cpu() -> None:
    assert use_packing(None, torch.device("cpu")) == packing_available()
    assert use_packing(False, torch.device("cpu")) is False
    assert use_packing(None, torch.device("cuda", 0)) is False  # unset: off on a GPU
    assert use_packing(False, META) is False
    with pytest.raises(DecodingError, match="the model is on cuda:0: packing is for CPU float32 weights"):
        use_packing(True, torch.device("cuda", 0))


def test_a_generator_of_a_model_off_the_cpu_refuses_packed_weights() -> None:
    from convoy.workloads.lookahead.generator import LookaheadGenerator

    transformers, config = tiny_config()
    with torch.device("meta"):  # weights with a device but no storage: where the generator looks, not a real run
        model = transformers.LlamaForCausalLM(config).eval()
    assert model_device(model) == META
    with pytest.raises(DecodingError, match="the model is on meta: packing is for CPU float32 weights"):
        LookaheadGenerator(model, pack_weights=True)


def test_a_cpu_generator_uses_the_cpu_prior_and_cpu_inputs() -> None:
    from convoy.workloads.lookahead.generator import LookaheadGenerator

    transformers, config = tiny_config()
    torch.manual_seed(0)
    generator = LookaheadGenerator(transformers.LlamaForCausalLM(config).eval(), decoding_length=8)
    assert generator.device == torch.device("cpu")
    generator.generate([5, 6, 7, 5, 6], max_new_tokens=4)
    assert [sizer.cost_slope for sizer in generator._sizers.values()] == [prior_cost_slope("cpu")]


@pytest.mark.parametrize("device", [torch.device("cpu"), META])
def test_the_cache_cut_keeps_root_and_accepted_nodes_on_the_cache_device(device: torch.device) -> None:
    cache_utils = pytest.importorskip("transformers.cache_utils")

    class Cache:
        layers = [cache_utils.DynamicLayer()]

    layer = Cache.layers[0]
    # two rows, one head, 3 + 1 + 2 slots, dim 1: the value of a slot is 10 * row + slot
    values = (torch.arange(6.0) + 10 * torch.arange(2.0)[:, None]).view(2, 1, 6, 1)
    layer.keys, layer.values = values.to(device), (-values).to(device)
    lens = keep_accepted(Cache(), rows=[0, 1], cache_lens=[3, 2], paths=[[1], []], slots=3)
    assert lens == [5, 3]
    for tensor in (layer.keys, layer.values):
        assert tensor.device == device and tensor.shape == (2, 1, 5, 1)
    if device.type == "cpu":  # row 0: old 0..2, root 3, node 1 at slot 5; row 1: old 0..1, root 3, then zeros
        assert layer.keys.flatten().tolist() == [0, 1, 2, 3, 5, 10, 11, 13, 0, 0]
        assert layer.values.flatten().tolist() == [0, -1, -2, -3, -5, -10, -11, -13, 0, 0]
