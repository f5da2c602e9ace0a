"""Single-device cross-entropy kernels: the fused tdx kernel against the unfused torch computation.

    python benchmarks/bench_cross_entropy.py [--device cuda|cpu]

On one rank (tp=1) the vocab-parallel op is its fused kernels plus a
one-rank all-gather; it is timed, forward + backward, against
  torch_fused      F.cross_entropy (ATen's log_softmax + nll_loss)
  torch_unfused    logsumexp(logits.float()) - logits.gather(target): the expression a
                   vocab-parallel implementation in plain torch computes per shard
for a few (tokens x vocab) shapes in bf16 and fp32. Also reported: the fraction of
the device's copy bandwidth (measured in the same run) that our kernels reach,
counting one read of the logits forward and one read + one write backward.

Memory: an LM head (``logits = hidden @ weight.T``, bf16) and its loss, forward +
backward, with F.cross_entropy, with ours, and with ours and ``inplace_backward=True``
(the logits' gradient written over the logits): the peak memory above the step's
inputs (CUDA: allocator peak; CPU: resident memory) and the time. The logits are
``tokens x vocab x 2`` bytes; in-place should save about that much at the peak.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from device_timing import copy_bandwidth, median_seconds  # noqa: E402
from peak_memory import PeakMemory  # noqa: E402

import torchdist_ext  # noqa: E402,F401
from torchdist_ext.ops import vocab_parallel_cross_entropy_fwd  # noqa: E402
from torchdist_ext.testing import spawn_world  # noqa: E402

SHAPES = {"cuda": [(4096, 32000), (8192, 128256), (16384, 50304)], "cpu": [(512, 8000), (1024, 32000)]}
# (tokens, vocab, hidden) of the LM-head memory cases; on CPU a small hidden keeps the GEMMs short.
HEAD_SHAPES = {"cuda": [(8192, 128256, 4096)], "cpu": [(4096, 32000, 64)]}


def run(device: str, repeats: int) -> list[dict]:
    group = dist.group.WORLD.group_name
    bandwidth = copy_bandwidth(device)
    rows = []
    for tokens, vocab in SHAPES[device]:
        for dtype in (torch.bfloat16, torch.float32):
            gen = torch.Generator().manual_seed(0)
            logits = torch.randn(tokens, vocab, generator=gen).to(dtype).to(device).requires_grad_(True)
            target = torch.randint(0, vocab, (tokens,), generator=gen).to(device)

            def ours():
                loss, _ = vocab_parallel_cross_entropy_fwd(logits, target, 0, vocab, -100, group)
                loss.mean().backward()

            def torch_fused():
                F.cross_entropy(logits, target).backward()

            def torch_unfused():
                lse = logits.float().logsumexp(-1)
                picked = logits.gather(-1, target[:, None]).squeeze(-1).float()
                (lse - picked).mean().backward()

            times = {name: median_seconds(fn, device, repeats) for name, fn in
                     (("ours", ours), ("torch_fused", torch_fused), ("torch_unfused", torch_unfused))}
            logits.grad = None
            moved = 3 * logits.numel() * logits.element_size()
            rows.append({
                "bench": "cross_entropy_fwd_bwd", "device": device, "tokens": tokens, "vocab": vocab,
                "dtype": str(dtype).removeprefix("torch."),
                **{f"{name}_ms": round(seconds * 1e3, 3) for name, seconds in times.items()},
                "ours_over_torch_fused": round(times["ours"] / times["torch_fused"], 3),
                "ours_over_torch_unfused": round(times["ours"] / times["torch_unfused"], 3),
                "bandwidth_fraction": round(moved / times["ours"] / bandwidth, 3),
            })
    return rows


def run_head_memory(device: str, repeats: int) -> list[dict]:
    group = dist.group.WORLD.group_name
    rows = []
    for tokens, vocab, hidden_size in HEAD_SHAPES[device]:
        gen = torch.Generator().manual_seed(0)
        hidden = (torch.randn(tokens, hidden_size, generator=gen) / hidden_size**0.5).bfloat16().to(device)
        weight = torch.randn(vocab, hidden_size, generator=gen).bfloat16().to(device).requires_grad_(True)
        hidden.requires_grad_(True)
        target = torch.randint(0, vocab, (tokens,), generator=gen).to(device)

        def step(loss_fn):
            def run():
                loss_fn(hidden @ weight.T).backward()
                hidden.grad = weight.grad = None
            return run

        variants = {
            "torch_fused": lambda logits: F.cross_entropy(logits, target),
            "ours": lambda logits: vocab_parallel_cross_entropy_fwd(logits, target, 0, vocab, -100, group)[0].mean(),
            "ours_inplace": lambda logits: vocab_parallel_cross_entropy_fwd(
                logits, target, 0, vocab, -100, group, inplace_backward=True)[0].mean(),
        }
        row = {"bench": "lm_head_memory", "device": device, "tokens": tokens, "vocab": vocab, "hidden": hidden_size,
               "dtype": "bfloat16", "logits_mb": round(tokens * vocab * 2 / 2**20, 1)}
        for name, loss_fn in variants.items():
            step(loss_fn)()  # warm-up: first-touch allocations stay out of the peak
            with PeakMemory(device) as memory:
                step(loss_fn)()
            row[f"{name}_peak_mb"] = round(memory.peak_mb, 1)
            row[f"{name}_ms"] = round(median_seconds(step(loss_fn), device, repeats) * 1e3, 3)
        row["inplace_saved_mb"] = round(row["ours_peak_mb"] - row["ours_inplace_peak_mb"], 1)
        rows.append(row)
    return rows


def print_tables(rows: list[dict]) -> None:
    kernels = [r for r in rows if r["bench"] == "cross_entropy_fwd_bwd"]
    header = (f"{'device':>6} {'tokens x vocab':>16} {'dtype':>9} {'ours ms':>9} {'F.ce ms':>9} {'unfused ms':>10} "
              f"{'ours/F.ce':>9} {'ours/unfused':>12} {'of bw':>6}")
    print(header)
    print("-" * len(header))
    for r in kernels:
        print(f"{r['device']:>6} {str(r['tokens']) + 'x' + str(r['vocab']):>16} {r['dtype']:>9} {r['ours_ms']:9.3f} "
              f"{r['torch_fused_ms']:9.3f} {r['torch_unfused_ms']:10.3f} {r['ours_over_torch_fused']:9.3f} "
              f"{r['ours_over_torch_unfused']:12.3f} {r['bandwidth_fraction']:6.3f}")
    print()
    header = (f"{'device':>6} {'tokens x vocab x hidden':>24} {'logits MiB':>10} {'peak MiB: F.ce':>14} {'ours':>7} "
              f"{'inplace':>7} {'saved':>7} {'ms: F.ce':>9} {'ours':>8} {'inplace':>8}")
    print(header)
    print("-" * len(header))
    for r in (r for r in rows if r["bench"] == "lm_head_memory"):
        shape = f"{r['tokens']}x{r['vocab']}x{r['hidden']}"
        print(f"{r['device']:>6} {shape:>24} {r['logits_mb']:10.1f} {r['torch_fused_peak_mb']:14.1f} "
              f"{r['ours_peak_mb']:7.1f} {r['ours_inplace_peak_mb']:7.1f} {r['inplace_saved_mb']:7.1f} "
              f"{r['torch_fused_ms']:9.2f} {r['ours_ms']:8.2f} {r['ours_inplace_ms']:8.2f}")


def run_all(device: str, repeats: int) -> list[dict]:
    return run(device, repeats) + run_head_memory(device, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    backend = "cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo"
    with spawn_world(1, backend=backend, timeout=1800.0, threads_per_rank=torch.get_num_threads()) as world:
        (rows,) = world.run(run_all, args.device, args.repeats)
    for row in rows:
        print(json.dumps(row))
    print()
    print_tables(rows)

if __name__ == "__main__":
    main()
