"""The fused log-sum-exp merge (tdx::lse_merge_) against the unfused torch expression.

    python -m benchmarks.bench_lse_merge [--device cuda|cpu]

Merging one partial attention result (block_out [B, H, S, D] in bf16 or fp32,
block_lse [B, H, S]) into an fp32 accumulator is what ring attention does once
per step. The unfused expression is

    new = logaddexp(lse, block_lse)
    out = out * exp(lse - new)[..., None] + block_out.float() * exp(block_lse - new)[..., None]

Reported: median times, ours / unfused, and the fraction of the device's copy
bandwidth (measured in the same run) that our kernel reaches, counting one read
and one write of the accumulator and one read of the block.
"""

import torch

from benchmarks.device_timing import copy_bandwidth, median_seconds
from benchmarks.report import arguments, emit, print_table
from torchdist_ext.ops import lse_merge_

SHAPES = {"cuda": [(1, 32, 8192, 128), (4, 32, 4096, 128), (1, 64, 16384, 128)],
          "cpu": [(1, 8, 4096, 64), (1, 32, 4096, 128)]}


def unfused(out, lse, block_out, block_lse):
    new = torch.logaddexp(lse, block_lse)
    out.mul_((lse - new).exp().unsqueeze(-1)).add_(block_out.float() * (block_lse - new).exp().unsqueeze(-1))
    lse.copy_(new)


TABLE = [("device", 6, "device"), ("shape", 22, lambda r: "x".join(map(str, r["shape"]))), ("block", 9, "block_dtype"),
         ("ours ms", 9, "ours_ms", ".3f"), ("unfused ms", 10, "unfused_ms", ".3f"),
         ("ours/unfused", 12, "ours_over_unfused", ".3f"), ("of bw", 6, "bandwidth_fraction", ".3f")]


def main() -> None:
    args = arguments(__doc__, device=True, repeats=20).parse_args()
    bandwidth = copy_bandwidth(args.device)
    rows = []
    for shape in SHAPES[args.device]:
        for dtype in (torch.bfloat16, torch.float32):
            out = torch.randn(shape, device=args.device)
            lse = torch.randn(shape[:-1], device=args.device)
            block_out = torch.randn(shape, device=args.device).to(dtype)
            block_lse = torch.randn(shape[:-1], device=args.device)
            ours = median_seconds(lambda: lse_merge_(out, lse, block_out, block_lse), args.device, args.repeats)
            theirs = median_seconds(lambda: unfused(out, lse, block_out, block_lse), args.device, args.repeats)
            moved = 2 * out.numel() * 4 + block_out.numel() * block_out.element_size() + 3 * lse.numel() * 4
            row = {"bench": "lse_merge", "device": args.device, "shape": list(shape),
                   "block_dtype": str(dtype).removeprefix("torch."), "ours_ms": round(ours * 1e3, 3),
                   "unfused_ms": round(theirs * 1e3, 3), "ours_over_unfused": round(ours / theirs, 3),
                   "bandwidth_fraction": round(moved / ours / bandwidth, 3)}
            emit(row, rows)
    print()
    print_table(rows, TABLE)


if __name__ == "__main__":
    main()
