"""Bucketed weights: a model packed into a few flat buffers and unpacked into another copy is bit for bit the same
(the digests agree), a model of > 1,000 small tensors still makes a few buckets, and a rollout's model that does
not match is refused naming the parameter."""

from __future__ import annotations

import pytest
import torch

from convoy.errors import ConfigError
from convoy.workloads.rlhf.buckets import Manifest, digest


def model(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(100, 16, generator=gen), "norm": torch.randn(16, generator=gen).to(torch.bfloat16),
            "layer.w": torch.randn(16, 16, generator=gen), "head": torch.randn(16, 100, generator=gen),
            "step": torch.tensor([seed], dtype=torch.int64)}


def test_packed_and_unpacked_weights_are_bit_for_bit_the_same() -> None:
    trainer, rollout = model(1), model(2)
    manifest = Manifest.of(trainer, bucket_bytes=4096)
    buckets = manifest.pack(trainer)
    assert len(buckets) < len(trainer) + 3 and {b.dtype for b in buckets} == {torch.float32, torch.bfloat16,
                                                                                torch.int64}
    sent = Manifest.from_description(manifest.describe())
    assert sent == manifest
    sent.check(rollout)
    sent.unpack(buckets, rollout)
    for name, tensor in trainer.items():
        assert torch.equal(rollout[name], tensor) and rollout[name].dtype == tensor.dtype, name
    assert digest(sent.pack(rollout)) == digest(buckets)
    rollout["layer.w"][3, 3] = torch.nextafter(rollout["layer.w"][3, 3], torch.tensor(1e9))
    assert digest(sent.pack(rollout)) != digest(buckets), "one ulp of one weight changes the digest"


def test_a_models_digest_taken_tensor_by_tensor_is_that_of_its_buckets() -> None:
    """Without packing (a rollout's check of each version): the same digest, and one ulp still changes it."""
    weights = model(3)
    manifest = Manifest.of(weights, bucket_bytes=4096)
    assert manifest.digest_of(weights) == digest(manifest.pack(weights))
    experts = {f"expert{i}.w": torch.randn(8, 8) for i in range(300)}
    many = Manifest.of(experts, bucket_bytes=1 << 12)
    assert len(many.buckets) > 1 and many.digest_of(experts) == digest(many.pack(experts))
    weights["head"][0, 0] = torch.nextafter(weights["head"][0, 0], torch.tensor(1e9))
    assert manifest.digest_of(weights) != digest(Manifest.of(model(3), bucket_bytes=4096).pack(model(3)))


def test_a_model_of_many_small_tensors_makes_few_buckets() -> None:
    experts = {f"layer{i // 64}.expert{i % 64}.w": torch.randn(32, 32) for i in range(1200)}
    manifest = Manifest.of(experts, bucket_bytes=1 << 20)
    assert len(manifest.buckets) == -(-1200 * 32 * 32 * 4 // (1 << 20))
    copy = {name: torch.empty_like(t) for name, t in experts.items()}
    manifest.unpack(manifest.pack(experts), copy)
    assert all(torch.equal(copy[name], t) for name, t in experts.items())


@pytest.mark.parametrize("change, named", [
    (lambda m: m.update({"layer.w": torch.zeros(16, 8)}), "parameter 'layer.w' is sent as torch.float32 \\[16, 16\\]"),
    (lambda m: m.update({"norm": torch.zeros(16)}), "parameter 'norm' is sent as torch.bfloat16"),
    (lambda m: m.update({"extra": torch.zeros(1)}), "no parameter 'extra'"),
    (lambda m: m.pop("head"), "parameters this model does not have: \\['head'\\]"),
])
def test_a_model_that_does_not_match_is_refused_by_name(change, named: str) -> None:  # type: ignore[no-untyped-def]
    manifest = Manifest.of(model(1))
    rollout = model(2)
    change(rollout)
    with pytest.raises(ConfigError, match=named):
        manifest.check(rollout)


def test_a_manifest_that_places_a_parameter_outside_its_bucket_is_refused() -> None:
    described = Manifest.of(model(1)).describe()
    described["slots"][0][4] = 10**9
    with pytest.raises(ConfigError, match="outside its bucket"):
        Manifest.from_description(described)
    with pytest.raises(ConfigError, match="not a weights manifest"):
        Manifest.from_description({"slots": [["x", "complex_thing", [1], 0, 0]], "buckets": [["float32", 1]]})
