"""Main job: train a small Llama on a byte-level corpus with FSDP2 (dp) x tensor parallelism (tp).

    torchrun --nproc-per-node 4 examples/train_llama.py            # dp=2 x tp=2, sequence parallel
    torchrun --nproc-per-node 4 examples/train_llama.py --check    # + the same run in one process

Every rank builds the same single-process model (same seed), converts it to
tensor-parallel layers with the same weights and shards it over dp with
FSDP2. Each step draws one global batch of byte windows (same generator on
every rank); data-parallel rank d trains on its slice. The loss printed is
the global mean. ``--check`` then trains the plain model in one process
(rank 0) on the whole batches and prints the largest relative loss
difference over the steps; it exits non-zero above ``--check-tolerance``.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama import Llama, LlamaConfig, parallelize_llama  # noqa: E402

import torchdist_ext  # noqa: E402,F401

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=int, default=None, help="data-parallel size (default: world size / tp)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    parser.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false",
                        help="replicate activations between blocks instead of sharding them along the sequence")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true", help="torch.compile every transformer block (fullgraph)")
    parser.add_argument("--check", action="store_true", help="also train in one process and compare losses")
    parser.add_argument("--check-tolerance", type=float, default=1e-4)
    return parser.parse_args(argv)


def batches(steps: int, batch: int, seq: int, seed: int):
    """(tokens, target) ``[batch, seq]`` byte windows; the same sequence on every rank."""
    data = torch.frombuffer(bytearray(CORPUS.read_bytes()), dtype=torch.uint8).long()
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=generator)
        windows = torch.stack([data[s : s + seq + 1] for s in starts.tolist()])
        yield windows[:, :-1], windows[:, 1:]


def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """Clips by the norm of the *whole* gradient: DTensor shards are reduced over every mesh dim first."""
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads)
    if isinstance(total, torch.distributed.tensor.DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(grads, max_norm, total)
    return total


def build_model(args) -> Llama:
    torch.manual_seed(args.seed)
    return Llama(LlamaConfig(max_seq_len=args.seq))


def train_parallel(args, world_size: int, rank: int) -> list[float]:
    dp = args.dp or world_size // args.tp
    if dp * args.tp != world_size:
        raise ValueError(f"--dp {dp} x --tp {args.tp} must equal the world size {world_size}")
    if args.batch % dp:
        raise ValueError(f"--batch {args.batch} must be divisible by dp={dp}")
    mesh = init_device_mesh("cpu", (dp, args.tp), mesh_dim_names=("dp", "tp"))
    # A flattened dp x tp mesh lets DTensor reduce the gradient norm in one all-reduce.
    mesh["dp", "tp"]._flatten("dp_tp")
    model = parallelize_llama(build_model(args), tp_mesh=mesh["tp"], dp_mesh=mesh["dp"],
                              sequence_parallel=args.sequence_parallel, compile=args.compile)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    dp_rank, dp_group = mesh["dp"].get_local_rank(), mesh["dp"].get_group()
    if rank == 0:
        print(f"world {world_size}: dp={dp} x tp={args.tp}, sequence_parallel={args.sequence_parallel}, "
              f"compile={args.compile}; {sum(p.numel() for p in model.parameters()):,} parameters", flush=True)
    losses = []
    for step, (tokens, target) in enumerate(batches(args.steps, args.batch, args.seq, args.seed)):
        start = time.perf_counter()
        loss = model(tokens.chunk(dp)[dp_rank], target.chunk(dp)[dp_rank])
        loss.backward()
        grad_norm = clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, group=dp_group)
        global_loss /= dp
        losses.append(global_loss.item())
        elapsed = time.perf_counter() - start
        if rank == 0:
            print(f"step {step:3d}  loss {losses[-1]:.4f}  grad_norm {grad_norm.item():.3f}  "
                  f"{tokens.numel() / elapsed:,.0f} tokens/s", flush=True)
    return losses


def train_single_process(args) -> list[float]:
    model = build_model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for tokens, target in batches(args.steps, args.batch, args.seq, args.seed):
        loss = model(tokens, target)
        loss.backward()
        clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def main(argv=None) -> int:
    args = parse_args(argv)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        losses = train_parallel(args, world_size, rank)
        status = 0
        if args.check and rank == 0:
            reference = train_single_process(args)
            worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
            print(f"check: single-process losses {reference[0]:.4f} -> {reference[-1]:.4f}; "
                  f"largest relative loss difference over {len(losses)} steps: {worst:.2e} "
                  f"(tolerance {args.check_tolerance:.0e})", flush=True)
            status = 0 if worst <= args.check_tolerance else 1
        verdict = torch.tensor([status])
        dist.all_reduce(verdict)
        return int(verdict.item() != 0)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
