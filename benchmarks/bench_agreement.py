"""The rank-agreement check's cost per call: ops with the check on against the same calls with it off.

    python -m benchmarks.bench_agreement [--worlds 2 4] [--repeats 30] [--quick]

Calls, on gloo CPU ranks, each timed with the check "on" and "off" in the same world (interleaved):
  ring_attention    tdx::ring_attention_fwd, q = k = v [1, 8, S/n, 64] fp32, causal
  all_gather_mm     tdx::all_gather_matmul, x [S/n, 512] @ [512, 512].T
  check_only        torchdist_ext.agreement.check_agreement with four fields (the check alone)
Sizes: S = 256 (a small call, where the check weighs most) and S = 2048. Reported: the median over repeats of
the slowest rank's time per call, on - off (the check's cost in microseconds) and on / off.
"""

import torch
import torch.distributed as dist

import torchdist_ext
from benchmarks.report import Column, arguments, emit, print_table, sizes_and_repeats
from benchmarks.world_timing import median_call_seconds
from torchdist_ext.agreement import check_agreement
from torchdist_ext.testing import spawn_world

SIZES = [256, 2048]  # the whole sequence S


def calls(seq: int) -> dict:
    """The calls of one size, on this rank."""
    n, name = dist.get_world_size(), dist.group.WORLD.group_name
    q = torch.randn(1, 8, seq // n, 64)
    x, weight = torch.randn(seq // n, 512), torch.randn(512, 512)
    fields = {"dim": 512, "heads": 8, "causal": True, "order": "contiguous"}
    return {
        "ring_attention": lambda: torch.ops.tdx.ring_attention_fwd(q, q, q, name, True, 0.125, "contiguous"),
        "all_gather_mm": lambda: torch.ops.tdx.all_gather_matmul(x, weight, name, 0, False),
        "check_only": lambda: check_agreement(dist.group.WORLD, "bench", fields),
    }


def run_case(seq: int, repeats: int, warmup: int) -> dict[str, float]:
    """This rank's median seconds per "call/mode", the modes of a call interleaved."""
    def in_mode(fn, mode: str):
        def call():
            torchdist_ext.set_agreement_checks(mode)
            fn()
        return call

    previous = torchdist_ext.agreement_checks()
    try:
        timed = {}
        for name, fn in calls(seq).items():
            medians = median_call_seconds({mode: in_mode(fn, mode) for mode in ("on", "off")}, repeats, warmup)
            timed.update({f"{name}/{mode}": seconds for mode, seconds in medians.items()})
        return timed
    finally:
        torchdist_ext.set_agreement_checks(previous)


def main() -> None:
    parser = arguments(__doc__, worlds=[2, 4], repeats=30, warmup=5, sizes=SIZES, quick=True)
    args = parser.parse_args()
    sizes, repeats = sizes_and_repeats(args, SIZES)
    rows = []
    for world_size in args.worlds:
        with spawn_world(world_size) as world:
            for seq in sizes:
                per_rank = world.run(run_case, seq, repeats, args.warmup)
                for call in ("ring_attention", "all_gather_mm", "check_only"):
                    on = max(r[f"{call}/on"] for r in per_rank)
                    off = max(r[f"{call}/off"] for r in per_rank)
                    emit({"world": world_size, "seq": seq, "call": call, "on_us": on * 1e6, "off_us": off * 1e6,
                          "cost_us": (on - off) * 1e6, "ratio": on / off}, rows)
    print_table(rows, [Column("world", 5, "world"), Column("S", 6, "seq"), Column("call", 15, "call"),
                       Column("on us", 9, "on_us", ".0f"), Column("off us", 9, "off_us", ".0f"),
                       Column("cost us", 9, "cost_us", ".0f"), Column("on/off", 7, "ratio", ".2f")])


if __name__ == "__main__":
    main()
