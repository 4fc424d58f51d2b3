"""One rank of the weight-sync section of benchmarks/rlhf.py: rank 0 is the trainer, the others rollouts.

    rlhf_sync.py RANK WORLD PORT SHAPE REPEATS BOARD SECRET

SHAPE ``dense``: SmolLM2-135M-Instruct's own parameters (the trainer loads the model; a rollout builds the same
architecture from its config, as a rollout holding its own copy does); ``moe``: the same bytes cut into 1,200
tensors. Per repeat, timed at rank 0 from the start of the sync to every rank holding the weights (a gloo barrier
on both sides): ``broadcast``, one ``dist.broadcast`` of all the bytes as a single flat tensor (the floor: no
packing, no unpacking); ``board``, convoy's weight board (pack into a /dev/shm slot, each rollout copies into its
own model); ``transport``, the path of rollouts on another host: trainer 0's weight service sends the board's slot
over the role transport (TCP on loopback, the handshake done once before), each rollout receives it and unpacks
into its own model. Rank 0 prints ``broadcast S``, ``board S`` and ``transport S`` per repeat, then whether every
rollout held the trainer's weights bit for bit (digests of each side's own tensors, after each method).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from convoy.workloads.lookahead.model import load_model  # noqa: E402
from convoy.workloads.rlhf.buckets import Manifest, digest  # noqa: E402
from convoy.parallel.transport import Credentials, Identity  # noqa: E402
from convoy.workloads.rlhf.weight_board import WeightBoard  # noqa: E402
from convoy.workloads.rlhf.weight_service import RemoteBoard, WeightService  # noqa: E402

MOE_TENSORS = 1200


def weights(rank: int, shape: str) -> dict[str, torch.Tensor]:
    if rank == 0:
        model, _ = load_model()
        named = {name: p.detach() for name, p in model.named_parameters()}
    else:
        from transformers import AutoConfig, AutoModelForCausalLM

        from convoy.workloads.lookahead.model import cache_dir
        config = AutoConfig.from_pretrained(cache_dir() / "smollm2-135m-instruct")
        model = AutoModelForCausalLM.from_config(config)
        named = {name: p.detach() for name, p in model.named_parameters()}
    if shape == "moe":
        flat = torch.cat([t.reshape(-1) for t in named.values()])
        named = {f"expert{i}.w": part.clone() for i, part in enumerate(flat.chunk(MOE_TENSORS))}
    return named


def same_everywhere(manifest: Manifest, named: dict[str, torch.Tensor], world: int) -> bool:
    """Whether every rank's own tensors hash alike (the rollouts' copies are the trainer's bit for bit)."""
    every: list[object] = [None] * world
    dist.all_gather_object(every, digest(manifest.pack(named)))
    return all(d == every[0] for d in every)


def main() -> None:
    rank, world, port, shape, repeats, board_path, secret = sys.argv[1:8]
    rank_i, world_i = int(rank), int(world)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank_i, world_size=world_i)
    named = weights(rank_i, shape)
    manifest = Manifest.of(named)
    total = sum(t.numel() for t in named.values())
    flat = torch.cat([t.reshape(-1) for t in named.values()]) if rank_i == 0 else torch.empty(total)
    path = Path(board_path)
    board = WeightBoard.create(path, manifest) if rank_i == 0 else None
    dist.barrier()
    board = board or WeightBoard.open(path)
    job = Credentials(bytes.fromhex(secret), Identity("trainer" if rank_i == 0 else "rollout", rank_i, 1))
    service = WeightService(board, credentials=job) if rank_i == 0 else None
    address = [service.address if service else ""]
    dist.broadcast_object_list(address, 0)
    remote = RemoteBoard(lambda: address[0], job) if rank_i != 0 else None
    if rank_i == 0:
        print(f"tensors {len(named)} bytes {total * 4}", flush=True)
    exact = []
    for repeat in range(int(repeats)):
        dist.barrier()
        began = time.perf_counter()
        dist.broadcast(flat, 0)
        dist.barrier()
        if rank_i == 0:
            print(f"broadcast {time.perf_counter() - began:.4f}", flush=True)
        dist.barrier()
        began = time.perf_counter()
        if rank_i == 0:
            board.publish(2 * repeat + 1, named, hashed=False)  # as the peer: no digest (the job hashes, +0.4 s)
        dist.barrier()  # published: the rollouts copy it
        if rank_i != 0:
            assert board.read_into(named, have=2 * repeat) == 2 * repeat + 1
        dist.barrier()
        if rank_i == 0:
            print(f"board {time.perf_counter() - began:.4f}", flush=True)
        exact.append(same_everywhere(manifest, named, world_i))
        if rank_i != 0:
            for tensor in named.values():
                tensor.zero_()  # what the transport brings is checked, not what the board left
        dist.barrier()
        began = time.perf_counter()
        if rank_i == 0:
            board.publish(2 * repeat + 2, named, hashed=False)
        dist.barrier()
        if remote is not None:
            assert remote.read_into(named, have=2 * repeat + 1) == 2 * repeat + 2
        dist.barrier()
        if rank_i == 0:
            print(f"transport {time.perf_counter() - began:.4f}", flush=True)
        exact.append(same_everywhere(manifest, named, world_i))
    if rank_i == 0:
        print(f"bit for bit {all(exact)}", flush=True)
        service.close()
        board.remove()
    else:
        remote.close()
        board.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
