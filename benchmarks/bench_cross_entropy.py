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

import torchdist_ext  # noqa: E402,F401
from torchdist_ext.ops import vocab_parallel_cross_entropy  # noqa: E402
from torchdist_ext.testing import spawn_world  # noqa: E402

SHAPES = {"cuda": [(4096, 32000), (8192, 128256), (16384, 50304)], "cpu": [(512, 8000), (1024, 32000)]}


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
                loss, _ = vocab_parallel_cross_entropy(logits, target, 0, vocab, -100, group)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    backend = "cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo"
    with spawn_world(1, backend=backend, timeout=1800.0, threads_per_rank=torch.get_num_threads()) as world:
        (rows,) = world.run(run, args.device, args.repeats)
    for row in rows:
        print(json.dumps(row))
    print()
    header = (f"{'device':>6} {'tokens x vocab':>16} {'dtype':>9} {'ours ms':>9} {'F.ce ms':>9} {'unfused ms':>10} "
              f"{'ours/F.ce':>9} {'ours/unfused':>12} {'of bw':>6}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['device']:>6} {str(r['tokens']) + 'x' + str(r['vocab']):>16} {r['dtype']:>9} {r['ours_ms']:9.3f} "
              f"{r['torch_fused_ms']:9.3f} {r['torch_unfused_ms']:10.3f} {r['ours_over_torch_fused']:9.3f} "
              f"{r['ours_over_torch_unfused']:12.3f} {r['bandwidth_fraction']:6.3f}")


if __name__ == "__main__":
    main()
