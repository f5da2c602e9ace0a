"""Forward + backward of an expert-parallel MoE layer: ours against the torch-native composition.

    python -m benchmarks.bench_moe [--worlds 2 4] [--repeats 10] [--quick]

Layer: top-k softmax router, SwiGLU experts split over the gloo CPU ranks (each rank
routes its own tokens), fp32. Variants, on the same weights and tokens in the same world:
  ours_dropless   torchdist_ext.parallel.MoE, capacity_factor=None (tdx::moe_dispatch sends a token
                  once to each rank holding one of its experts; one count copy to the host)
  ours_capacity   the same layer with capacity_factor=1.25 (static shapes, nothing on the host)
  torch           the composition torchtitan and Megatron's all-to-all dispatcher build from torch
                  ops: a token copied once per chosen expert, argsort by expert, a count exchange and
                  its .tolist(), all_to_all_single_autograd there and back, one matmul per local
                  expert, weighted sum of the k outputs (same router, dropless: same output as ours)
  single_process  the single-process reference a model file writes (Hugging Face's Mixtral): every
                  expert held locally, a Python loop over all E experts gathering their tokens and
                  index_add-ing the weighted outputs, on this rank's tokens (same router, no communication)
  compute_only    the expert GEMMs a rank runs under perfectly balanced routing (T*k rows split
                  equally over its experts, batched), with no routing and no communication: the floor
Reported per case: the median over repeats of the slowest rank's step time; the ratios
dropless/torch, capacity/torch, dropless/single_process and compute_only/dropless; ours'
tokens/s over the world; the rows each rank sends to other ranks per token (ours deduplicates the experts of a token that live on the same rank;
torch sends one row per remote slot); the peak resident memory of one step above the
rank's baseline (the largest rank). One JSON line per case, then a table.
"""

import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

import torchdist_ext  # noqa: F401
from benchmarks.peak_memory import PeakMemory
from benchmarks.report import arguments, emit, print_table, sizes_and_repeats
from benchmarks.world_timing import median_step_seconds, step
from torchdist_ext.parallel import MoE
from torchdist_ext.testing import cached_mesh, spawn_world

SIZES = [  # (tokens per rank, dim, ffn, experts, top_k)
    (1024, 256, 512, 8, 2),
    (2048, 256, 512, 16, 2),
    (1024, 256, 256, 64, 6),  # fine-grained experts (DeepSeek-style): several experts per token per rank
]
CAPACITY_FACTOR = 1.25


