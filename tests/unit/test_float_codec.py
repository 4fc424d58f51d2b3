"""The lossless float coding of the allreduce's cross-group phase: every bit back, and how many bytes."""

from __future__ import annotations

import pytest
import torch

from convoy.parallel.allreduce.float_codec import capacity, codable, decode, encode


def roundtrip(chunk: torch.Tensor) -> torch.Tensor:
    payload = encode(chunk)
    inbox = torch.zeros(capacity(chunk.numel(), chunk.dtype), dtype=torch.uint8)  # the receiver's buffer
    inbox[:payload.numel()] = payload
    out = torch.full_like(chunk, 7)
    decode(inbox, out)
    assert torch.equal(out.view(torch.uint8), chunk.view(torch.uint8)), "a bit changed"
    return payload


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("count", [2, 3, 4, 1001, 65536])
def test_gradient_like_chunks_come_back_bit_for_bit(dtype: torch.dtype, count: int) -> None:
    generator = torch.Generator().manual_seed(count)
    values = torch.randn(count, generator=generator) * torch.exp(torch.randn(count, generator=generator) * 2) * 1e-3
    values[::17] = 0.0
    values[1::19] = -0.0
    roundtrip(values.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_special_values_and_extremes_come_back(dtype: torch.dtype) -> None:
    info = torch.finfo(dtype)
    specials = torch.tensor([float("nan"), float("inf"), float("-inf"), info.max, -info.max, info.tiny,
                             info.tiny / 4, -info.tiny / 4, 0.0, -0.0], dtype=dtype)
    roundtrip(torch.cat([torch.randn(5000).to(dtype), specials]))
    roundtrip(specials)
    roundtrip(torch.tensor([1.5], dtype=dtype))


def test_coded_size_is_the_raw_size_less_the_top_bytes_half() -> None:
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(1 << 18, generator=generator)
    for dtype, share in ((torch.float32, 7 / 8), (torch.bfloat16, 3 / 4), (torch.float64, 15 / 16)):
        chunk = values.to(dtype)
        payload = roundtrip(chunk)
        raw = chunk.numel() * chunk.element_size()
        assert share < payload.numel() / raw < share + 0.002, (dtype, payload.numel() / raw)
    zeros = torch.zeros(1000)
    assert roundtrip(zeros).numel() < capacity(1000, torch.float32) * 0.88


def test_a_chunk_too_wide_to_code_goes_raw() -> None:
    generator = torch.Generator().manual_seed(1)
    wide = torch.randn(4096, generator=generator) * torch.pow(10.0, torch.randint(-30, 30, (4096,),
                                                                                   generator=generator))
    assert roundtrip(wide).numel() == capacity(4096, torch.float32)


def test_wrong_input_is_refused() -> None:
    assert not codable(torch.float16) and not codable(torch.int32)
    with pytest.raises(ValueError, match="not torch.float16"):
        encode(torch.ones(4, dtype=torch.float16))
    with pytest.raises(ValueError, match="carries 8 elements"):
        decode(encode(torch.ones(8)), torch.empty(9))
    with pytest.raises(ValueError, match="not a float_codec payload"):
        decode(torch.full((64,), 9, dtype=torch.uint8), torch.empty(4))
