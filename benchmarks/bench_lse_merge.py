"""The fused log-sum-exp merge (tdx::lse_merge_) against the unfused torch expression.

    python benchmarks/bench_lse_merge.py [--device cuda|cpu]

Merging one partial attention result (block_out [B, H, S, D] in bf16 or fp32,
block_lse [B, H, S]) into an fp32 accumulator is what ring attention does once
per step. The unfused expression is

    new = logaddexp(lse, block_lse)
    out = out * exp(lse - new)[..., None] + block_out.float() * exp(block_lse - new)[..., None]

Reported: median times, ours / unfused, and the fraction of the device's copy
bandwidth (measured in the same run) that our kernel reaches, counting one read
and one write of the accumulator and one read of the block.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from device_timing import copy_bandwidth, median_seconds  # noqa: E402

from torchdist_ext.ops import lse_merge_  # noqa: E402

SHAPES = {"cuda": [(1, 32, 8192, 128), (4, 32, 4096, 128), (1, 64, 16384, 128)],
          "cpu": [(1, 8, 4096, 64), (1, 32, 4096, 128)]}


def unfused(out, lse, block_out, block_lse):
    new = torch.logaddexp(lse, block_lse)
    out.mul_((lse - new).exp().unsqueeze(-1)).add_(block_out.float() * (block_lse - new).exp().unsqueeze(-1))
    lse.copy_(new)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
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
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print(f"{'device':>6} {'shape':>22} {'block':>9} {'ours ms':>9} {'unfused ms':>10} "
          f"{'ours/unfused':>12} {'of bw':>6}")
    for r in rows:
        print(f"{r['device']:>6} {'x'.join(map(str, r['shape'])):>22} {r['block_dtype']:>9} {r['ours_ms']:9.3f} "
              f"{r['unfused_ms']:10.3f} {r['ours_over_unfused']:12.3f} {r['bandwidth_fraction']:6.3f}")


if __name__ == "__main__":
    main()
