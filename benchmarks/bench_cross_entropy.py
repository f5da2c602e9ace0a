"""Single-device cross-entropy kernels: the fused tdx kernel against the unfused torch computation.

    python -m benchmarks.bench_cross_entropy [--device cuda|cpu]

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

import torch
import torch.distributed as dist
import torch.nn.functional as F

import torchdist_ext  # noqa: F401
from benchmarks.device_timing import copy_bandwidth, median_seconds
from benchmarks.peak_memory import PeakMemory
from benchmarks.report import arguments, emit, print_table
from torchdist_ext.ops import vocab_parallel_cross_entropy_fwd
from torchdist_ext.testing import spawn_world

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


KERNEL_TABLE = [("device", 6, "device"), ("tokens x vocab", 16, lambda r: f"{r['tokens']}x{r['vocab']}"),
                ("dtype", 9, "dtype"), ("ours ms", 9, "ours_ms", ".3f"), ("F.ce ms", 9, "torch_fused_ms", ".3f"),
                ("unfused ms", 10, "torch_unfused_ms", ".3f"), ("ours/F.ce", 9, "ours_over_torch_fused", ".3f"),
                ("ours/unfused", 12, "ours_over_torch_unfused", ".3f"), ("of bw", 6, "bandwidth_fraction", ".3f")]
HEAD_TABLE = [("device", 6, "device"),
              ("tokens x vocab x hidden", 24, lambda r: f"{r['tokens']}x{r['vocab']}x{r['hidden']}"),
              ("logits MiB", 10, "logits_mb", ".1f"), ("peak MiB: F.ce", 14, "torch_fused_peak_mb", ".1f"),
              ("ours", 7, "ours_peak_mb", ".1f"), ("inplace", 7, "ours_inplace_peak_mb", ".1f"),
              ("saved", 7, "inplace_saved_mb", ".1f"), ("ms: F.ce", 9, "torch_fused_ms", ".2f"),
              ("ours", 8, "ours_ms", ".2f"), ("inplace", 8, "ours_inplace_ms", ".2f")]


def print_tables(rows: list[dict]) -> None:
    """The kernels' table, then the LM head's."""
    print_table([r for r in rows if r["bench"] == "cross_entropy_fwd_bwd"], KERNEL_TABLE)
    print()
    print_table([r for r in rows if r["bench"] == "lm_head_memory"], HEAD_TABLE)


def run_all(device: str, repeats: int) -> list[dict]:
    return run(device, repeats) + run_head_memory(device, repeats)


def main() -> None:
    args = arguments(__doc__, device=True, repeats=20).parse_args()
    backend = "cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo"
    with spawn_world(1, backend=backend, timeout=1800.0, threads_per_rank=torch.get_num_threads()) as world:
        (measured,) = world.run(run_all, args.device, args.repeats)
    rows = []
    for row in measured:
        emit(row, rows)
    print()
    print_tables(rows)


if __name__ == "__main__":
    main()
