"""Execute any valid schedule on torch.distributed point-to-point ops.

Each rank builds one ``PipelineRuntime`` with the stages it holds and calls ``step`` with the
batch (on the rank of stage 0) and the targets (on the rank of the last stage). The batch is
cut into the schedule's micro-batches; each compute action runs one stage on one
micro-batch; runs of consecutive sends and receives go out as one ``batch_isend_irecv``.
Receives are waited for before the next compute; a stage's output sent forward is released once its
gradient has come back, other sends at the end of the step. Gradients
accumulate in the stages' ``.grad`` over the micro-batches, scaled so that they equal one
backward of ``loss_fn`` over the whole batch (``loss_fn`` must average over its batch).

Activation shapes are learnt once, on the first step, by passing shapes down the stages in
order; later steps must use the same micro-batch shape.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from convoy.errors import ScheduleError
from convoy.parallel import even_bounds
from convoy.parallel.pipeline.memory import ActivationMeter
from convoy.parallel.pipeline.schedule import Action, Kind, Schedule, split_microbatches
from convoy.parallel.pipeline.simulate import Span
from convoy.parallel.tensor.blocks import Filler, split_blocks
from convoy.parallel.pipeline.validate import validate

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]
_HEADER = 10


def _tag(kind: Kind, stage: int, mb: int, n_microbatches: int) -> int:
    """One tag per message: the boundary it crosses (the upstream stage), direction, micro-batch."""
    boundary = stage - 1 if kind in (Kind.RECV_F, Kind.SEND_B) else stage
    return (boundary * n_microbatches + mb) * 2 + (kind in (Kind.SEND_B, Kind.RECV_B))


class PipelineRuntime:
    """Runs ``schedule`` for this rank's ``stages`` (stage index -> module) in ``group``."""

    def __init__(self, schedule: Schedule, stages: Mapping[int, nn.Module], loss_fn: LossFn,
                 group: dist.ProcessGroup | None = None) -> None:
        validate(schedule)
        self.schedule, self.loss_fn, self.group = schedule, loss_fn, group
        self.rank = dist.get_rank(group)
        if dist.get_world_size(group) != schedule.n_ranks:
            raise ScheduleError(f"the schedule is for {schedule.n_ranks} ranks but the process group has "
                                f"{dist.get_world_size(group)}; build it for the group's size")
        mine = schedule.stages_of(self.rank)
        if sorted(stages) != mine:
            raise ScheduleError(f"rank {self.rank} holds stages {mine} in the schedule but was given "
                                f"{sorted(stages)}; pass exactly those")
        self.stages = dict(stages)
        self.actions = schedule.actions[self.rank]
        self.filler: Filler | None = None
        if any(a.kind is Kind.H or a.peer is not None for a in self.actions):
            for act in self.actions:
                if act.kind is Kind.F and act.peer is not None:
                    split_blocks(self.stages[act.stage], act.stage)
            self.filler = Filler(self.rank, schedule.n_microbatches, self._global, group)
        self.last = schedule.n_stages - 1
        self._shapes: dict[int, tuple[torch.Size, torch.dtype]] | None = None
        """Stage -> shape and dtype of its input micro-batch (this rank's stages and their neighbours)."""
        self._mb_shape: torch.Size | None = None
        self.spans: list[Span] = []
        self.meter: ActivationMeter | None = None

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def params(self) -> list[nn.Parameter]:
        return [p for module in self.stages.values() for p in module.parameters()]

    # -- shapes ----------------------------------------------------------------------------
    def _learn_shapes(self, first: torch.Tensor | None) -> None:
        """Pass each stage's input shape down the pipeline, in stage order, once."""
        place, shapes = self.schedule.placement, {}
        if place[0] == self.rank:
            assert first is not None
            shapes[0] = (first.shape, first.dtype)
        for stage in range(self.schedule.n_stages - 1):
            here, there = place[stage], place[stage + 1]
            if here == self.rank:
                shape, dtype = shapes[stage]
                out = shapes[stage + 1] = self._out_shape(self.stages[stage], shape, dtype)
                if there != self.rank:
                    header = torch.zeros(_HEADER, dtype=torch.int64)
                    header[0], header[1] = len(out[0]), _DTYPES.index(out[1])
                    header[2:2 + len(out[0])] = torch.tensor(out[0], dtype=torch.int64)
                    dist.send(header, self._global(there), group=self.group)
            elif there == self.rank:
                header = torch.zeros(_HEADER, dtype=torch.int64)
                dist.recv(header, self._global(here), group=self.group)
                ndim = int(header[0])
                shapes[stage + 1] = (torch.Size(header[2:2 + ndim].tolist()), _DTYPES[int(header[1])])
        self._shapes = shapes

    @staticmethod
    def _out_shape(module: nn.Module, shape: torch.Size, dtype: torch.dtype) -> tuple[torch.Size, torch.dtype]:
        try:
            state = {k: torch.empty_like(v, device="meta") for k, v in module.state_dict(keep_vars=True).items()}
            out = torch.func.functional_call(module, state, (torch.empty(shape, dtype=dtype, device="meta"),))
        except Exception:  # noqa: BLE001 - a module meta tensors can't run: run it for real once
            with torch.no_grad():
                out = module(torch.zeros(shape, dtype=dtype))
        if len(out.shape) > _HEADER - 2 or out.dtype not in _DTYPES:
            raise ScheduleError(f"a stage's output of shape {tuple(out.shape)} and dtype {out.dtype} can't be sent "
                                f"between stages; use at most {_HEADER - 2} dims and a float or int dtype")
        return out.shape, out.dtype

    # -- one step --------------------------------------------------------------------------
    def step(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None,
             record: bool = False) -> list[float] | None:
        """One training step; returns each micro-batch's loss on the last stage's rank, else None.

        With ``record``, ``self.spans`` holds this rank's compute actions with their
        ``time.perf_counter()`` start and end (one clock for all processes of a Linux host);
        ``gather_spans`` collects them from every rank."""
        m = self.schedule.n_microbatches
        x_mbs = t_mbs = None
        problem = None
        try:
            if 0 in self.stages:
                if inputs is None:
                    raise ScheduleError(f"rank {self.rank} holds stage 0 and needs the batch: step(inputs=...)")
                split_microbatches(inputs.shape[0], m)
                x_mbs = inputs.chunk(m)
            if self.last in self.stages:
                if targets is None:
                    raise ScheduleError(f"rank {self.rank} holds the last stage and needs step(targets=...)")
                split_microbatches(targets.shape[0], m)
                t_mbs = targets.chunk(m)
        except ScheduleError as exc:
            problem = exc
        if self._shapes is None:
            # The first step agrees on the input first, so a bad batch fails every rank, not one.
            verdicts: list[str | None] = [None] * self.schedule.n_ranks
            dist.all_gather_object(verdicts, None if problem is None else str(problem), group=self.group)
            first = next((v for v in verdicts if v is not None), None)
            if first is not None:
                raise ScheduleError(first) from problem
        elif problem is not None:
            raise problem
        if self._shapes is None:
            self._learn_shapes(x_mbs[0] if x_mbs else None)
            self._mb_shape = x_mbs[0].shape if x_mbs else None
        elif x_mbs and x_mbs[0].shape != self._mb_shape:
            raise ScheduleError(f"micro-batch shape changed from {tuple(self._mb_shape)} to {tuple(x_mbs[0].shape)}; "
                                f"a runtime keeps the shapes of its first step: build a new one")
        return _Step(self, x_mbs, t_mbs, record).run()


