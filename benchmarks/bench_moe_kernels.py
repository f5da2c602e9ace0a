"""One rank's MoE kernels: permute / unpermute against the torch ops a torchtitan user writes and against
the device's copy bandwidth, and the grouped expert GEMM against a loop of per-expert matmuls.

    python -m benchmarks.bench_moe_kernels [--device cuda|cpu]

Rows received by a rank, each with top_k slots naming distinct local experts (uniform routing):
  permute     ours: tdx::moe_permute (one row per slot, expert-major) | torch: a stable argsort of the
              slots' experts and index_select of the rows
  unpermute   ours: tdx::moe_unpermute (each row the router-weighted sum of its slots' rows, fp32) |
              torch: index_select back to slot order, multiply by the weights, sum over the slots
  grouped_mm  the first expert projection [slots, dim] x [experts, ffn, dim]: torch._grouped_mm (GPU,
              bf16) or tdx::moe_grouped_mm (elsewhere, and what ours falls back to) against one torch.mm
              per expert
Reported: median times, ratios (ours / torch, grouped / loop), the fraction of the copy bandwidth
measured in the same run (permute moves each slot's row in and out; unpermute reads every slot's row
and writes each row once) and the grouped GEMM's TFLOP/s.
"""

import torch

from benchmarks.device_timing import copy_bandwidth, median_seconds
from benchmarks.report import arguments, emit, print_table
from torchdist_ext.ops import moe_grouped_mm, moe_permute, moe_unpermute

SHAPES = {  # (rows, dim, ffn, local experts, top_k)
    "cuda": [(16384, 4096, 8192, 8, 2), (8192, 2048, 1408, 32, 8)],
    "cpu": [(4096, 256, 512, 8, 2), (2048, 256, 256, 16, 6)],
}


def routing(rows: int, experts: int, top_k: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.rand(rows, experts, generator=gen).topk(top_k, dim=-1).indices  # distinct experts per row
    return ids.to(device), torch.rand(rows, top_k, generator=gen).to(device)


def torch_permute(x, ids, top_k):
    order = torch.argsort(ids.flatten(), stable=True)
    return x.index_select(0, order // top_k), order


def torch_unpermute(sorted_rows, order, weights):
    per_slot = torch.empty_like(sorted_rows).index_copy_(0, order, sorted_rows).view(*weights.shape, -1)
    return (per_slot.float() * weights.unsqueeze(-1)).sum(1).to(sorted_rows.dtype)


def grouped(x_sorted, weight, offsets, per_expert):
    if x_sorted.is_cuda and hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(x_sorted, weight.transpose(1, 2), offs=offsets)
    return moe_grouped_mm(x_sorted, weight, per_expert)


def loop(x_sorted, weight, sizes):
    return torch.cat([torch.mm(rows, w.t()) for rows, w in zip(x_sorted.split(sizes), weight)])


TABLE = [("device", 6, "device"),
         ("rows x dim x ffn, E, k", 24, lambda r: f"{r['rows']}x{r['dim']}x{r['ffn']}, {r['experts']}, {r['top_k']}"),
         ("perm/torch", 10, "permute_ours_over_torch", ".3f"), ("of bw", 6, "permute_bandwidth_fraction", ".3f"),
         ("unperm/torch", 12, "unpermute_ours_over_torch", ".3f"), ("of bw", 6, "unpermute_bandwidth_fraction", ".3f"),
         ("grouped/loop", 12, "grouped_over_loop", ".3f"), ("TFLOP/s", 8, "grouped_tflops", ".3f")]


def main() -> None:
    args = arguments(__doc__, device=True, repeats=20).parse_args()
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    bandwidth = copy_bandwidth(device)
    rows_out = []
    for rows, dim, ffn, experts, top_k in SHAPES[device]:
        ids, weights = routing(rows, experts, top_k, device)
        x = torch.randn(rows, dim, device=device).to(dtype)
        per_expert = torch.bincount(ids.flatten().cpu(), minlength=experts)
        sorted_rows, positions, offsets = moe_permute(x, ids, per_expert, experts, -1)
        _, order = torch_permute(x, ids, top_k)
        weight = (torch.randn(experts, ffn, dim, device=device) / dim**0.5).to(dtype)
        sizes = per_expert.tolist()
        times = {
            "permute_ours": lambda: moe_permute(x, ids, per_expert, experts, -1),
            "permute_torch": lambda: torch_permute(x, ids, top_k),
            "unpermute_ours": lambda: moe_unpermute(sorted_rows, positions, weights),
            "unpermute_torch": lambda: torch_unpermute(sorted_rows, order, weights),
            "grouped_mm": lambda: grouped(sorted_rows, weight, offsets, per_expert),
            "loop_mm": lambda: loop(sorted_rows, weight, sizes),
        }
        seconds = {name: median_seconds(fn, device, args.repeats) for name, fn in times.items()}
        row_bytes = dim * x.element_size()
        slots = rows * top_k
        row = {
            "bench": "moe_kernels", "device": device, "dtype": str(dtype).removeprefix("torch."), "rows": rows,
            "dim": dim, "ffn": ffn, "experts": experts, "top_k": top_k,
            **{f"{name}_ms": round(s * 1e3, 3) for name, s in seconds.items()},
            "permute_ours_over_torch": round(seconds["permute_ours"] / seconds["permute_torch"], 3),
            "unpermute_ours_over_torch": round(seconds["unpermute_ours"] / seconds["unpermute_torch"], 3),
            "grouped_over_loop": round(seconds["grouped_mm"] / seconds["loop_mm"], 3),
            "permute_bandwidth_fraction": round(2 * slots * row_bytes / seconds["permute_ours"] / bandwidth, 3),
            "unpermute_bandwidth_fraction": round((slots + rows) * row_bytes / seconds["unpermute_ours"] / bandwidth,
                                                  3),
            "grouped_tflops": round(2 * slots * dim * ffn / seconds["grouped_mm"] / 1e12, 3),
        }
        emit(row, rows_out)
    print()
    print_table(rows_out, TABLE)


if __name__ == "__main__":
    main()
