"""The pipeline strategy: a model as layers run one after another, cut into stages of near-equal compute and
run by convoy's pipeline runtime (``parallel/pipeline``) over groups of consecutive ranks.

A model is pipelined when it is an ``nn.Sequential`` or has a ``pipeline_layers()`` method returning its
layers in order (each takes one tensor and returns one; the layers may wrap the model's own modules). A
pipeline group trains on its ranks' batches together: each rank passes ``train_step`` its own batch, as under
DDP, and the group gathers them, so a step sees the same samples and the same gradient as DDP's. Where
there are several groups, each stage's gradients are averaged over the ranks holding that stage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from convoy.errors import ConfigError
from convoy.parallel import balanced_bounds
from convoy.strategy.plan import Strategy

LAYERS_METHOD = "pipeline_layers"


def layers_of(model: nn.Module) -> list[nn.Module] | None:
    """The model as layers run one after another, or None where it says nothing of them."""
    found = getattr(model, LAYERS_METHOD, None)
    if callable(found):
        layers = list(found())
        if not layers or not all(isinstance(layer, nn.Module) for layer in layers):
            raise ConfigError(f"{type(model).__name__}.{LAYERS_METHOD}() must return a non-empty list of "
                              "nn.Module layers, each taking one tensor and returning one")
        return layers
    if isinstance(model, nn.Sequential):
        return list(model.children())
    return None


def shared_parameter(layers: Sequence[nn.Module]) -> str | None:
    """Where two layers share a parameter (tied weights, which stages on different ranks cannot), said."""
    owner: dict[int, int] = {}
    for index, layer in enumerate(layers):
        for name, param in layer.named_parameters():
            if owner.setdefault(id(param), index) != index:
                return f"layers {owner[id(param)]} and {index} share parameter {name}"
    return None


def layer_weight(layer: nn.Module) -> float:
    """A layer's compute, as its parameters outside embedding tables (an embedding looks rows up), plus one."""
    tables = {id(p) for module in layer.modules() if isinstance(module, nn.Embedding) for p in module.parameters()}
    return 1.0 + sum(p.numel() for p in layer.parameters() if id(p) not in tables)


def build_schedule(strategy: Strategy) -> Any:
    """The strategy's schedule for its pipeline: ``stages * accumulation`` micro-batches."""
    from convoy.parallel.pipeline.schedule import build

    return build(strategy.schedule, strategy.stages, strategy.stages * strategy.accumulation)


_GROUPS: dict[tuple[int, int], tuple[Any, Any]] = {}
"""(the world group, ranks per pipeline) -> (this rank's pipeline group, its stage's data-parallel group or
None), made once: every rank makes the same groups in the same order."""


def pipeline_groups(stages: int) -> tuple[Any, Any]:
    """(this rank's pipeline group: ``stages`` consecutive ranks, the group of the ranks at its position in
    every pipeline, None where there is one pipeline); made on first use, the same on every rank."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % stages:
        raise ConfigError(f"a pipeline of {stages} stages needs a world size that is a multiple of it (WORLD_SIZE "
                          f"is {world})")
    key = (id(dist.group.WORLD), stages)
    if key not in _GROUPS:
        pipes = [dist.new_group(list(range(start, start + stages)), backend="gloo")
                 for start in range(0, world, stages)] if world > stages else [None]
        replicas = [dist.new_group(list(range(position, world, stages)), backend="gloo")
                    for position in range(stages)] if world > stages else [None] * stages
        _GROUPS[key] = (pipes[rank // stages], replicas[rank % stages])
    return _GROUPS[key]


def gather_batch(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """The ranks of ``group`` (None: all) pass their batches; each gets them all, in the group's rank order."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts)


class _Stage(nn.Sequential):
    """A stage's layers; its floating output leaves in float32, so a stage under autocast sends what the
    runtime, which learns shapes and dtypes without autocast, expects."""

    def forward(self, x: Any) -> Any:
        out = super().forward(x)
        return out.float() if torch.is_floating_point(out) and out.dtype != torch.float32 else out


class Pipelined(nn.Module):
    """This rank's stages of a pipelined model; ``train_step`` runs one step of the schedule."""

    def __init__(self, model: nn.Module, strategy: Strategy) -> None:
        super().__init__()
        from convoy.parallel.pipeline.runtime import PipelineRuntime

        layers = layers_of(model)
        if layers is None:
            raise ConfigError(f"the pipeline strategy needs the model's layers in order: make {type(model).__name__} "
                              f"an nn.Sequential or give it a {LAYERS_METHOD}() method returning them")
        shared = shared_parameter(layers)
        if shared:
            raise ConfigError(f"the pipeline strategy puts layers on different ranks, but {shared}; untie them or "
                              "plan without the pipeline")
        self.strategy = strategy
        self.group, self.replicas = pipeline_groups(strategy.stages)
        schedule = build_schedule(strategy)
        if len(layers) < schedule.n_stages:
            raise ConfigError(f"{type(model).__name__} has {len(layers)} layers; the {strategy.schedule} schedule "
                              f"over {strategy.stages} ranks needs at least {schedule.n_stages}")
        self.position = dist.get_rank(self.group)
        bounds = balanced_bounds([layer_weight(layer) for layer in layers], schedule.n_stages)
        mine = {s: _Stage(*layers[bounds[s][0]:bounds[s][1]]) for s in schedule.stages_of(self.position)}
        self.stage_modules = nn.ModuleDict({str(s): module for s, module in mine.items()})
        self.first, self.last = 0 in mine, schedule.n_stages - 1 in mine
        self._loss: Any = None
        self.runtime = PipelineRuntime(schedule, mine, lambda out, target: self._loss(out, target), group=self.group)
        self._last_rank = self._global(schedule.placement[-1])
        if self.replicas is not None:  # every pipeline starts from the first one's parameters, as DDP's replicas
            with torch.no_grad():
                for tensor in [*self.parameters(), *self.buffers()]:
                    dist.broadcast(tensor, dist.get_global_rank(self.replicas, 0), group=self.replicas)

    def _global(self, position: int) -> int:
        return position if self.group is None else dist.get_global_rank(self.group, position)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError("a pipelined model runs whole steps, not forwards: call convoy.train_step(model, "
                          "optimizer, loss, inputs, targets)")

    def train_step(self, optimizer: torch.optim.Optimizer, loss_fn: Any, inputs: Any, targets: torch.Tensor
                   ) -> float:
        if not isinstance(inputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
            raise ConfigError(f"the pipeline strategy takes one tensor of inputs and one of targets (got "
                              f"{type(inputs).__name__} and {type(targets).__name__})")
        self._loss = loss_fn
        group_inputs, group_targets = gather_batch(inputs, self.group), gather_batch(targets, self.group)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if self.strategy.bf16 else contextlib.nullcontext()
        with autocast:
            losses = self.runtime.step(group_inputs if self.first else None, group_targets if self.last else None)
        if self.replicas is not None:
            self._average_gradients()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        loss = torch.tensor([sum(losses) / len(losses) if losses else 0.0], dtype=torch.float64)
        dist.broadcast(loss, self._last_rank, group=self.group)
        return float(loss)

    def _average_gradients(self) -> None:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.replicas)
        flat /= dist.get_world_size(self.replicas)
        at = 0
        for grad in grads:
            grad.copy_(flat[at:at + grad.numel()].view_as(grad))
            at += grad.numel()
