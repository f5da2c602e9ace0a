"""FP8: the fused cast + amax against the unfused torch expression, and an fp8 linear against bf16.

    python -m benchmarks.bench_fp8 [--device cuda|cpu] [--only cast_amax|linear|step|sp_rings]

cast_amax   ours: tdx::fp8_cast_amax (one read of x, one byte written per element) | unfused:
            ``amax = x.abs().amax(); where(x.isfinite(), (x.float() * scale).clamp(..), nan).to(e4m3)``;
            with the fraction of the copy bandwidth measured in the same run that ours reaches
            (counting one read of x and one write of the fp8 bytes); and tdx::fp8_cast_transpose_amax (both
            orientations from one read) against our cast followed by a transposing copy of its bytes
linear      forward + backward of Fp8Linear (delayed scaling, "hybrid") against nn.Linear in bf16 on
            the same shapes: on a CPU torch._scaled_mm has no fp8 hardware and may well be slower;
            the GPU figure is the one that matters. Also the signal-to-quantisation-noise ratio of the
            fp8 output and gradients against the same linear in fp32 (after the timed steps, so the
            delayed scales are set): 20 log10(|reference| / |fp8 - reference|) dB
step        with --device cpu: one training step of a sequence-parallel MLP block (column 256 -> 1024,
            row back) under tensor parallelism and FSDP2 on 4 CPU ranks (dp=2 x tp=2), input gradient
            included: the collectives one rank issues and the bytes it sends into them, per mesh axis and
            operation, as the communication ledger (torchdist_ext.ledger) counts them: on dp FSDP2's
            parameter all-gathers and gradient reduce-scatters, on tp the ring-fused ops' point-to-point
            blocks and the bulk collectives of the fp8 path, and the all-reduces (bias gradient,
            fp8_step's amaxes on the world); in fp32, in bf16 (FSDP2 mixed precision), in fp8 on bf16
            parameters (delayed scaling, fp8_step included), and the same with FSDP2 all-gathering the
            weights in fp8 (``fp8_all_gather=True``; the biases stay bf16)
sp_rings    with --device cpu: the fp8 rings of sequence parallelism on 2 and 4 CPU ranks, ours
            (tdx::all_gather_scaled_mm: the column GEMM on each fp8 input block as it arrives;
            tdx::scaled_mm_reduce_scatter: the row GEMM's partial sums passed on while the next block's GEMM
            runs) against the bulk composition they replace (torch's functional all-gather of the fp8 bytes,
            then one torch._scaled_mm; one torch._scaled_mm, then the functional reduce-scatter), bf16 output;
            the slowest rank's median time, interleaved repeats
"""

import torch
from torch import nn

from benchmarks.device_timing import copy_bandwidth, median_seconds
from benchmarks.report import arguments, emit, print_table
from benchmarks.world_timing import median_call_seconds
from torchdist_ext.fp8 import DelayedScaling, Fp8Linear, fp8_step
from torchdist_ext.ops import fp8_cast_amax, fp8_cast_transpose_amax

CAST_SHAPES = {"cuda": [(8192, 8192), (16384, 4096)], "cpu": [(2048, 2048), (4096, 4096)]}
LINEAR_SHAPES = {"cuda": [(16384, 4096, 4096), (16384, 4096, 14336)], "cpu": [(1024, 512, 512), (2048, 1024, 1024)]}


def unfused_cast_amax(x, scale):
    amax = x.abs().amax()
    return torch.where(x.isfinite(), (x.float() * scale).clamp(-448.0, 448.0), float("nan")).to(
        torch.float8_e4m3fn), amax


