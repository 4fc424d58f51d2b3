"""Measure activation memory: the bytes autograd keeps for backward, live and at peak.

A ``saved_tensors_hooks`` context sees every tensor a forward saves for its backward; the
bytes of its storage count until autograd drops it (after that micro-batch's backward).
Parameters do not count. Works for any code that runs forward and backward in this thread,
convoy's runtime and torch.distributed.pipelining alike.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class _Held:
    __slots__ = ("meter", "key", "tensor")

    def __init__(self, meter: ActivationMeter, key: int, tensor: torch.Tensor) -> None:
        self.meter, self.key, self.tensor = meter, key, tensor

    def __del__(self) -> None:
        self.meter._release(self.key)


class ActivationMeter:
    """``with meter:`` around forward and backward; ``meter.peak`` is the most bytes held at once."""

    def __init__(self, params: Iterable[torch.Tensor] = ()) -> None:
        self._skip = {p.untyped_storage().data_ptr() for p in params}
        self._refs: dict[int, list[int]] = {}
        self.live = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> object:
        if tensor.device.type == "meta":
            return tensor
        key = tensor.untyped_storage().data_ptr()
        if key in self._skip or key == 0:
            return tensor
        entry = self._refs.get(key)
        if entry is None:
            nbytes = tensor.untyped_storage().nbytes()
            self._refs[key] = [1, nbytes]
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        else:
            entry[0] += 1
        return _Held(self, key, tensor)

    @staticmethod
    def _unpack(packed: object) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Held) else packed  # type: ignore[return-value]

    def _release(self, key: int) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._refs[key]
            self.live -= entry[1]

    def reset_peak(self) -> None:
        self.peak = self.live

    def __enter__(self) -> ActivationMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
