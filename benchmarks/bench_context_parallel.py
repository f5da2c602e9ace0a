"""Context-parallel causal attention on CPU ranks: ring (contiguous, zigzag), Ulysses and hybrid
against an all-gather-K/V baseline and single-process SDPA on the full sequence.

    python -m benchmarks.bench_context_parallel [--worlds 2 4] [--seqs 4096 8192 16384] [--repeats 3]
    python -m benchmarks.bench_context_parallel --packed [--worlds 4] [--seqs 16384] [--methods ring_zigzag ...]

--packed: the sequence packs documents drawn from a long-tailed length mix
(log-normal, median 400 tokens, clipped to [16, seq]; fixed seed), passed as
``document_ids``; the baselines use the same block-diagonal causal mask.
"ring_balanced" shards it by ``balanced_sequence_plan`` (with ``positions``).
Its "spread" is max / mean - 1 of the attention scores per rank
(ops.context_attention_work: the ring's block plan cut by documents; the plan's
costs), "t_spread" the same of each rank's measured CPU time for forward +
backward (process CPU time: its own work, not the time it waits for the others
or, with more ranks than cores, for a core), "cpu ms" the slowest rank's,
"vs zigzag" ring_zigzag's fwd+bwd time over the row's and "cpu vs zigzag" the
same of "cpu ms" (the step on one core per rank, where the slowest rank's work
sets the step), and "skipped" the share of ring blocks no document spans.

Shapes: batch 1, 8 query heads, 2 kv heads (GQA), head_dim 64, fp32; the total
sequence is sharded over the ranks. Per case (the slowest rank's median):
  fwd_ms, fwd_bwd_ms   attention forward, and forward + backward
  spread               (max - min) / max over ranks of the attention compute alone (the same
                       block plan without communication): how evenly causal work is split;
                       zigzag should be near 0, contiguous near 1 - 1/N
  peak_mb              peak resident memory above the rank's baseline during a forward + backward
                       (sampled from /proc/self/statm); it should fall roughly as 1/N
  hidden               for the ring, the share of its communication hidden behind compute:
                       (compute + comm - fwd) / comm, with comm the same K/V exchanges alone
Baselines: "allgather_kv" all-gathers K and V with torch.distributed and runs SDPA for the
local queries against the full keys under the right causal mask; "single" is
F.scaled_dot_product_attention on the full sequence in one process (rank 0 alone).
"""

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import torchdist_ext  # noqa: F401
from benchmarks.peak_memory import PeakMemory
from benchmarks.report import arguments, emit, print_table
from torchdist_ext.ops import context_attention_work
from torchdist_ext.parallel import (
    balanced_sequence_plan,
    hybrid_attention,
    ring_attention,
    shard_sequence,
    ulysses_attention,
)
from torchdist_ext.parallel.sequence_sharding import zigzag_order
from torchdist_ext.testing import cached_mesh, spawn_world

Q_HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64


def median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def chunk_positions(order: str, n: int, rank: int, seq_local: int) -> list[tuple[int, int]]:
    """(start, length) in the full sequence of each contiguous piece this rank holds."""
    if order == "contiguous":
        return [(rank * seq_local, seq_local)]
    half = seq_local // 2
    order = zigzag_order(n)
    return [(order[2 * rank] * half, half), (order[2 * rank + 1] * half, half)]


