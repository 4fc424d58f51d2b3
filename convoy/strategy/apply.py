"""``convoy.accelerate``: wrap a model and its optimizer as a strategy says; ``convoy.train_step`` runs one step.

``accelerate`` returns the wrapped model (DDP or FSDP2) and a new optimizer of the same class and
settings over the wrapped parameters (``local``: DDP over the node's ranks, and the optimizer's steps
followed by local SGD's averaging over all ranks every ``sync_every`` of them; ``pipeline``: this rank's
stages, ``strategy/pipelined.py``; ``sequence``: DDP over parts of each sequence, ``strategy/sequenced.py``);
``train_step`` splits
a rank's batch into micro-batches (gradients synchronised on the last only, for DDP), runs them under
autocast where the strategy says (on the model's device: ``strategy/device.py``), and steps the optimizer.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from convoy.errors import ConfigError
from convoy.strategy.device import autocast, ddp_options, model_device
from convoy.strategy.plan import Strategy, StrategyFile
from convoy.strategy.workload import find_blocks, model_identity

STRATEGY_ENV = "CONVOY_STRATEGY_FILE"
"""Where ``strategy="auto"`` finds the plan (``convoy run --strategy auto`` sets it); else ./convoy-strategy.json."""
DEFAULT_FILE = "convoy-strategy.json"


def resolve(strategy: Strategy | str | Path, model: nn.Module) -> Strategy:
    """A ``Strategy`` as given, or read from a file (``"auto"``: the planned one), checked against ``model``."""
    if isinstance(strategy, Strategy):
        return strategy.validate()
    path = Path(strategy)
    if str(strategy) == "auto":
        path = Path(os.environ.get(STRATEGY_ENV, DEFAULT_FILE))
        if not path.is_file():
            raise ConfigError(f"strategy='auto' found no strategy file at {path}; run convoy plan SCRIPT first "
                              f"(it writes {DEFAULT_FILE}), or convoy run --strategy auto")
    planned = StrategyFile.load(path)
    planned.check_model(*model_identity(model), path)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if planned.world_size != world:
        raise ConfigError(f"strategy file {path} was planned for {planned.world_size} ranks; this job has {world}")
    return planned.strategy


def _checkpoint_blocks(model: nn.Module) -> None:
    from torch.distributed._composable import checkpoint

    blocks = find_blocks(model)
    if not blocks:
        raise ConfigError(f"activation checkpointing needs repeated blocks (an nn.ModuleList); "
                          f"{type(model).__name__} has none")
    for _, block in blocks:
        checkpoint(block)


_NODE_GROUPS: dict[tuple[int, int], tuple[Any, Any]] = {}
"""(the world group, ranks per node) -> (this rank's node group, local SGD's groups), made once: every
rank makes the same groups in the same order, however many candidates a dry run builds."""


def node_groups(per_node: int) -> tuple[Any, Any]:
    """(this rank's group of the ranks on its node, local SGD's groups over all ranks), made on first use
    (every rank must call this at the same point) and kept for the process group's life."""
    from convoy.parallel.local_sgd import Layout, make_groups

    world, rank = dist.get_world_size(), dist.get_rank()
    if per_node < 1 or world % per_node:
        raise ConfigError(f"the local strategy needs the same ranks on every node: WORLD_SIZE {world} is not a "
                          f"multiple of LOCAL_WORLD_SIZE {per_node}")
    key = (id(dist.group.WORLD), per_node)  # a new process group (a new round) makes its own
    if key not in _NODE_GROUPS:
        nodes = [dist.new_group(list(range(start, start + per_node)), backend="gloo")
                 for start in range(0, world, per_node)]
        _NODE_GROUPS[key] = (nodes[rank // per_node], make_groups(Layout(world, 1)))
    return _NODE_GROUPS[key]


def _local_sgd(model: nn.Module, optimizer: torch.optim.Optimizer, chosen: Strategy) -> nn.Module:
    """DDP over this node's ranks; after each ``optimizer.step()``, local SGD over all ranks (a node's
    ranks hold the same replica, so all ranks' average is the nodes' average)."""
    from torch.nn.parallel import DistributedDataParallel

    from convoy.parallel.local_sgd import LocalSGD

    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    node_group, groups = node_groups(per_node)
    with torch.no_grad():  # one start for every replica, as DDP's constructor gives its group
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor, 0)
    wrapped = model
    if per_node > 1:
        wrapped = DistributedDataParallel(model, process_group=node_group, bucket_cap_mb=chosen.bucket_mb,
                                          gradient_as_bucket_view=True)
    averaging = LocalSGD(model.parameters(), groups, chosen.sync_every)
    steps = iter(range(2 ** 62))
    optimizer.register_step_post_hook(lambda *_: averaging.step(next(steps)))
    wrapped.convoy_local_sgd = averaging
    return wrapped


def _rebuilt(optimizer: torch.optim.Optimizer, params: Any) -> torch.optim.Optimizer:
    if len(optimizer.param_groups) != 1:
        raise ConfigError(f"convoy.accelerate rebuilds the optimizer over the wrapped parameters and takes one "
                          f"parameter group (this one has {len(optimizer.param_groups)})")
    return type(optimizer)(params, **optimizer.defaults)


def accelerate(model: nn.Module, optimizer: torch.optim.Optimizer, strategy: Strategy | str | Path = "auto",
               comm: Any = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Apply ``strategy`` to ``model`` and ``optimizer`` (built on the model's parameters, no steps taken).

    ``comm``: a ``HierarchicalAllreduce`` to reuse for the ``leader`` and ``reduce_scatter`` allreduces
    (one is made otherwise). Returns the wrapped model and its optimizer."""
    chosen = resolve(strategy, model)
    device = model_device(model)
    torch.set_num_threads(chosen.threads)
    if chosen.checkpointing:
        _checkpoint_blocks(model)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        wrapped, new_optimizer = model, optimizer
    elif chosen.kind == "local":
        wrapped, new_optimizer = _local_sgd(model, optimizer, chosen), optimizer
    elif chosen.kind == "pipeline":
        from convoy.strategy.pipelined import Pipelined

        wrapped = Pipelined(model, chosen)
        new_optimizer = _rebuilt(optimizer, wrapped.parameters())
    elif chosen.kind == "sequence":
        from convoy.strategy.sequenced import SequenceParallel

        wrapped, new_optimizer = SequenceParallel(model, chosen), optimizer
    elif chosen.kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for _, block in find_blocks(model):
            fully_shard(block)
        fully_shard(model)
        wrapped, new_optimizer = model, _rebuilt(optimizer, model.parameters())
    else:
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, bucket_cap_mb=chosen.bucket_mb, gradient_as_bucket_view=True,
                                          **ddp_options(device))
        if chosen.allreduce != "gloo":
            if comm is None:
                from convoy.parallel.allreduce.collectives import HierarchicalAllreduce

                comm = HierarchicalAllreduce(host_memory=False)
            wrapped.register_comm_hook(None, comm.ddp_hook(chosen.allreduce))
        if chosen.kind == "zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            if len(optimizer.param_groups) != 1:
                raise ConfigError(f"the zero strategy takes an optimizer with one parameter group (this one has "
                                  f"{len(optimizer.param_groups)})")
            new_optimizer = ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=type(optimizer),
                                                    **optimizer.defaults)
        else:
            new_optimizer = optimizer
    wrapped.convoy_strategy = chosen
    return wrapped, new_optimizer


def _split(value: Any, parts: int) -> list[Any]:
    if isinstance(value, torch.Tensor):
        return list(value.chunk(parts))
    if isinstance(value, (list, tuple)):
        pieces = [_split(v, parts) for v in value]
        return [type(value)(p[i] for p in pieces) for i in range(parts)]
    if isinstance(value, dict):
        pieces = {k: _split(v, parts) for k, v in value.items()}
        return [{k: p[i] for k, p in pieces.items()} for i in range(parts)]
    raise ConfigError(f"train_step splits tensors, tuples, lists and dicts of them; got {type(value).__name__}")


def _forward(model: nn.Module, inputs: Any) -> torch.Tensor:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (list, tuple)):
        return model(*inputs)
    return model(inputs)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Any, inputs: Any,
               targets: torch.Tensor) -> float:
    """One optimizer step over this rank's batch, as the strategy ``accelerate`` applied says; the mean loss."""
    chosen: Strategy = getattr(model, "convoy_strategy", None) or Strategy(micro_batch=len(targets))
    samples = len(targets)
    if samples != chosen.batch:
        raise ConfigError(f"train_step got {samples} samples; the strategy's batch is {chosen.micro_batch} x "
                          f"{chosen.accumulation} = {chosen.batch} per rank")
    if chosen.kind in ("pipeline", "sequence"):  # their wrappers run their own steps (one rank: the model as it is)
        from convoy.strategy.pipelined import Pipelined
        from convoy.strategy.sequenced import SequenceParallel

        if isinstance(model, (Pipelined, SequenceParallel)):
            return model.train_step(optimizer, loss_fn, inputs, targets)
    parts = chosen.accumulation
    device = model_device(model)
    total = 0.0
    for index, (micro_in, micro_target) in enumerate(zip(_split(inputs, parts), _split(targets, parts),
                                                         strict=True)):
        last = index == parts - 1
        sync = contextlib.nullcontext()
        if not last and hasattr(model, "no_sync"):
            sync = model.no_sync()
        with sync:
            with autocast(device, chosen.bf16):
                loss = loss_fn(_forward(model, micro_in), micro_target)
            (loss / parts).backward()
        total += float(loss.detach())
    optimizer.step()
    # gradients stay allocated (DDP's are views of its buckets: dropping them would make the next no_sync
    # micro-batch allocate a second copy beside the buckets); FSDP2's sharded ones are freed
    optimizer.zero_grad(set_to_none=hasattr(model, "set_requires_gradient_sync"))
    return total / parts