class _Step:
    """The state of one step on one rank: stashed inputs/outputs and messages in flight."""

    def __init__(self, rt: PipelineRuntime, x_mbs: tuple | None, t_mbs: tuple | None, record: bool) -> None:
        self.rt, self.x_mbs, self.t_mbs, self.record = rt, x_mbs, t_mbs, record
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.grads: dict[tuple[int, int], torch.Tensor] = {}
        """(stage, mb) -> gradient of that stage's output, received or handed over locally."""
        self.incoming: dict[tuple[int, int], torch.Tensor] = {}
        """(stage, mb) -> that stage's input activation, received or handed over locally."""
        self.losses: list[float] = [0.0] * rt.schedule.n_microbatches
        self.pending: list[dist.Work] = []
        self.sends: list[tuple[dist.Work, torch.Tensor, tuple[int, int] | None]] = []
        """Sends in flight, their tensors (which must live until the send completes) and, for a stage's output sent
        forward, its (stage, micro-batch)."""
        self.batch: list[dist.P2POp] = []
        self.batch_keys: list[tuple[int, int] | None] = []

    def run(self) -> list[float] | None:
        rt = self.rt
        if self.record:
            rt.spans = []
        if rt.filler is not None:
            rt.filler.begin()
        for act in rt.actions:
            if act.compute:
                self.flush(wait=True)
                start = time.perf_counter()
                self.compute(act)
                if self.record:
                    rt.spans.append(Span(rt.rank, act, start, time.perf_counter()))
            else:
                self.comm(act)
        self.flush(wait=True)
        for work, _, _ in self.sends:
            work.wait()
        self.sends = []
        if rt.filler is not None:
            rt.filler.finish()
        return self.losses if rt.last in rt.stages else None

    def flush(self, wait: bool) -> None:
        if self.batch:
            works = dist.batch_isend_irecv(self.batch)
            for op, work, key in zip(self.batch, works, self.batch_keys, strict=True):
                if op.op is dist.irecv:
                    self.pending.append(work)
                else:
                    self.sends.append((work, op.tensor, key))
            self.batch, self.batch_keys = [], []
        if wait:
            for work in self.pending:
                work.wait()
            self.pending = []
            self.sends = [sent for sent in self.sends if not sent[0].is_completed()]

    def release_output(self, s: int, mb: int) -> None:
        """Free the send of stage ``s``'s output for micro-batch ``mb``: its gradient came back, so the next stage,
        whose backward needed that output, has received it (gloo's sends report completion only once waited for,
        so each would otherwise hold its tensor to the end of the step: every micro-batch's output at once)."""
        for index, (work, _, key) in enumerate(self.sends):
            if key == (s, mb):
                work.wait()  # done already: returns at once
                del self.sends[index]
                return

    def comm(self, act: Action) -> None:
        rt, s, mb = self.rt, act.stage, act.mb
        tag = _tag(act.kind, s, mb, rt.schedule.n_microbatches)
        place = rt.schedule.placement
        if act.kind is Kind.SEND_F:
            tensor, peer, op = self.outputs[s, mb].detach(), place[s + 1], dist.isend
        elif act.kind is Kind.SEND_B:
            tensor, peer, op = self.inputs.pop((s, mb)).grad, place[s - 1], dist.isend
            assert tensor is not None, f"{act} before the backward that produces it"
        elif act.kind is Kind.RECV_F:
            shape, dtype = rt._shapes[s]
            tensor, peer, op = torch.empty(shape, dtype=dtype), place[s - 1], dist.irecv
            self.incoming[s, mb] = tensor
        else:
            shape, dtype = rt._shapes[s + 1]
            tensor, peer, op = torch.empty(shape, dtype=dtype), place[s + 1], dist.irecv
            self.grads[s, mb] = tensor
        self.batch.append(dist.P2POp(op, tensor, rt._global(peer), rt.group, tag))
        self.batch_keys.append((s, mb) if act.kind is Kind.SEND_F else None)

    def compute(self, act: Action) -> None:
        rt, s, mb = self.rt, act.stage, act.mb
        if act.kind is Kind.H:
            rt.filler.help(act)  # type: ignore[union-attr]
            return
        if act.kind is Kind.F:
            x = self.x_mbs[mb] if s == 0 else self.incoming.pop((s, mb))
            if s > 0 and x.is_floating_point():
                x = x.detach().requires_grad_(True)
            self.inputs[s, mb] = x
            with rt.meter if rt.meter is not None else contextlib.nullcontext():
                if act.peer is not None:
                    out = rt.filler.forward(act, rt.stages[s], x)  # type: ignore[union-attr]
                else:
                    out = rt.stages[s](x)
                if s == rt.last:
                    loss = rt.loss_fn(out, self.t_mbs[mb]) / rt.schedule.n_microbatches
                    self.losses[mb] = float(loss.detach()) * rt.schedule.n_microbatches
                    out = loss
            self.outputs[s, mb] = out
            if s < rt.last and rt.schedule.placement[s + 1] == rt.rank:
                self.incoming[s + 1, mb] = out.detach()
            return
        out = self.outputs[s, mb]
        grad = None if s == rt.last else self.grads[s, mb]
        if act.kind is Kind.B:
            torch.autograd.backward(out, grad)
            self._done(s, mb)
        elif act.kind is Kind.I:
            x = self.inputs[s, mb]
            if x.requires_grad:
                (x.grad,) = torch.autograd.grad(out, x, grad, retain_graph=True)
            self._hand_back(s, mb)
        else:  # W: the weights' gradient, by a second pass through this stage's graph
            params = [p for p in rt.stages[s].parameters() if p.requires_grad]
            if params:
                torch.autograd.backward(out, grad, inputs=params)
            self._done(s, mb, hand_back=False)

    def _done(self, s: int, mb: int, hand_back: bool = True) -> None:
        if hand_back:
            self._hand_back(s, mb)
        self.outputs.pop((s, mb))
        if self.grads.pop((s, mb), None) is not None and self.rt.schedule.placement[s + 1] != self.rt.rank:
            self.release_output(s, mb)  # its gradient was received from the next stage's rank
        if not (s > 0 and self.rt.schedule.placement[s - 1] != self.rt.rank):
            self.inputs.pop((s, mb), None)  # else SEND_B takes it

    def _hand_back(self, s: int, mb: int) -> None:
        if s > 0 and self.rt.schedule.placement[s - 1] == self.rt.rank:
            self.grads[s - 1, mb] = self.inputs[s, mb].grad


