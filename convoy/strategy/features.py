"""A model's features for the strategy search: sizes per module, activations traced on fake tensors,
and the factors real micro-steps measure (activation memory in float32, bfloat16 and with checkpointed
blocks; time per sample, bfloat16's and checkpointing's time; the optimizer step).

The trace runs the forward under ``FakeTensorMode`` (no memory, no compute) and counts what autograd
saves for the backward, per block; a model that cannot run on fake tensors is traced on real ones
instead (``traced_on="real"``), and the caller says so.
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from convoy.strategy.memory import Activations, Layer, ModelFeatures, Sequence
from convoy.strategy.workload import Workload, find_blocks, model_identity, peak_rss, reset_peak, rss, tensor_bytes


def _to(value: Any, convert: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return convert(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, convert) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, convert) for k, v in value.items()}
    return value


def call(model: nn.Module, inputs: Any) -> torch.Tensor:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (list, tuple)):
        return model(*inputs)
    return model(inputs)


class _SavedCounter:
    """Counts the bytes autograd saves during a forward, by block (``None``: outside every block)."""

    def __init__(self, model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> None:
        self.params = {id(p) for p in model.parameters()}
        self.seen: dict[int, torch.Tensor] = {}
        self.by_block: dict[int | None, int] = {}
        self.block_inputs = 0
        self.current: int | None = None
        self.handles = []
        for index, (_, block) in enumerate(blocks):
            self.handles.append(block.register_forward_pre_hook(self._enter(index)))
            self.handles.append(block.register_forward_hook(self._leave))

    def _enter(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self.current = index
            self.block_inputs += tensor_bytes(args)
        return hook

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self.current = None

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        base = tensor._base if tensor._base is not None else tensor
        if id(base) not in self.params and id(base) not in self.seen:
            self.seen[id(base)] = base  # held, so ids stay unique while counting
            where = self.current
            self.by_block[where] = self.by_block.get(where, 0) + base.numel() * base.element_size()
        return tensor

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def _count(model: nn.Module, blocks: list, workload: Workload, samples: int, bf16: bool,
           convert: Callable[[torch.Tensor], torch.Tensor]) -> tuple[int, int, int]:
    """(all saved, saved with checkpointing, the most one block saves) for one forward of ``samples``."""
    inputs, targets = workload.batch(samples, 0)
    inputs, targets = _to(inputs, convert), _to(targets, convert)
    counter = _SavedCounter(model, blocks)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    try:
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t), autocast:
            workload.loss(call(model, inputs), targets)
    finally:
        counter.close()
    total = sum(counter.by_block.values())
    in_blocks = [v for k, v in counter.by_block.items() if k is not None]
    outside = counter.by_block.get(None, 0)
    return total, outside + counter.block_inputs, max(in_blocks, default=0)


def _traced_model(workload: Workload, real: bool) -> tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor], Any]:
    """(the model, how to convert a batch's tensors for it, the mode to run it in): on fake tensors, or real ones."""
    if real:
        return workload.model(), (lambda t: t), contextlib.nullcontext()
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    with mode:
        model = workload.model()
    return model, mode.from_tensor, mode


def trace_activations(workload: Workload, bf16: bool, real: bool = False) -> Activations:
    """Saved bytes per sample (from forwards of 1 and 2 samples) on fake tensors, or real ones."""
    model, convert, mode = _traced_model(workload, real)
    blocks = find_blocks(model)
    with mode:
        one = _count(model, blocks, workload, 1, bf16, convert)
        two = _count(model, blocks, workload, 2, bf16, convert)
    per = [float(b - a) for a, b in zip(one, two, strict=True)]
    return Activations(per_sample=per[0], fixed=max(one[0] - per[0], 0.0), checkpointed_per_sample=per[1],
                       block_per_sample=per[2])


def _count_layers(layers: list[nn.Module], workload: Workload, samples: int, bf16: bool,
                  convert: Callable[[torch.Tensor], torch.Tensor]) -> tuple[list[int], list[int]]:
    """(saved bytes, output bytes) of each layer in one forward of ``samples`` run layer by layer, the loss's
    saved bytes with the last layer's."""
    inputs, targets = workload.batch(samples, 0)
    x, targets = _to(inputs, convert), _to(targets, convert)
    counter = _SavedCounter(nn.ModuleList(layers), [(str(i), layer) for i, layer in enumerate(layers)])
    outputs = []
    try:
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            for layer in layers:
                x = layer(x)
                outputs.append(x.numel() * 4)
            workload.loss(x, targets)
    finally:
        counter.close()
    saved = [counter.by_block.get(i, 0) for i in range(len(layers))]
    saved[-1] += counter.by_block.get(None, 0)
    return saved, outputs


def trace_layers(workload: Workload, real: bool = False) -> tuple[Layer, ...]:
    """The model's pipeline layers traced (forwards of 1 and 2 samples, on fake tensors or real ones); () where
    the model has no layers in order (``pipelined.layers_of``) or its inputs are not one tensor."""
    from convoy.strategy.pipelined import layer_weight, layers_of, shared_parameter

    model, convert, mode = _traced_model(workload, real)
    layers = layers_of(model)
    if not layers or len(layers) < 2 or shared_parameter(layers) or not isinstance(workload.batch(1, 0)[0],
                                                                                   torch.Tensor):
        return ()
    with mode:
        counts = {(samples, bf16): _count_layers(layers, workload, samples, bf16, convert)
                  for samples in (1, 2) for bf16 in (False, True)}
    found = []
    for index, layer in enumerate(layers):
        per = {bf16: counts[2, bf16][0][index] - counts[1, bf16][0][index] for bf16 in (False, True)}
        fixed = {bf16: max(counts[1, bf16][0][index] - per[bf16], 0) for bf16 in (False, True)}
        found.append(Layer(param_bytes=sum(tensor_bytes(p) for p in layer.parameters()), weight=layer_weight(layer),
                           saved_per_sample=float(per[False]), bf16_saved_per_sample=float(per[True]),
                           out_per_sample=float(counts[2, False][1][index] - counts[1, False][1][index]),
                           saved_fixed=float(fixed[False]), bf16_saved_fixed=float(fixed[True]),
                           largest_param_bytes=max((tensor_bytes(p) for p in layer.parameters()), default=0)))
    return tuple(found)


def trace_sequence(workload: Workload, real: bool = False) -> Sequence:
    """How the model attends over its inputs' positions (one forward of 1 sample on fake tensors or real ones);
    ``Sequence()`` (length 0) unless it calls both ``convoy.attention`` and ``convoy.positions``, over the
    positions of inputs and targets of one length (``strategy/sequenced.py`` cuts them along dimension 1)."""
    from convoy.parallel.sequence.shard import recording

    model, convert, mode = _traced_model(workload, real)
    inputs, targets = workload.batch(1, 0)
    if not (isinstance(inputs, torch.Tensor) and isinstance(targets, torch.Tensor) and inputs.dim() >= 2
            and targets.dim() >= 2 and inputs.shape[1] == targets.shape[1]):
        return Sequence()
    length = inputs.shape[1]
    with mode, recording() as record, torch.no_grad():
        call(model, convert(inputs))
    if not record.attention or not record.positions or any(shape[2] != length for shape, _ in record.attention):
        return Sequence()
    query_elements = sum(math.prod(shape[1:]) for shape, _ in record.attention)
    tables = {id(p) for module in model.modules() if isinstance(module, nn.Embedding) for p in module.parameters()}
    dense = sum(p.numel() for p in model.parameters() if id(p) not in tables)
    # multiply-adds of a forward: queries x keys and weights x values in each attention (half of it causal), and
    # each dense parameter once a position
    attention = sum(2 * math.prod(shape[1:]) * length * (0.5 if causal else 1.0) for shape, causal in record.attention)
    return Sequence(length=length, calls=len(record.attention), causal=all(c for _, c in record.attention),
                    query_bytes_per_sample=4.0 * query_elements,
                    attention_share=attention / (attention + dense * length))


def _timed(run: Callable[[], None], repeats: int = 2) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _timed_peak(run: Callable[[], None]) -> tuple[float, float]:
    """(seconds of one call, the most resident bytes it added above what was resident before it)."""
    gc.collect()
    reset_peak()
    before = rss()
    seconds = _timed(run, 1)
    return seconds, float(peak_rss() - before)


def calibrate_batch(workload: Workload, acts: Activations, budget: float) -> int:
    """The calibration micro-step's samples: the rank's batch, fewer if its activations would pass ``budget``."""
    samples = workload.batch_size
    while samples > 1 and acts.per_sample * samples > budget:
        samples //= 2
    return samples


def profile(workload: Workload, budget: float = 512e6) -> tuple[ModelFeatures, list[str]]:
    """Trace the model and run one real micro-step (one thread) to measure its factors; and notes to print."""
    notes: list[str] = []
    torch.set_num_threads(1)
    fp32, bf16, traced_on, layers, sequence = _traces(workload, notes)
    gc.collect()
    model = workload.model()
    optimizer = workload.optimizer(model.parameters())
    blocks = find_blocks(model)
    identity, summary = model_identity(model)
    param_bytes = sum(tensor_bytes(p) for p in model.parameters())
    block_bytes = tuple(sum(tensor_bytes(p) for p in block.parameters()) for _, block in blocks)
    modules = tuple((name, sum(tensor_bytes(t) for t in [*child.parameters(), *child.buffers()]))
                    for name, child in model.named_children())

    samples = calibrate_batch(workload, fp32, budget)
    inputs, targets = workload.batch(samples, 1)
    small_in, small_targets = workload.batch(1, 2)

    def step(x: Any = inputs, y: torch.Tensor = targets) -> None:
        workload.loss(call(model, x), y).backward()

    step()
    optimizer.step()  # the optimizer's state now exists, and every gradient
    state = sum(tensor_bytes(v) for per_param in optimizer.state.values() for v in per_param.values())
    optimizer.zero_grad(set_to_none=False)
    gc.collect()
    reset_peak()
    before = rss()
    step()
    measured = peak_rss() - before
    traced = acts_bytes(fp32, samples)
    optimizer_s, optimizer_peak, full_s, sample_s, micro_s = _step_times(
        optimizer.step, step, lambda: step(small_in, small_targets), samples)

    def bf16_step(x: Any = inputs, y: torch.Tensor = targets) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = workload.loss(call(model, x), y)
        loss.backward()

    bf16_factor, checkpoint_factor, memory_factors = _bf16_and_checkpoint_factors(
        step, bf16_step, lambda: bf16_step(small_in, small_targets), blocks, full_s, fp32, bf16, samples)
    features = ModelFeatures(
        fingerprint=identity, summary=summary, param_bytes=param_bytes,
        buffer_bytes=sum(tensor_bytes(b) for b in model.buffers()), root_param_bytes=param_bytes - sum(block_bytes),
        block_param_bytes=block_bytes, module_bytes=modules, fp32=fp32, bf16=bf16, traced_on=traced_on,
        activation_factor=measured / max(traced, 1.0), optimizer_state_ratio=state / param_bytes,
        optimizer_step_ratio=max(optimizer_peak, 0) / param_bytes, sample_s=sample_s, micro_step_s=micro_s,
        bf16_time_factor=bf16_factor, checkpoint_time_factor=checkpoint_factor, optimizer_s=optimizer_s,
        batch=workload.batch_size, has_blocks=bool(blocks), layers=layers, sequence=sequence, **memory_factors)
    factors = ", ".join(f"{name.removesuffix('_activation_factor').replace('_', ' ')} {value:.2f}"
                        for name, value in memory_factors.items())
    notes.append(f"calibrated on one real micro-step of {samples} sample(s): measured activations "
                 f"{measured / 1e6:.1f} MB, traced {traced / 1e6:.1f} MB (factor {features.activation_factor:.2f}; "
                 f"{factors})")
    return features, notes


def _step_times(optimizer_step: Callable[[], None], step: Callable[[], None], one_sample_step: Callable[[], None],
                samples: int) -> tuple[float, int, float, float, float]:
    """The optimizer's step (seconds, the resident bytes it added), the micro-step of ``samples`` samples, and
    that step cut into its time per sample and its fixed time (from a step of one sample)."""
    gc.collect()
    reset_peak()
    before = rss()
    optimizer_s = _timed(optimizer_step, 1)
    optimizer_peak = peak_rss() - before
    full_s = _timed(step)
    one_s = _timed(one_sample_step, 1)
    sample_s = (full_s - one_s) / (samples - 1) if samples > 1 else full_s
    return optimizer_s, optimizer_peak, full_s, sample_s, max(full_s - sample_s * samples, 0.0)


def _traces(workload: Workload, notes: list[str]) -> tuple[Activations, Activations, str, tuple, Sequence]:
    """The model's activations traced in float32 and bfloat16 (on fake tensors, else in a real micro-step), its
    pipeline layers and its attention; what could not be traced is said in ``notes`` and drops its candidates."""
    try:
        fp32, bf16 = trace_activations(workload, False), trace_activations(workload, True)
        traced_on = "meta"
    except Exception as exc:  # noqa: BLE001 (any failure of the fake trace falls back to a real one, said so)
        notes.append(f"the model cannot run on fake (meta) tensors ({type(exc).__name__}: {str(exc)[:120]}); "
                     "its activations were measured in a real micro-step instead")
        fp32, bf16 = trace_activations(workload, False, real=True), trace_activations(workload, True, real=True)
        traced_on = "real"
    try:
        layers = trace_layers(workload, real=traced_on == "real")
    except Exception as exc:  # noqa: BLE001 (the model's own layers fail when run one by one: no pipeline)
        notes.append(f"the model's pipeline_layers() could not be run one after another ({type(exc).__name__}: "
                     f"{str(exc)[:120]}); no pipeline candidates")
        layers = ()
    try:
        sequence = trace_sequence(workload, real=traced_on == "real")
    except Exception as exc:  # noqa: BLE001 (a forward of one sample failed here but not above: no sequence cut)
        notes.append(f"the model's attention could not be traced ({type(exc).__name__}: {str(exc)[:120]}); no "
                     "sequence candidates")
        sequence = Sequence()
    return fp32, bf16, traced_on, layers, sequence


def _bf16_and_checkpoint_factors(step: Callable[[], None], bf16_step: Callable[[], None],
                                 bf16_warm_up: Callable[[], None], blocks: list, full_s: float, fp32: Activations,
                                 bf16: Activations, samples: int) -> tuple[float, float, dict[str, float]]:
    """bfloat16's and checkpointing's time factors against the float32 micro-step (``full_s``), and their
    activation memory factors against the traced bytes."""
    # one sample first, untimed: the first bfloat16 step pays one-time costs (kernels, autocast's caches),
    # and a CPU without bfloat16 shows it many times slower at little cost; then the calibration batch, as
    # the fp32 time it is compared with (autocast's casts of the weights are a fixed cost a batch dilutes)
    bf16_warm_up()
    bf16_s, bf16_peak = _timed_peak(bf16_step)
    bf16_factor = bf16_s / full_s
    memory_factors = {"bf16_activation_factor": bf16_peak / max(acts_bytes(bf16, samples), 1.0)}
    checkpoint_factor = 1.0
    if blocks:  # the same micro-step with each block checkpointed, in float32 and in bfloat16
        from torch.distributed._composable import checkpoint

        for _, block in blocks:
            checkpoint(block)
        checkpoint_s, checkpoint_peak = _timed_peak(step)
        checkpoint_factor = checkpoint_s / full_s
        _, checkpoint_bf16_peak = _timed_peak(bf16_step)
        memory_factors["checkpoint_activation_factor"] = checkpoint_peak / max(checkpointed_bytes(fp32, samples), 1.0)
        memory_factors["checkpoint_bf16_activation_factor"] = (checkpoint_bf16_peak
                                                               / max(checkpointed_bytes(bf16, samples), 1.0))
    return bf16_factor, checkpoint_factor, memory_factors


def acts_bytes(acts: Activations, samples: int) -> float:
    return acts.per_sample * samples + acts.fixed


def checkpointed_bytes(acts: Activations, samples: int) -> float:
    """What a micro-step with checkpointed blocks saves at its peak: block inputs and what is outside them,
    and one block's own activations being recomputed."""
    return (acts.checkpointed_per_sample + acts.block_per_sample) * samples + acts.fixed