class TorchNativeMoE(nn.Module):
    """Expert parallelism from torch ops alone, on the weights of ``moe`` (its router, its local experts)."""

    def __init__(self, moe: MoE):
        super().__init__()
        self.moe = moe
        self.group = moe.ep.mesh.get_group()

    def forward(self, x):
        moe, n = self.moe, self.moe.ep.size
        local = moe.num_experts // n
        tokens = x.reshape(-1, moe.dim)
        expert_ids, weights, _ = moe._route(tokens)  # the layer's own router: only the dispatch differs
        num_tokens, k = expert_ids.shape
        slots = expert_ids.flatten()
        order = torch.argsort(slots, stable=True)  # expert-major, hence destination-rank-major
        send = tokens.index_select(0, order // k)  # one row per slot
        send_counts = torch.bincount(slots, minlength=moe.num_experts)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        recv_matrix = recv_counts.view(n, local)  # [source rank, local expert]
        send_splits = send_counts.view(n, local).sum(1).tolist()
        recv_splits = recv_matrix.sum(1).tolist()
        received = all_to_all_single_autograd(send, recv_splits, send_splits, self.group)
        local_ids = torch.repeat_interleave(torch.arange(local).repeat(n), recv_matrix.flatten())
        by_expert = torch.argsort(local_ids, stable=True)
        w1, w3, w2 = (w.to_local() for w in (moe.experts.w1, moe.experts.w3, moe.experts.w2))
        outputs = []
        for e, rows in enumerate(received[by_expert].split(recv_matrix.sum(0).tolist())):
            outputs.append(F.linear(F.silu(F.linear(rows, w1[e])) * F.linear(rows, w3[e]), w2[e]))
        expert_out = torch.empty_like(received).index_copy(0, by_expert, torch.cat(outputs))
        returned = all_to_all_single_autograd(expert_out, send_splits, recv_splits, self.group)
        per_slot = torch.empty_like(returned).index_copy(0, order, returned).view(num_tokens, k, moe.dim)
        out = (per_slot * weights.unsqueeze(-1).to(per_slot.dtype)).sum(1)
        return out.view_as(x)


class SingleProcessLoop(nn.Module):
    """The reference MoE of a single-process model file: all E experts here, one loop iteration per expert."""

    def __init__(self, moe: MoE):
        super().__init__()
        self.route = moe._route  # the same router (its gate stays moe's parameter)
        self.w1, self.w3, self.w2 = (nn.Parameter(w.full_tensor().detach().clone())
                                     for w in (moe.experts.w1, moe.experts.w3, moe.experts.w2))

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        expert_ids, weights, _ = self.route(tokens)
        out = torch.zeros_like(tokens)
        for e in range(self.w1.shape[0]):
            token, slot = (expert_ids == e).nonzero(as_tuple=True)
            rows = tokens[token]
            expert_out = F.linear(F.silu(F.linear(rows, self.w1[e])) * F.linear(rows, self.w3[e]), self.w2[e])
            out = out.index_add(0, token, expert_out * weights[token, slot, None])
        return out.view_as(x)


class ComputeOnly(nn.Module):
    """A rank's expert GEMMs under perfectly balanced routing, batched over its experts."""

    def __init__(self, moe: MoE, rows_per_expert: int):
        super().__init__()
        self.w1, self.w3, self.w2 = (nn.Parameter(w.to_local().detach().clone())
                                     for w in (moe.experts.w1, moe.experts.w3, moe.experts.w2))
        self.rows_per_expert = rows_per_expert

    def forward(self, x):
        rows = x.view(self.w1.shape[0], self.rows_per_expert, -1)
        hidden = F.silu(torch.bmm(rows, self.w1.transpose(1, 2))) * torch.bmm(rows, self.w3.transpose(1, 2))
        return torch.bmm(hidden, self.w2.transpose(1, 2))


def remote_rows_per_token(moe: MoE, x: torch.Tensor) -> dict[str, float]:
    """Rows this rank sends to other ranks per token: ours (distinct remote ranks of a token's experts)
    and torch's (remote slots)."""
    with torch.no_grad():
        expert_ids, _, _ = moe._route(x.reshape(-1, moe.dim))
    owner = expert_ids // (moe.num_experts // moe.ep.size)
    remote = owner != moe.ep.rank
    distinct = torch.stack([(remote & (owner == r)).any(-1) for r in range(moe.ep.size)], -1)
    return {"ours_rows_per_token": distinct.sum(-1).float().mean().item(),
            "torch_rows_per_token": remote.sum(-1).float().mean().item()}


def run_case(tokens: int, dim: int, ffn: int, experts: int, top_k: int, repeats: int, warmup: int) -> dict:
    """Runs on every rank; returns this rank's median step time per variant, rows sent and peak memory."""
    n = dist.get_world_size()
    mesh = cached_mesh((n,), ("ep",))
    torch.manual_seed(0)
    dropless = MoE(dim, ffn, experts, top_k=top_k, ep_mesh=mesh)
    capacity = MoE(dim, ffn, experts, top_k=top_k, ep_mesh=mesh, capacity_factor=CAPACITY_FACTOR)
    capacity.load_state_dict(dropless.state_dict())
    native, single_process = TorchNativeMoE(dropless), SingleProcessLoop(dropless)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    x = torch.randn(tokens, dim, generator=gen, requires_grad=True)  # a layer inside a model: x needs its gradient
    upstream = torch.randn(tokens, dim, generator=gen)
    with torch.no_grad():
        ours = dropless(x)
        torch.testing.assert_close(native(x), ours, atol=1e-5, rtol=1e-5, msg="torch disagrees with ours")
        torch.testing.assert_close(single_process(x), ours, atol=1e-5, rtol=1e-5,
                                   msg="the single-process loop disagrees with ours")
    local = experts // n
    rows_per_expert = -(-tokens * top_k // local)  # a rank receives T*k rows when the load is balanced
    floor_x = torch.randn(local * rows_per_expert, dim, generator=gen, requires_grad=True)
    cases = {
        "ours_dropless": (dropless, x, upstream),
        "ours_capacity": (capacity, x, upstream),
        "torch": (native, x, upstream),
        "single_process": (single_process, x, upstream),
        "compute_only": (ComputeOnly(dropless, rows_per_expert), floor_x,
                         torch.randn(local, rows_per_expert, dim, generator=gen)),
    }
    result = {f"{name}_s": seconds for name, seconds in median_step_seconds(cases, repeats, warmup).items()}
    for name in ("ours_dropless", "ours_capacity", "torch"):
        dist.barrier()
        with PeakMemory() as memory:
            step(*cases[name])
        result[f"{name}_peak_mb"] = memory.peak_mb
    return result | remote_rows_per_token(dropless, x)


TABLE = [("world", 5, "world"),
         ("T x d x f, E, k", 20, lambda r: f"{r['tokens']}x{r['dim']}x{r['ffn']}, {r['experts']}, {r['top_k']}"),
         ("dropless", 9, "ours_dropless_ms", ".2f"), ("capacity", 9, "ours_capacity_ms", ".2f"),
         ("torch", 9, "torch_ms", ".2f"), ("1-proc", 8, "single_process_ms", ".2f"),
         ("floor", 8, "compute_only_ms", ".2f"), ("drl/torch", 9, "dropless_over_torch", ".3f"),
         ("cap/torch", 9, "capacity_over_torch", ".3f"), ("drl/1-proc", 10, "dropless_over_single_process", ".3f"),
         ("floor/drl", 9, "floor_fraction", ".3f"), ("tok/s", 7, "ours_tokens_per_s", "d"),
         ("rows/tok ours", 13, "ours_rows_per_token", ".3f"), ("torch", 6, "torch_rows_per_token", ".3f"),
         ("peak MiB ours", 13, "ours_dropless_peak_mb", ".1f"), ("torch", 6, "torch_peak_mb", ".1f")]


def main() -> None:
    args = arguments(__doc__, worlds=[2, 4], repeats=10, warmup=2, sizes=SIZES, quick=True).parse_args()
    sizes, repeats = sizes_and_repeats(args, SIZES)
    rows = []
    for world_size in args.worlds:
        with spawn_world(world_size, timeout=1800.0) as world:
            for tokens, dim, ffn, experts, top_k in sizes:
                per_rank = world.run(run_case, tokens, dim, ffn, experts, top_k, repeats, args.warmup)
                worst = {key: max(r[key] for r in per_rank) for key in per_rank[0]}
                mean = {key: statistics.mean(r[key] for r in per_rank) for key in per_rank[0]}
                row = {
                    "bench": "moe_fwd_bwd", "world": world_size,
                    "tokens": tokens, "dim": dim, "ffn": ffn, "experts": experts, "top_k": top_k,
                    **{key[:-2] + "_ms": round(worst[key] * 1e3, 2) for key in worst if key.endswith("_s")},
                    "dropless_over_torch": round(worst["ours_dropless_s"] / worst["torch_s"], 3),
                    "capacity_over_torch": round(worst["ours_capacity_s"] / worst["torch_s"], 3),
                    "dropless_over_single_process": round(worst["ours_dropless_s"] / worst["single_process_s"], 3),
                    "floor_fraction": round(worst["compute_only_s"] / worst["ours_dropless_s"], 3),
                    "ours_tokens_per_s": round(tokens * world_size / worst["ours_dropless_s"]),
                    "ours_rows_per_token": round(mean["ours_rows_per_token"], 3),
                    "torch_rows_per_token": round(mean["torch_rows_per_token"], 3),
                    **{key: round(worst[key], 1) for key in worst if key.endswith("_peak_mb")},
                }
                emit(row, rows)
    print()
    print_table(rows, TABLE)


if __name__ == "__main__":
    main()