def gather_spans(runtime: PipelineRuntime) -> list[Span] | None:
    """All ranks' recorded spans on rank 0 (others get None), times from the earliest start."""
    everything: list[list[Span] | None] = [None] * dist.get_world_size(runtime.group)
    dist.all_gather_object(everything, runtime.spans, group=runtime.group)
    if runtime.rank != 0:
        return None
    spans = [span for part in everything for span in (part or [])]
    t0 = min((span.start for span in spans), default=0.0)
    return [Span(s.rank, s.action, s.start - t0, s.end - t0) for s in spans]


def split_sequential(model: nn.Module, n_stages: int) -> list[nn.Sequential]:
    """Cut an ``nn.Sequential``-like model (iterable of layers, run one after another) into
    ``n_stages`` contiguous stages of as equal a layer count as possible."""
    layers = list(model.children()) if not isinstance(model, (list, tuple)) else list(model)
    if not layers:
        raise ScheduleError("the model has no layers to split; pass an nn.Sequential or a list of modules")
    if n_stages < 1 or n_stages > len(layers):
        raise ScheduleError(f"{n_stages} stages but the model has {len(layers)} layers; "
                            f"use between 1 and {len(layers)} stages")
    return [nn.Sequential(*layers[start:end]) for start, end in even_bounds(len(layers), n_stages)]
