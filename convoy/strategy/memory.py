"""Each candidate's peak memory per rank, predicted from the model's features (pure).

The bytes a rank holds above its process baseline (torch and the process group loaded) while it
trains: parameters, buffers, gradients, optimizer state (each whole or a 1/N share), the unsharded
units FSDP gathers, and the activations of one micro-batch, scaled by the factor one real micro-step
measured. The peak is the static part plus the larger of the forward/backward and the optimizer step (with
the gradient allreduce's transient: gloo reduces a copy of the whole gradient, convoy's hierarchical reduce-scatter
a node's share of it, its leader allreduce works in place).
FSDP's peak falls in the backward, where gathered units, their unsharded gradients and reduce-scatter
buffers meet activations already partly freed; two real FSDP micro-steps (``calibrate_fsdp``) measure
its fixed part and the activations' share, which the traced layout alone over-counts. A pipeline's ranks are
predicted action by action from the layers' traced sizes and the transients of a backward (``_rank_estimates``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from convoy.strategy.plan import Strategy


@dataclass(frozen=True)
class Activations:
    """Bytes saved for the backward pass, from a trace (per sample, plus what does not grow with it)."""

    per_sample: float
    """Without checkpointing: every saved tensor of the forward."""
    fixed: float
    """What one forward saves whatever its batch (bfloat16 copies of weights under autocast)."""
    checkpointed_per_sample: float
    """With checkpointing: block inputs and what is saved outside the blocks."""
    block_per_sample: float
    """The most one block saves (recomputed in the backward, one block at a time)."""


@dataclass(frozen=True)
class Layer:
    """One layer of a pipelined model, traced."""

    param_bytes: int
    weight: float
    """Its compute, as ``pipelined.layer_weight`` counts it (stages are cut by it)."""
    saved_per_sample: float
    """Bytes autograd saves in its forward, float32 (the last layer: with the loss's)."""
    bf16_saved_per_sample: float
    out_per_sample: float
    """Bytes of its output, float32 (what a stage ending here sends, and receives back as its gradient)."""
    saved_fixed: float = 0.0
    """What its forward saves whatever the micro-batch (a mask over the sequence, say), float32."""
    bf16_saved_fixed: float = 0.0
    largest_param_bytes: int = 0
    """Its largest parameter: a backward computes that one's gradient beside the one it accumulates into."""


@dataclass(frozen=True)
class Sequence:
    """How a model attends over its inputs' positions, traced; ``length`` 0 where the sequence strategy cannot cut
    them (the model does not call ``convoy.attention`` and ``convoy.positions``)."""

    length: int = 0
    """Positions of a sample."""
    calls: int = 0
    """Attention calls in one forward."""
    causal: bool = False
    """Every call causal (a rank attends only to earlier positions: the last part's rank does the most)."""
    query_bytes_per_sample: float = 0.0
    """The queries of all calls for one sample, float32 (query broadcast sends and keeps parts of them)."""
    attention_share: float = 0.0
    """Attention's share of a forward's multiply-adds (the rest: each dense parameter once a position)."""


@dataclass(frozen=True)
class ModelFeatures:
    """What the strategy search knows of a model: sizes traced, factors measured in one real micro-step."""

    fingerprint: str
    summary: str
    param_bytes: int
    buffer_bytes: int
    root_param_bytes: int
    """Parameters outside the blocks (FSDP's root unit: embeddings, final norm, head)."""
    block_param_bytes: tuple[int, ...]
    module_bytes: tuple[tuple[str, int], ...]
    """Parameter and buffer bytes of each top-level module."""
    fp32: Activations
    bf16: Activations
    traced_on: str
    """``meta`` (fake tensors) or ``real`` (the model could not run on meta tensors: measured instead)."""
    activation_factor: float
    """Measured / traced activation bytes of one real micro-step (autograd's transients, allocator)."""
    optimizer_state_ratio: float
    """Optimizer state bytes per parameter byte (Adam: 2)."""
    optimizer_step_ratio: float
    """Extra bytes during ``optimizer.step()`` per parameter byte of the rank's share."""
    sample_s: float
    """Forward + backward time per sample, one thread, float32."""
    micro_step_s: float
    """Fixed time of one forward + backward whatever its batch."""
    bf16_time_factor: float
    checkpoint_time_factor: float
    optimizer_s: float
    """``optimizer.step()`` over all parameters, one thread."""
    batch: int
    """Samples per rank per optimizer step."""
    has_blocks: bool
    bf16_activation_factor: float = 0.0
    """``activation_factor`` of a bfloat16 micro-step (0: not measured, the float32 one is used)."""
    checkpoint_activation_factor: float = 0.0
    """The same with checkpointed blocks (recomputation's transients are a larger share of less saved)."""
    checkpoint_bf16_activation_factor: float = 0.0
    """The same with checkpointed blocks under bfloat16."""
    fsdp_fixed: float = 0.0
    """Measured in two real FSDP micro-steps: what a rank holds at its peak beyond its static share and the
    activations' part (the gathered units, their unsharded gradients and reduce-scatter buffers)."""
    fsdp_activation_share: float = 0.0
    """The part of a micro-batch's activations held at that peak (0: not measured, the traced layout is used)."""
    layers: tuple[Layer, ...] = ()
    """The model's layers in order, where it can be pipelined (``strategy/pipelined.py``); else empty."""
    sequence: Sequence = Sequence()
    """Its attention over the positions, where the sequence strategy can cut them (``strategy/sequenced.py``)."""

    def activation_factor_for(self, checkpointing: bool, bf16: bool) -> float:
        """Measured / traced activation bytes of a micro-step run this way (the float32 one where not measured)."""
        found = {(False, True): self.bf16_activation_factor, (True, False): self.checkpoint_activation_factor,
                 (True, True): self.checkpoint_bf16_activation_factor}.get((checkpointing, bf16), 0.0)
        return found or self.activation_factor

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelFeatures:
        data = dict(data)
        data["fp32"], data["bf16"] = Activations(**data["fp32"]), Activations(**data["bf16"])
        data["block_param_bytes"] = tuple(data["block_param_bytes"])
        data["module_bytes"] = tuple(tuple(pair) for pair in data["module_bytes"])
        data["layers"] = tuple(Layer(**layer) for layer in data.get("layers", ()))
        data["sequence"] = Sequence(**data.get("sequence", {}))
        return cls(**data)


@dataclass(frozen=True)
class MemoryEstimate:
    static: float
    forward_backward: float
    optimizer_step: float
    """The optimizer step, or the gradient allreduce where it holds more."""

    @property
    def peak(self) -> float:
        return self.static + max(self.forward_backward, self.optimizer_step)


def activation_bytes(features: ModelFeatures, strategy: Strategy) -> float:
    """One micro-batch's activations at their peak, as the real micro-step scaled them."""
    acts = features.bf16 if strategy.bf16 else features.fp32
    if strategy.checkpointing:
        per_sample = acts.checkpointed_per_sample + acts.block_per_sample
    else:
        per_sample = acts.per_sample
    factor = features.activation_factor_for(strategy.checkpointing, strategy.bf16)
    return factor * (per_sample * strategy.micro_batch + acts.fixed)


LOSS_TRANSIENT = 2.0
"""What the loss's backward holds for a moment on a pipeline's last stage beside what is saved, in outputs of the last
layer per micro-batch sample: the gradients of the log-probabilities and of the logits (traced action by action on
``examples/train_strategy.py`` at a context of 512: 2.0 at micro-batches of 2 and 4; its forward holds 1.0)."""
BACKWARD_TRANSIENT = 0.4
"""What a layer's backward holds for a moment beside what is saved, as a share of what that layer saved (the same
trace: 0.31-0.43 of a transformer block's, float32 and bfloat16)."""


def pipeline_stages(features: ModelFeatures, strategy: Strategy) -> tuple[Any, list[tuple[int, int]]]:
    """(the strategy's schedule, each stage's ``[start, end)`` of ``features.layers``), as ``Pipelined`` cuts them."""
    from convoy.parallel import balanced_bounds
    from convoy.parallel.pipeline.schedule import build

    schedule = build(strategy.schedule, strategy.stages, strategy.stages * strategy.accumulation)
    return schedule, balanced_bounds([layer.weight for layer in features.layers], schedule.n_stages)


def stage_sum(features: ModelFeatures, bounds: tuple[int, int], field: str) -> float:
    return sum(getattr(layer, field) for layer in features.layers[bounds[0]:bounds[1]])


def _pipeline(features: ModelFeatures, strategy: Strategy, world_size: int) -> MemoryEstimate:
    """The rank of the pipeline that holds the most."""
    return max(_rank_estimates(features, strategy, world_size), key=lambda estimate: estimate.peak)


def _rank_estimates(features: ModelFeatures, strategy: Strategy, world_size: int) -> list[MemoryEstimate]:
    """Each rank of a pipeline: its stages' parameters, gradients and optimizer state, and, walking its schedule's
    actions, the most that the micro-batches in flight (forwards not yet backwarded) hold with the transients of the
    one computing. Traced sizes only: a whole micro-step's measured factor is mostly the loss's, which only the last
    stage holds."""
    from convoy.parallel.pipeline.schedule import Kind

    schedule, bounds = pipeline_stages(features, strategy)
    saved = "bf16_saved_per_sample" if strategy.bf16 else "saved_per_sample"
    last = schedule.n_stages - 1
    logits = strategy.micro_batch * features.layers[-1].out_per_sample
    found = []
    for rank in range(schedule.n_ranks):
        stages = schedule.stages_of(rank)
        params = sum(stage_sum(features, bounds[s], "param_bytes") for s in stages)
        # a micro-batch in flight holds what its layers saved, and (but on the last stage, which keeps the loss) the
        # stage's output, kept for its backward, and the buffer its gradient is received into
        acts, backward = {}, {}
        for s in stages:
            layers = features.layers[bounds[s][0]:bounds[s][1]]
            sent = 2 * layers[-1].out_per_sample if s < last else 0.0
            kept = [strategy.micro_batch * getattr(x, saved) + x.saved_fixed for x in layers]
            acts[s] = sum(kept) + strategy.micro_batch * sent
            # its backward runs the layers last to first: while layer i's runs, what the later layers saved is freed,
            # and layer i holds its transients (the loss's, on the last layer of all) and its largest parameter's
            # new gradient beside the one it accumulates into (an embedding table's, the first layer's, comes last)
            backward[s] = max((LOSS_TRANSIENT * logits if s == last and i == len(layers) - 1
                               else BACKWARD_TRANSIENT * strategy.micro_batch * getattr(layers[i], saved))
                              + layers[i].largest_param_bytes - sum(kept[i + 1:]) for i in range(len(layers)))
        held = peak = 0.0
        for act in schedule.actions[rank]:
            if act.kind is Kind.F:
                held += acts[act.stage]
                peak = max(peak, held + (logits if act.stage == last else 0.0))  # the loss's forward
            elif act.kind is Kind.B:
                peak = max(peak, held + backward[act.stage])
                held -= acts[act.stage]
        if strategy.bf16:  # autocast's bfloat16 copies of the stages' weights: made once a step, for every micro-batch
            peak += sum(max(stage_sum(features, bounds[s], "bf16_saved_fixed")
                            - stage_sum(features, bounds[s], "saved_fixed"), 0.0) for s in stages)
        static = params * (2 + features.optimizer_state_ratio) + features.buffer_bytes
        step = params * features.optimizer_step_ratio
        if world_size > strategy.stages:  # the stages' gradients flattened for the allreduce over the pipelines
            step = max(step, params)
        found.append(MemoryEstimate(static, peak, step))
    return found


def sequence_activations(features: ModelFeatures, strategy: Strategy) -> float:
    """One micro-batch's activations on a rank holding ``1/sequence`` of each sample's positions: its share of what
    the whole samples save (what does not grow with the batch stays whole), and the queries the other ranks sent it
    for their attention, kept for their backward (causal: the first rank gets every later rank's; float32 always,
    and under bfloat16 the float32 copies its own attention saves)."""
    ranks = strategy.sequence
    acts = features.bf16 if strategy.bf16 else features.fp32
    factor = features.activation_factor_for(False, strategy.bf16)
    queries = strategy.micro_batch * features.sequence.query_bytes_per_sample / ranks  # this rank's, float32
    kept = (ranks - 1) * queries
    if strategy.bf16:  # the attention runs in float32 and saves float32 copies where the bfloat16 trace counted
        kept += 2 * queries  # bfloat16 ones: 2 queries' worth measured on case d's model (-1% to +5%; q, k, v and
        # the output counted whole, 4, over-predicted by 7 MB once the kernels' caches were primed)
    return factor * (acts.per_sample * strategy.micro_batch / ranks + acts.fixed) + kept


def predict(features: ModelFeatures, strategy: Strategy, world_size: int, per_node: int | None = None
            ) -> MemoryEstimate:
    """The peak bytes one rank holds above its baseline while training with ``strategy`` on ``world_size`` ranks,
    ``per_node`` of them a node (all: None)."""
    if strategy.kind == "pipeline":
        return _pipeline(features, strategy, world_size)
    params, share = float(features.param_bytes), 1.0
    if strategy.kind == "sequence":
        activations = sequence_activations(features, strategy)
    else:
        activations = activation_bytes(features, strategy)
    if strategy.kind == "fsdp" and world_size > 1:
        share = 1.0 / world_size
        biggest = max(features.block_param_bytes, default=0)
        # the root unit stays gathered from forward to backward, a block and the next (prefetched) are
        # gathered at once; the sharded gradients are freed after each step and grow back as the
        # activations are freed in the backward
        gathered = features.root_param_bytes + 2 * biggest
        kept = params * share if strategy.accumulation > 1 else 0.0  # the first micro-batches' sharded gradients
        static = params * share * (1 + features.optimizer_state_ratio) + features.buffer_bytes
        step = params * share * (1 + features.optimizer_step_ratio)
        if features.fsdp_activation_share > 0:  # measured: the peak falls in the backward, activations part freed
            return MemoryEstimate(static, features.fsdp_fixed + features.fsdp_activation_share * activations + kept,
                                  step)
        return MemoryEstimate(static, activations + gathered + kept, step)
    # ddp, zero, sequence (DDP over parts of the positions), and local (DDP within the node; its averaging's flat
    # copy of the parameters comes after the optimizer step, so it is no more than the gradient buckets' copy below)
    state_share = 1.0 / world_size if strategy.kind == "zero" else 1.0
    static = 2 * params + features.buffer_bytes + params * state_share * features.optimizer_state_ratio
    step = params * state_share * features.optimizer_step_ratio  # ZeRO broadcasts each updated shard in place
    if world_size > 1 and strategy.allreduce == "gloo":  # gloo reduces a copy of the gradient buckets, late in the
        step = max(step, params)  # backward
    elif strategy.allreduce == "reduce_scatter":  # a bucket's shards of all its chunks at once (measured on 2x2
        step = max(step, params / (per_node or world_size))  # ranks: 10.4 MB of a 21 MB model); leader: in place
    return MemoryEstimate(static, activations, step)


def smallest_need(features: ModelFeatures, strategies: list[Strategy], world_size: int) -> tuple[Strategy, float]:
    """The candidate that needs the least memory, and how much (for a limit no candidate fits)."""
    best = min(strategies, key=lambda s: predict(features, s, world_size).peak)
    return best, predict(features, best, world_size).peak