def causal_mask_for(order: str, n: int, rank: int, seq_local: int, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean [seq_local, n * seq_local] mask of which full-sequence keys this rank's queries may see
    (with ``ids`` [seq] of the full sequence: only keys of the query's document)."""
    q_pos = torch.cat([torch.arange(s, s + length) for s, length in chunk_positions(order, n, rank, seq_local)])
    k_pos = torch.cat([
        torch.cat([torch.arange(s, s + length) for s, length in chunk_positions(order, n, r, seq_local)])
        for r in range(n)
    ])
    mask = q_pos[:, None] >= k_pos[None, :]
    return mask if ids is None else mask & (ids[q_pos][:, None] == ids[k_pos][None, :])


def packed_document_ids(seq_total: int, seed: int = 0) -> torch.Tensor:
    """[seq_total] ids of documents with log-normal lengths (median 400 tokens), clipped to [16, seq_total]."""
    gen = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < seq_total:
        length = int(torch.empty(1).log_normal_(6.0, 1.2, generator=gen).clamp(16, seq_total))
        lengths.append(min(length, seq_total - total))
        total += lengths[-1]
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def allgather_kv_attention(q, k, v, mask):
    """The plain baseline: all-gather K and V (torch.distributed), SDPA of local queries over all keys."""
    group_size = dist.get_world_size()
    gathered = []
    for t in (k, v):
        parts = [torch.empty_like(t) for _ in range(group_size)]
        dist.all_gather(parts, t.contiguous())
        gathered.append(torch.cat(parts, dim=2))
    return F.scaled_dot_product_attention(q, *gathered, attn_mask=mask, enable_gqa=True)


class _AllGatherKV(torch.autograd.Function):
    """Gradient-carrying all-gather along the sequence (reduce-scatter backward) for the baseline."""

    @staticmethod
    def forward(ctx, t):
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad):
        out = torch.empty_like(grad.chunk(dist.get_world_size(), dim=2)[0])
        dist.reduce_scatter(out, [c.contiguous() for c in grad.chunk(dist.get_world_size(), dim=2)])
        return out


def allgather_kv_autograd(q, k, v, mask):
    return F.scaled_dot_product_attention(q, _AllGatherKV.apply(k), _AllGatherKV.apply(v), attn_mask=mask,
                                          enable_gqa=True)


def ring_compute_only(q, k, v, order):
    """The ring's causal block plan on local data: the attention work of this rank without communication."""
    n, rank = dist.get_world_size(), dist.get_rank()
    seq, half = q.shape[2], q.shape[2] // 2
    for step in range(n):
        source = (rank - step) % n
        if source == rank:
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        elif order == "contiguous":
            if source < rank:
                F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        elif source < rank:
            F.scaled_dot_product_attention(q, k[:, :, :half], v[:, :, :half], enable_gqa=True)
        else:
            F.scaled_dot_product_attention(q[:, :, half:], k, v, enable_gqa=True)
    return seq


def ring_comm_only(k, v):
    """The ring's K/V exchanges alone."""
    n, rank = dist.get_world_size(), dist.get_rank()
    current = torch.stack([k, v])
    for _ in range(n - 1):
        incoming = torch.empty_like(current)
        ops = [dist.P2POp(dist.isend, current, (rank + 1) % n), dist.P2POp(dist.irecv, incoming, (rank - 1) % n)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        current = incoming


def median_cpu_seconds(fn, repeats: int) -> float:
    """The median CPU time of ``fn()`` in this rank's process (every thread): its own work, without the time
    it waits for other ranks or, with more ranks than cores, for a core."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def spread(values: torch.Tensor) -> float:
    """max / mean - 1: how much longer the slowest rank takes than the average."""
    values = values.double()
    return float(values.max() / values.mean() - 1)


def run_case(seq_total: int, method: str, repeats: int, packed: bool = False) -> dict:
    """Runs on every rank; this rank's measurements."""
    torch.manual_seed(0)
    n, rank = dist.get_world_size(), dist.get_rank()
    full = [torch.randn(1, h, seq_total, HEAD_DIM) for h in (Q_HEADS, KV_HEADS, KV_HEADS)]
    ids = packed_document_ids(seq_total) if packed else None
    result = {}
    if method == "single":
        if rank == 0:
            q, k, v = (t.clone().requires_grad_(True) for t in full)
            if packed:
                mask = (ids[:, None] == ids[None, :]) & torch.ones(seq_total, seq_total, dtype=torch.bool).tril()
            def fwd():
                if packed:
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            def fwd():
                return None
    elif method == "ring_balanced":
        cp = cached_mesh((n,), ("cp",))
        plan = balanced_sequence_plan(ids[None], n)
        q, k, v = (plan.shard(t, dim=2, cp_mesh=cp).detach().requires_grad_(True) for t in full)
        local_ids, positions = plan.shard(ids[None], dim=1, cp_mesh=cp), plan.positions(cp_mesh=cp)
        result["work_spread"] = plan.spread

        def fwd():
            return ring_attention(q, k, v, cp_mesh=cp, causal=True, document_ids=local_ids, positions=positions)
    else:
        order = {"ring_contiguous": "contiguous", "ring_zigzag": "zigzag", "ulysses": "contiguous",
                  "hybrid": "zigzag", "allgather_kv": "zigzag"}[method]
        if method == "hybrid":
            cp = cached_mesh((n // 2, 2), ("ring", "ulysses"))
        else:
            cp = cached_mesh((n,), ("cp",))
        q, k, v = (shard_sequence(t, cp_mesh=cp, dim=2, order=order).detach().requires_grad_(True) for t in full)
        local_ids = shard_sequence(ids[None], cp_mesh=cp, dim=1, order=order) if packed else None
        attention = {"ulysses": ulysses_attention, "hybrid": hybrid_attention}.get(method, ring_attention)
        if method != "allgather_kv":
            def fwd():
                return attention(q, k, v, cp_mesh=cp, causal=True, order=order, document_ids=local_ids)
        else:
            mask = causal_mask_for(order, n, rank, q.shape[2], ids)
            def fwd():
                return allgather_kv_autograd(q, k, v, mask)
        if method.startswith("ring") and packed:
            work = context_attention_work(ids[None], n, order, True)
            result.update(work_spread=spread(work.sum(1)), skipped=float((work == 0).float().mean()))
        elif method.startswith("ring"):
            with torch.no_grad():
                compute = median_seconds(lambda: ring_compute_only(q, k, v, order), repeats)
                comm = median_seconds(lambda: ring_comm_only(k, v), repeats)
            result.update(compute_s=compute, comm_s=comm)

    def fwd_bwd():
        out = fwd()
        if out is not None:
            out.sum().backward()

    with torch.no_grad():
        result["fwd_s"] = median_seconds(fwd, repeats)
    result["fwd_bwd_s"] = median_seconds(fwd_bwd, repeats)
    if packed and method.startswith("ring"):
        result["cpu_s"] = median_cpu_seconds(fwd_bwd, repeats)
    with PeakMemory() as memory:
        fwd_bwd()
    result["peak_mb"] = memory.peak_mb
    return result


def table(rows: list[dict]) -> list[tuple]:
    """The table's columns; "vs single" and "vs allgather" divide a row's fwd_bwd_ms by that method's in the same
    world at the same seq."""
    def versus(method: str):
        def ratio(r: dict) -> float | None:
            same = [x for x in rows if (x["world"], x["seq"], x["method"]) == (r["world"], r["seq"], method)]
            return r["fwd_bwd_ms"] / same[0]["fwd_bwd_ms"] if same else None
        return ratio

    def speedup_over_zigzag(key: str):
        def ratio(r: dict):
            zigzag = [x for x in rows if (x["world"], x["seq"], x["method"]) == (r["world"], r["seq"], "ring_zigzag")]
            return zigzag[0][key] / r[key] if "t_spread" in r and zigzag else None
        return ratio

    return [("world", 5, "world"), ("seq", 6, "seq"), ("method", 16, "method"), ("fwd ms", 9, "fwd_ms", ".1f"),
            ("fwd+bwd ms", 11, "fwd_bwd_ms", ".1f"), ("vs single", 9, versus("single"), ".3f"),
            ("vs allgather", 12, versus("allgather_kv"), ".3f"), ("vs zigzag", 9, speedup_over_zigzag("fwd_bwd_ms"), ".3f"),
            ("peak MB", 8, "peak_mb", ".1f"), ("spread", 7, "spread", ".3f"), ("t_spread", 8, "t_spread", ".3f"),
            ("cpu ms", 8, "cpu_ms", ".1f"), ("cpu vs zigzag", 13, speedup_over_zigzag("cpu_ms"), ".3f"),
            ("hidden", 7, "hidden", ".3f"), ("skipped", 7, "skipped", ".3f")]


def main() -> None:
    parser = arguments(__doc__, worlds=[2, 4], repeats=3)
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--packed", action="store_true", help="packed documents of a long-tailed length mix")
    parser.add_argument("--methods", nargs="+", default=None, help="run only these methods (default: all)")
    args = parser.parse_args()
    rows = []
    for world_size in args.worlds:
        methods = ["ring_contiguous", "ring_zigzag", "ulysses", "allgather_kv", "single"]
        if args.packed:
            methods.insert(2, "ring_balanced")
        if world_size >= 4:
            methods.insert(3, "hybrid")
        if args.methods:
            methods = [m for m in methods if m in args.methods]
        with spawn_world(world_size, timeout=3600.0) as world:
            for seq in args.seqs:
                for method in methods:
                    per_rank = world.run(run_case, seq, method, args.repeats, args.packed)
                    ranks = per_rank if method != "single" else per_rank[:1]
                    row = {
                        "bench": "context_parallel_packed_documents" if args.packed
                        else "context_parallel_causal_attention", "world": world_size, "seq": seq,
                        "method": method,
                        "fwd_ms": round(max(r["fwd_s"] for r in ranks) * 1e3, 1),
                        "fwd_bwd_ms": round(max(r["fwd_bwd_s"] for r in ranks) * 1e3, 1),
                        "peak_mb": round(max(r["peak_mb"] for r in ranks), 1),
                    }
                    if "compute_s" in per_rank[0]:
                        compute = [r["compute_s"] for r in per_rank]
                        comm = max(r["comm_s"] for r in per_rank)
                        row["spread"] = round((max(compute) - min(compute)) / max(compute), 3)
                        hidden = (max(compute) + comm - row["fwd_ms"] / 1e3) / comm
                        row["hidden"] = round(min(1.0, max(0.0, hidden)), 3)
                    if "work_spread" in per_rank[0]:
                        row["spread"] = round(per_rank[0]["work_spread"], 3)
                    if "skipped" in per_rank[0]:
                        row["skipped"] = round(per_rank[0]["skipped"], 3)
                    if "cpu_s" in per_rank[0]:
                        cpu = torch.tensor([r["cpu_s"] for r in per_rank])
                        row["t_spread"] = round(spread(cpu), 3)
                        row["cpu_ms"] = round(float(cpu.max()) * 1e3, 1)
                    emit(row, rows)
    print()
    print_table(rows, table(rows))


if __name__ == "__main__":
    main()
