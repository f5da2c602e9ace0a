"""Forward + backward of a tensor-parallel MLP block: ours against torch's DTensor tensor parallelism.

    python benchmarks/bench_tp.py [--worlds 2 4] [--repeats 10] [--quick]

Block: Linear(h, f) -> GELU -> Linear(f, h), fp32, on 2 and 4 gloo CPU ranks.
Variants, all on the same shapes in the same world:
  ours_ring     ColumnParallelLinear / RowParallelLinear (sequence-parallel: tdx ring ops that
                overlap each block's GEMM with the next block's transfer)
  ours_bulk     the same math with one bulk all-gather / reduce-scatter around plain GEMMs
                (what the ring replaces; sequence-parallel only)
  torch         torch.distributed.tensor.parallel: ColwiseParallel + RowwiseParallel
                (with input/output layouts Shard(1) for sequence parallelism)
  compute_only  the same local GEMMs and GELU with no communication: the floor
Reported per case: the median over repeats of the slowest rank's step time, the
ratios ours/torch and ring/bulk, and compute_only / ours_ring (the fraction of
the physical floor reached). One JSON line per case, then a table.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from world_timing import median_step_seconds  # noqa: E402

import torchdist_ext  # noqa: E402,F401
from torchdist_ext.parallel import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from torchdist_ext.parallel.regions import (  # noqa: E402
    gather_from_sequence_region,
    reduce_scatter_to_sequence_region,
)
from torchdist_ext.testing import cached_mesh, spawn_world  # noqa: E402

SIZES = [  # (batch, seq, hidden, ffn)
    (4, 256, 256, 1024),
    (4, 512, 512, 2048),
    (2, 1024, 1024, 4096),
]


class BulkBlock(nn.Module):
    """Sequence-parallel MLP with bulk collectives around the local GEMMs."""

    def __init__(self, up: ColumnParallelLinear, down: RowParallelLinear):
        super().__init__()
        self.up_weight = nn.Parameter(up.weight.to_local().detach().clone())
        self.up_bias = nn.Parameter(up.bias.to_local().detach().clone())
        self.down_weight = nn.Parameter(down.weight.to_local().detach().clone())
        self.group = up.tp

    def forward(self, x):
        hidden = F.gelu(F.linear(gather_from_sequence_region(x, self.group, 1), self.up_weight, self.up_bias))
        return reduce_scatter_to_sequence_region(F.linear(hidden, self.down_weight), self.group, 1)


class ComputeOnly(nn.Module):
    """The local GEMMs of one rank, no communication."""

    def __init__(self, hidden: int, ffn_local: int):
        super().__init__()
        self.up = nn.Linear(hidden, ffn_local)
        self.down = nn.Linear(ffn_local, hidden, bias=False)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


def torch_tp_block(reference: nn.Sequential, tp_mesh, sequence_parallel: bool) -> nn.Module:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if sequence_parallel:
        plan = {"0": ColwiseParallel(input_layouts=Shard(1)), "2": RowwiseParallel(output_layouts=Shard(1))}
    else:
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    return parallelize_module(reference, tp_mesh, plan)


def run_case(batch: int, seq: int, hidden: int, ffn: int, sequence_parallel: bool, repeats: int, warmup: int):
    """Runs on every rank; returns this rank's median step time per variant."""
    n = dist.get_world_size()
    mesh = cached_mesh((n,), ("tp",))
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden, bias=False))
    up = ColumnParallelLinear.from_linear(reference[0], tp_mesh=mesh, sequence_parallel=sequence_parallel)
    down = RowParallelLinear.from_linear(reference[2], tp_mesh=mesh, sequence_parallel=sequence_parallel)
    ours = nn.Sequential(up, nn.GELU(), down)
    local_seq = seq // n if sequence_parallel else seq
    x = torch.randn(batch, local_seq, hidden, generator=torch.Generator().manual_seed(1))
    upstream = torch.randn(batch, local_seq, hidden, generator=torch.Generator().manual_seed(2))
    variants = {"ours_ring": ours, "torch": torch_tp_block(reference, mesh, sequence_parallel)}
    if sequence_parallel:
        variants["ours_bulk"] = BulkBlock(up, down)
    with torch.no_grad():  # the variants compute the same function
        expected = ours(x)
        for name, model in variants.items():
            torch.testing.assert_close(model(x), expected, atol=1e-4, rtol=1e-4, msg=f"{name} disagrees")
    cases = {name: (model, x, upstream) for name, model in variants.items()}
    x_full = torch.randn(batch, seq, hidden)
    cases["compute_only"] = (ComputeOnly(hidden, ffn // n), x_full, torch.randn(batch, seq, hidden))
    return median_step_seconds(cases, repeats, warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(range(len(SIZES))),
                        help=f"indices into SIZES {SIZES}")
    parser.add_argument("--quick", action="store_true", help="only the smallest size, 3 repeats")
    args = parser.parse_args()
    sizes = SIZES[:1] if args.quick else [SIZES[i] for i in args.sizes]
    repeats = min(3, args.repeats) if args.quick else args.repeats
    rows = []
    for world_size in args.worlds:
        with spawn_world(world_size, timeout=1800.0) as world:
            for batch, seq, hidden, ffn in sizes:
                for sequence_parallel in (True, False):
                    per_rank = world.run(run_case, batch, seq, hidden, ffn, sequence_parallel, repeats, args.warmup)
                    slowest = {name: max(r[name] for r in per_rank) for name in per_rank[0]}
                    row = {
                        "bench": "tp_mlp_fwd_bwd",
                        "world": world_size,
                        "mode": "tp+sp" if sequence_parallel else "tp",
                        "batch": batch, "seq": seq, "hidden": hidden, "ffn": ffn,
                        **{f"{name}_ms": round(seconds * 1e3, 3) for name, seconds in slowest.items()},
                        "ours_over_torch": round(slowest["ours_ring"] / slowest["torch"], 3),
                        "floor_fraction": round(slowest["compute_only"] / slowest["ours_ring"], 3),
                    }
                    if sequence_parallel:
                        row["ring_over_bulk"] = round(slowest["ours_ring"] / slowest["ours_bulk"], 3)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    print()
    header = (f"{'world':>5} {'mode':>6} {'b x s x h x f':>20} {'ours ms':>9} {'bulk ms':>9} {'torch ms':>9} "
              f"{'floor ms':>9} {'ours/torch':>10} {'ring/bulk':>9} {'floor/ours':>10}")
    print(header)
    print("-" * len(header))
    for r in rows:
        shape = f"{r['batch']}x{r['seq']}x{r['hidden']}x{r['ffn']}"
        bulk = f"{r['ours_bulk_ms']:9.2f}" if "ours_bulk_ms" in r else f"{'-':>9}"
        ring_bulk = f"{r['ring_over_bulk']:9.3f}" if "ring_over_bulk" in r else f"{'-':>9}"
        print(f"{r['world']:>5} {r['mode']:>6} {shape:>20} {r['ours_ring_ms']:9.2f} {bulk} {r['torch_ms']:9.2f} "
              f"{r['compute_only_ms']:9.2f} {r['ours_over_torch']:10.3f} {ring_bulk} {r['floor_fraction']:10.3f}")


if __name__ == "__main__":
    main()