def cast_rows(device: str, repeats: int) -> list[dict]:
    bandwidth = copy_bandwidth(device)
    rows = []
    for shape in CAST_SHAPES[device]:
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(shape, device=device).to(dtype)
            scale = torch.tensor([3.0], device=device)
            ours = median_seconds(lambda: fp8_cast_amax(x, scale, torch.float8_e4m3fn), device, repeats)
            unfused = median_seconds(lambda: unfused_cast_amax(x, scale), device, repeats)
            moved = x.numel() * (x.element_size() + 1)
            rows.append({"bench": "fp8_cast_amax", "device": device, "shape": list(shape),
                         "dtype": str(dtype).removeprefix("torch."), "ours_ms": round(ours * 1e3, 3),
                         "unfused_ms": round(unfused * 1e3, 3), "ours_over_unfused": round(ours / unfused, 3),
                         "bandwidth_fraction": round(moved / ours / bandwidth, 3)})
            # Both orientations: the fused cast-transpose against our cast followed by a transposing copy.
            both = median_seconds(lambda: fp8_cast_transpose_amax(x, scale, torch.float8_e4m3fn, 16), device, repeats)
            cast_then_copy = median_seconds(
                lambda: fp8_cast_amax(x, scale, torch.float8_e4m3fn)[0].t().contiguous(), device, repeats)
            rows.append({"bench": "fp8_cast_transpose_amax", "device": device, "shape": list(shape),
                         "dtype": str(dtype).removeprefix("torch."), "ours_ms": round(both * 1e3, 3),
                         "unfused_ms": round(cast_then_copy * 1e3, 3),
                         "ours_over_unfused": round(both / cast_then_copy, 3),
                         "bandwidth_fraction": round(x.numel() * (x.element_size() + 2) / both / bandwidth, 3)})
    return rows


def fp8_sqnr_db(fp8: Fp8Linear, x, upstream) -> dict[str, float]:
    """SQNR of the fp8 layer's output, input gradient and weight gradient against its weights in fp32."""
    reference = nn.Linear(fp8.in_features, fp8.out_features, bias=False, device=x.device)
    with torch.no_grad():
        reference.weight.copy_(fp8.weight)
    results = {}
    for name, layer, dtype in (("fp8", fp8, x.dtype), ("fp32", reference, torch.float32)):
        inputs = x.to(dtype).clone().requires_grad_(True)
        out = layer(inputs)
        out.backward(upstream.to(dtype))
        results[name] = (out.detach().float(), inputs.grad.float(), layer.weight.grad.float())
        layer.weight.grad = None

    def db(actual, expected):
        return (20 * torch.log10(expected.norm() / (actual - expected).norm())).item()

    return {role: db(a, b) for role, a, b in zip(("out", "grad_x", "grad_w"), results["fp8"], results["fp32"])}


def linear_rows(device: str, repeats: int) -> list[dict]:
    rows = []
    for tokens, in_features, out_features in LINEAR_SHAPES[device]:
        torch.manual_seed(0)
        bf16 = nn.Linear(in_features, out_features, bias=False, device=device, dtype=torch.bfloat16)
        fp8 = Fp8Linear.from_linear(nn.Linear(in_features, out_features, bias=False, device=device,
                                              dtype=torch.bfloat16), DelayedScaling(amax_history_len=16))
        x = torch.randn(tokens, in_features, device=device, dtype=torch.bfloat16, requires_grad=True)
        upstream = torch.randn(tokens, out_features, device=device, dtype=torch.bfloat16)

        def step(layer):
            layer(x).backward(upstream)
            layer.weight.grad = x.grad = None

        def fp8_train_step():
            step(fp8)
            fp8_step(fp8)

        seconds = {"bf16": median_seconds(lambda: step(bf16), device, repeats),
                   "fp8": median_seconds(fp8_train_step, device, repeats)}
        sqnr = fp8_sqnr_db(fp8, x.detach(), upstream)
        flops = 6 * tokens * in_features * out_features
        rows.append({"bench": "fp8_linear_fwd_bwd", "device": device, "tokens": tokens, "in": in_features,
                     "out": out_features, "bf16_ms": round(seconds["bf16"] * 1e3, 3),
                     "fp8_ms": round(seconds["fp8"] * 1e3, 3), "fp8_over_bf16": round(seconds["fp8"] / seconds["bf16"], 3),
                     "fp8_tflops": round(flops / seconds["fp8"] / 1e12, 3),
                     "bf16_tflops": round(flops / seconds["bf16"] / 1e12, 3),
                     **{f"sqnr_{name}_db": round(value, 1) for name, value in sqnr.items()}})
    return rows


