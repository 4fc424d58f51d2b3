"""Worker processes for benchmarks/checkpoint.py: train until killed, restore, or torch.load.

    ckpt_worker.py train   --layers L --width W --dir D   # snapshots every step; prints "done <step>"
    ckpt_worker.py restore --layers L --width W --dir D   # times Checkpointer.restore(); prints JSON
    ckpt_worker.py load    --layers L --width W --file F  # times torch.load + load_state_dict; prints JSON

``train`` and ``restore`` need ``CONVOY_JOB_ID`` (the shared-memory segment to write or read).
``restore`` and ``load`` start up (import torch, build the model), print ``ready``, and measure
only after a line arrives on stdin, so the benchmark can start them all at once and time one at a time.
The model is a stack of ``Linear(W, W)`` layers with Adam, built the same way in every role.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import convoy


def build(layers: int, width: int, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The benchmark's model (``layers`` x ``Linear(width, width)`` with ReLUs) and its Adam."""
    torch.manual_seed(seed)
    modules: list[torch.nn.Module] = []
    for index in range(layers):
        modules.append(torch.nn.Linear(width, width))
        if index < layers - 1:
            modules.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*modules)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def forward_backward(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: int,
                     generator: torch.Generator) -> None:
    """One training step up to (not including) ``optimizer.step()``."""
    width = next(model.parameters()).shape[1]
    inputs = torch.randn(batch, width, generator=generator)
    loss = model(inputs).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()


def train(args: argparse.Namespace) -> None:
    """Train with a snapshot after every step, forever; the benchmark SIGKILLs this process."""
    model, optimizer = build(args.layers, args.width)
    ckpt = convoy.Checkpointer(model, optimizer, directory=args.dir)
    generator = torch.Generator().manual_seed(1)
    step = ckpt.restore()
    while True:
        forward_backward(model, optimizer, args.batch, generator)
        optimizer.step()
        ckpt.step(step)
        print(f"done {step}", flush=True)
        step += 1


def ready() -> None:
    """Say that start-up is over, and wait for the go-ahead."""
    print("ready", flush=True)
    sys.stdin.readline()


def restore(args: argparse.Namespace) -> None:
    """A restarted worker: build the model, time reading the snapshot back into it, then time what
    the first optimizer.step() waits for in the Checkpointer's pre-step hook (work restore() left running)."""
    model, optimizer = build(args.layers, args.width, seed=1)
    marks: dict[str, float] = {}
    optimizer.register_step_pre_hook(lambda *_: marks.__setitem__("before", time.perf_counter()))
    ready()
    started = time.perf_counter()
    ckpt = convoy.Checkpointer(model, optimizer, directory=args.dir)
    optimizer.register_step_pre_hook(lambda *_: marks.__setitem__("after", time.perf_counter()))
    created, cpu = time.perf_counter(), time.process_time()
    start = ckpt.restore()
    done, cpu = time.perf_counter(), time.process_time() - cpu
    forward_backward(model, optimizer, args.batch, torch.Generator().manual_seed(1))
    optimizer.step()
    filled = sum(len(s) for s in optimizer.state.values())
    print(json.dumps({"construct_s": created - started, "restore_s": done - created, "restore_cpu_s": cpu,
                      "start": start,
                      "first_wait_s": marks["after"] - marks["before"], "from": ckpt.restored_from,
                      "optimizer_tensors": filled}), flush=True)
    ckpt.close()


def load(args: argparse.Namespace) -> None:
    """The peer of ``restore``: torch.load a torch.save file and load it into a fresh model."""
    model, optimizer = build(args.layers, args.width, seed=1)
    ready()
    started = time.perf_counter()
    state = torch.load(args.file)
    loaded = time.perf_counter()
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])
    done = time.perf_counter()
    print(json.dumps({"load_s": loaded - started, "apply_s": done - loaded}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["train", "restore", "load"])
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dir", default="", help="persistent checkpoint directory (stays empty here)")
    parser.add_argument("--file", default="", help="the torch.save file to load")
    args = parser.parse_args()
    if args.role == "load":
        load(args)
        return
    convoy.init(backend="gloo")
    try:
        train(args) if args.role == "train" else restore(args)
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
