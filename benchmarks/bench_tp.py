"""Forward + backward of a tensor-parallel MLP block: ours against torch's DTensor tensor parallelism.

    python -m benchmarks.bench_tp [--worlds 2 4] [--repeats 10] [--quick]

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

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import torchdist_ext  # noqa: F401
from benchmarks.report import arguments, emit, print_table, sizes_and_repeats
from benchmarks.world_timing import median_step_seconds
from torchdist_ext.parallel import ColumnParallelLinear, RowParallelLinear
from torchdist_ext.parallel.regions import gather_from_sequence_region, reduce_scatter_to_sequence_region
from torchdist_ext.testing import cached_mesh, spawn_world

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


TABLE = [("world", 5, "world"), ("mode", 6, "mode"),
         ("b x s x h x f", 20, lambda r: f"{r['batch']}x{r['seq']}x{r['hidden']}x{r['ffn']}"),
         ("ours ms", 9, "ours_ring_ms", ".2f"), ("bulk ms", 9, "ours_bulk_ms", ".2f"),
         ("torch ms", 9, "torch_ms", ".2f"), ("floor ms", 9, "compute_only_ms", ".2f"),
         ("ours/torch", 10, "ours_over_torch", ".3f"), ("ring/bulk", 9, "ring_over_bulk", ".3f"),
         ("floor/ours", 10, "floor_fraction", ".3f")]


def main() -> None:
    args = arguments(__doc__, worlds=[2, 4], repeats=10, warmup=3, sizes=SIZES, quick=True).parse_args()
    sizes, repeats = sizes_and_repeats(args, SIZES)
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
                    emit(row, rows)
    print()
    print_table(rows, TABLE)


if __name__ == "__main__":
    main()