def block_step_collectives(precision: str) -> dict[str, tuple[int, int]]:
    """Runs on every rank of a 4-rank world counted by the ledger: {"<axis> <operation>": (calls, bytes sent)}
    of one training step of the TP + SP + FSDP2 block on this rank."""
    from torchdist_ext import ledger
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from torchdist_ext.fp8 import convert_to_fp8
    from torchdist_ext.parallel import ColumnParallelLinear, RowParallelLinear
    from torchdist_ext.testing import cached_mesh

    mesh = cached_mesh((2, 2), ("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(
        ColumnParallelLinear.from_linear(nn.Linear(256, 1024), tp_mesh=mesh["tp"], sequence_parallel=True),
        nn.ReLU(),
        RowParallelLinear.from_linear(nn.Linear(1024, 256), tp_mesh=mesh["tp"], sequence_parallel=True))
    if precision.startswith("fp8"):
        convert_to_fp8(model, DelayedScaling(), fp8_all_gather=precision == "fp8+fp8 all-gather")
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model, mesh=mesh["dp"], mp_policy=bf16 if precision != "fp32" else MixedPrecisionPolicy())
    x = torch.randn(4, 256, 256, dtype=torch.float32 if precision == "fp32" else torch.bfloat16, requires_grad=True)

    def step():
        model(x).float().sum().backward()
        fp8_step(model)

    step()  # FSDP2's lazy initialisation
    ledger.reset()
    step()
    return {f"{axis} {op}": (tally.calls, tally.sent_bytes)
            for axis, tallies in ledger.by_label({"dp": mesh["dp"], "tp": mesh["tp"]}, rest="world").items()
            for op, tally in tallies.items()}


def step_rows() -> list[dict]:
    from torchdist_ext import ledger
    from torchdist_ext.testing import spawn_world

    rows = []
    with spawn_world(4, backend=ledger.backend("gloo"), timeout=600.0) as world:
        for precision in ("fp32", "bf16", "fp8", "fp8+fp8 all-gather"):
            counts = world.run(block_step_collectives, precision)[0]
            rows.append({"bench": "fp8_block_step_collectives", "precision": precision,
                         "collectives": {kind: {"calls": calls, "kib": round(sent / 1024, 2)}
                                         for kind, (calls, sent) in sorted(counts.items())}})
    return rows


SP_RING_SIZES = [(2048, 512, 2048), (4096, 1024, 4096)]  # (sequence, hidden, ffn): one [1, S, h] micro-batch


def sp_ring_case(seq: int, hidden: int, ffn: int, repeats: int) -> dict[str, float]:
    """Runs on every rank: this rank's median seconds of the fp8 rings and of their bulk compositions."""
    import torch.distributed as dist

    from torchdist_ext._collectives import all_gather, reduce_scatter
    from torchdist_ext.ops import all_gather_scaled_mm, scaled_mm_reduce_scatter

    n, name = dist.get_world_size(), dist.group.WORLD.group_name
    e4m3, bf16 = torch.float8_e4m3fn, torch.bfloat16
    gen = torch.Generator().manual_seed(dist.get_rank())
    x_block = torch.randn(1, seq // n, hidden, generator=gen).to(e4m3)
    hidden_fp8 = torch.randn(1, seq, ffn // n, generator=gen).to(e4m3)
    up = torch.randn(ffn // n, hidden, generator=gen).to(e4m3).t()  # column-major [h, f/n]
    down = torch.randn(hidden, ffn // n, generator=gen).to(e4m3).t()  # column-major [f/n, h]
    s = torch.tensor([0.5])

    def bulk_column():
        gathered = all_gather(x_block.view(torch.uint8), name, n, 1).view(e4m3)
        return torch._scaled_mm(gathered.reshape(-1, hidden), up, scale_a=s, scale_b=s, out_dtype=bf16)

    def bulk_row():
        partial = torch._scaled_mm(hidden_fp8.reshape(-1, ffn // n), down, scale_a=s, scale_b=s, out_dtype=bf16)
        return reduce_scatter(partial.view(1, seq, hidden), name, n, 1)

    fns = {"ring_column": lambda: all_gather_scaled_mm(x_block, up, s, s, bf16, name, 1)[0],
           "bulk_column": bulk_column,
           "ring_row": lambda: scaled_mm_reduce_scatter(hidden_fp8, down, s, s, bf16, name, 1),
           "bulk_row": bulk_row}
    torch.testing.assert_close(fns["ring_column"]().reshape(-1, ffn // n), bulk_column().float().to(bf16))
    row = bulk_row()  # bf16 partial sums added in other orders: a few bf16 rounding steps of the largest value
    torch.testing.assert_close(fns["ring_row"](), row, rtol=0, atol=n * 2**-8 * row.abs().max().item())
    return median_call_seconds(fns, repeats, warmup=2)


def sp_ring_rows(repeats: int) -> list[dict]:
    from torchdist_ext.testing import spawn_world

    rows = []
    for world_size in (2, 4):
        with spawn_world(world_size, timeout=1200.0) as world:
            for seq, hidden, ffn in SP_RING_SIZES:
                per_rank = world.run(sp_ring_case, seq, hidden, ffn, repeats)
                slowest = {variant: max(r[variant] for r in per_rank) for variant in per_rank[0]}
                rows.append({"bench": "fp8_sp_rings", "world": world_size, "seq": seq, "hidden": hidden, "ffn": ffn,
                             **{f"{variant}_ms": round(t * 1e3, 3) for variant, t in slowest.items()},
                             "column_ring_over_bulk": round(slowest["ring_column"] / slowest["bulk_column"], 3),
                             "row_ring_over_bulk": round(slowest["ring_row"] / slowest["bulk_row"], 3)})
    return rows


def print_casts(casts: list[dict]) -> None:
    print_table(casts, [("op", 23, "bench"), ("device", 6, "device"),
                        ("shape", 12, lambda r: "x".join(map(str, r["shape"]))), ("dtype", 9, "dtype"),
                        ("ours ms", 9, "ours_ms", ".3f"), ("unfused ms", 10, "unfused_ms", ".3f"),
                        ("ours/unfused", 12, "ours_over_unfused", ".3f"), ("of bw", 6, "bandwidth_fraction", ".3f")])


def print_linears(linears: list[dict]) -> None:
    print_table(linears, [
        ("device", 6, "device"), ("tokens x in x out", 20, lambda r: f"{r['tokens']}x{r['in']}x{r['out']}"),
        ("bf16 ms", 9, "bf16_ms", ".3f"), ("fp8 ms", 9, "fp8_ms", ".3f"), ("fp8/bf16", 9, "fp8_over_bf16", ".3f"),
        ("fp8 TFLOP/s", 11, "fp8_tflops", ".3f"),
        ("SQNR dB out / dx / dw", 22,
         lambda r: f"{r['sqnr_out_db']:.1f} / {r['sqnr_grad_x_db']:.1f} / {r['sqnr_grad_w_db']:.1f}")])


def print_steps(steps: list[dict]) -> None:
    """One line per collective kind, one column per precision."""
    kinds = sorted({kind for r in steps for kind in r["collectives"]})
    cells = [{"kind": kind, **{r["precision"]: r["collectives"].get(kind, {"calls": 0, "kib": 0.0}) for r in steps}}
             for kind in kinds]
    print("one step's collectives on one rank (calls, KiB sent):")
    print_table(cells, [("", 34, "kind")] + [
        (r["precision"], 18, lambda cell, p=r["precision"]: f"{cell[p]['calls']:>8}, {cell[p]['kib']:>8}")
        for r in steps])


def print_sp_rings(rows: list[dict]) -> None:
    print_table(rows, [("world", 5, "world"), ("seq x h x ffn", 16, lambda r: f"{r['seq']}x{r['hidden']}x{r['ffn']}"),
                       ("column ring ms", 14, "ring_column_ms", ".3f"), ("bulk ms", 9, "bulk_column_ms", ".3f"),
                       ("ring/bulk", 9, "column_ring_over_bulk", ".3f"), ("row ring ms", 11, "ring_row_ms", ".3f"),
                       ("bulk ms", 9, "bulk_row_ms", ".3f"), ("ring/bulk", 9, "row_ring_over_bulk", ".3f")])


def main() -> None:
    parser = arguments(__doc__, device=True, repeats=10)
    parser.add_argument("--only", choices=["cast_amax", "linear", "step", "sp_rings"],
                        help="run one part (default: every part the device runs)")
    args = parser.parse_args()
    # Each part is printed as soon as it is measured (its JSON rows, then its table). The multi-rank parts run on
    # CPU ranks: with --device cpu only (gpu_check.sh's runs skip them).
    parts = {"cast_amax": (lambda: cast_rows(args.device, args.repeats), print_casts),
             "linear": (lambda: linear_rows(args.device, args.repeats), print_linears)}
    if args.device == "cpu":  # the multi-rank parts run on CPU ranks
        parts["step"] = (step_rows, print_steps)
        parts["sp_rings"] = (lambda: sp_ring_rows(args.repeats), print_sp_rings)
    if args.only is not None:
        if args.only not in parts:
            parser.error(f"--only {args.only} runs with --device cpu only")
        parts = {args.only: parts[args.only]}
    for measure, show in parts.values():
        rows = []
        for row in measure():
            emit(row, rows)
        print()
        show(rows)
        print(flush=True)


if __name__ == "__main__":
    main()
