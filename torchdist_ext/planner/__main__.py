"""The planner's command line.

    python -m torchdist_ext.planner --model llama3-70b --gpus 32 --gpu h100-80gb --seq 4096 --global-batch 32 \\
        [--tp 8 --pp 1 --cp 1 --cp-ulysses 1 --ep 1 --zero 3 --sp --recompute selective ...] \\
        [--json] [--plot FILE.png]
    python -m torchdist_ext.planner lint train.py [--json]

With any of --tp/--pp/--dp/--cp/--ep the layout is complete (unset axes are 1,
dp takes the remaining GPUs) and the estimate and its findings are printed;
without them the layout search prints its table. --json prints one JSON
document instead; --plot writes the per-GPU memory of the layout(s) and, for a
pipeline, the schedule's timeline. A bad argument ends the program with a
one-line error (exit status 2).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from torchdist_ext import _planner
from torchdist_ext.planner import (
    GPU_PRESETS,
    MODEL_PRESETS,
    ClusterSpec,
    Layout,
    ModelSpec,
    check,
    estimate,
    lint,
    search,
    simulate_schedule,
)
from torchdist_ext.planner.formulas import attention_balance
from torchdist_ext.planner.plot import plot_plan, simulated_rows
from torchdist_ext.planner.schedule import chunks_per_rank


# The largest count the CLI takes: the planner's cluster bound (csrc/planner/specs.cpp).
_MAX_COUNT = 1 << 24


def _count(text: str) -> int:
    """A positive integer up to _MAX_COUNT (argparse turns the ValueError into a one-line usage error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if not 1 <= value <= _MAX_COUNT:
        raise argparse.ArgumentTypeError(f"must lie in [1, {_MAX_COUNT}], got {value}")
    return value


def _imbalance(text: str) -> float:
    """A routing imbalance, a number >= 1 (argparse turns the ValueError into a one-line usage error)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 1, got {text!r}") from None
    if not (value >= 1 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 1, got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m torchdist_ext.planner", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, choices=sorted(MODEL_PRESETS))
    parser.add_argument("--gpus", type=_count, required=True)
    parser.add_argument("--gpu", default="h100-80gb", choices=sorted(GPU_PRESETS))
    parser.add_argument("--seq", type=_count, default=4096, help="sequence length (tokens)")
    parser.add_argument("--global-batch", type=_count, default=None, help="sequences per step (default: 4 x dp)")
    for axis in ("tp", "pp", "dp", "cp", "ep"):
        parser.add_argument(f"--{axis}", type=_count, default=None)
    parser.add_argument("--cp-ulysses", type=_count, default=1, metavar="U",
                        help="Ulysses ranks within cp (1: ring attention; cp: Ulysses; between: hybrid)")
    parser.add_argument("--cp-order", default="zigzag", choices=_planner.OPTIONS["cp_order"],
                        help="how the sequence is cut over the ring ranks (balanced: balanced_sequence_plan)")
    parser.add_argument("--document-median", type=float, default=0.0, metavar="TOKENS",
                        help="packed documents of log-normal lengths with this median (default 0: one document "
                             "per sequence)")
    parser.add_argument("--document-sigma", type=float, default=1.2, metavar="S",
                        help="the documents' log-space deviation (with --document-median)")
    parser.add_argument("--dp-replicate", type=_count, default=1, metavar="R",
                        help="HSDP: replicas among the dp ranks, each sharding over dp / R (needs --zero >= 1)")
    parser.add_argument("--zero", type=int, default=1, choices=[0, 1, 2, 3], help="ZeRO stage")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism (with tp)")
    parser.add_argument("--recompute", default="selective", choices=_planner.OPTIONS["recompute"])
    parser.add_argument("--micro-batch", type=_count, default=1)
    parser.add_argument("--schedule", default="1f1b", choices=_planner.OPTIONS["schedule"])
    parser.add_argument("--virtual-stages", type=_count, default=1)
    parser.add_argument("--precision", default="bf16-mixed", choices=_planner.OPTIONS["precision"])
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile'd blocks: the memory-bound ops fused (eager: each op its own kernel)")
    parser.add_argument("--expert-imbalance", type=_imbalance, default=1.0, metavar="X",
                        help="the busiest ep rank's routed rows over the mean (default 1: uniform routing)")
    parser.add_argument("--top", type=_count, default=10, help="rows of the search table")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("--plot", metavar="FILE.png", help="write the memory breakdown (and pipeline timeline)")
    return parser


def _layout(args, gpus: int) -> Layout:
    sizes = {axis: 1 if getattr(args, axis) is None else getattr(args, axis) for axis in ("tp", "pp", "cp", "ep")}
    others = sizes["tp"] * sizes["pp"] * sizes["cp"] * sizes["ep"]
    dp = args.dp if args.dp is not None else max(1, gpus // others)
    global_batch = args.global_batch or 4 * dp * sizes["ep"] * args.micro_batch
    per_step = dp * sizes["ep"] * args.micro_batch
    if global_batch % per_step:
        raise ValueError(f"--global-batch {global_batch} must be divisible by dp x ep x micro-batch = {per_step}")
    return Layout(**sizes, dp=dp, cp_ulysses=args.cp_ulysses, cp_order=args.cp_order,
                  document_median=args.document_median, document_sigma=args.document_sigma,
                  dp_replicate=args.dp_replicate, zero_stage=args.zero, sequence_parallel=args.sp,
                  recompute=args.recompute, micro_batch=args.micro_batch,
                  num_microbatches=global_batch // per_step, schedule=args.schedule,
                  virtual_stages=args.virtual_stages, seq_len=args.seq, precision=args.precision,
                  expert_imbalance=args.expert_imbalance, compiled=args.compile)


def _describe(layout: Layout) -> str:
    parts = [f"{axis}={getattr(layout, axis)}" for axis in ("tp", "pp", "dp", "cp", "ep") if getattr(layout, axis) > 1]
    if layout.cp_ulysses > 1:
        parts.append("ulysses" if layout.cp_ulysses == layout.cp else f"ulysses={layout.cp_ulysses}")
    if layout.cp > layout.cp_ulysses and layout.cp_order != "zigzag":
        parts.append(layout.cp_order)
    if layout.dp_replicate > 1:
        parts.append(f"hsdp={layout.dp_replicate}")
    parts.append(f"zero{layout.zero_stage}")
    if layout.sequence_parallel:
        parts.append("sp")
    parts.append(f"rc={layout.recompute}")
    if layout.expert_imbalance > 1:
        parts.append(f"ep-load={layout.expert_imbalance:g}")
    parts.append(f"mb={layout.micro_batch}x{layout.num_microbatches}")
    if layout.pp > 1:
        parts.append(layout.schedule + (f"(v={layout.virtual_stages})" if layout.virtual_stages > 1 else ""))
    return " ".join(parts) if parts else "single GPU"


def _gib(value: float) -> str:
    return f"{value / 2**30:7.1f} GiB"


def _mfu_basis(layout: Layout) -> str:
    """What the MFU is against: the peak of the units each FLOP runs on (Estimate.mfu)."""
    gemms = {"fp8-mixed": "fp8", "fp8-fp32": "fp8", "fp32": "TF32"}.get(layout.precision)
    return f"against the {gemms} peak for the GEMMs, bf16 for the attention" if gemms else "against the dense bf16 peak"


def _print_estimate(model: ModelSpec, layout: Layout, e, findings) -> None:
    count = model.count_params()
    print(f"{model.name}: {count.total / 1e9:.1f}B parameters ({count.active / 1e9:.1f}B active); "
          f"layout {_describe(layout)} on {layout.num_gpus} GPUs")
    fullest = f" (pipeline rank {e.fullest_pipeline_rank}, the fullest)" if len(e.pipeline_ranks) > 1 else ""
    print(f"memory per GPU{fullest}:")
    for part in ("params", "grads", "optimizer", "activations", "backward", "buffers", "total_memory"):
        print(f"  {part:<12} {_gib(getattr(e, part))}")
    print(f"  {'GPU':<12} {_gib(e.gpu_memory)}   {'fits' if e.fits else 'DOES NOT FIT'}")
    if len(e.pipeline_ranks) > 1:
        print("  per pipeline rank: " + ", ".join(_gib(r.total).strip() for r in e.pipeline_ranks))
    c = e.compute
    print(f"step: {e.tokens_per_step:,.0f} tokens, {e.model_flops_per_step:.3e} model FLOPs; compute "
          f"{c.seconds:.3f} s (GEMMs {c.gemm_seconds:.3f}, attention {c.attention_seconds:.3f}, memory-bound "
          f"{c.memory_seconds:.3f}, optimizer {c.optimizer_seconds:.3f}), bubble {100 * e.bubble:.1f}%, step "
          f"{e.step_seconds:.3f} s, {e.tokens_per_second:,.0f} tokens/s "
          f"({e.tokens_per_second / layout.num_gpus:,.0f} per GPU), MFU {100 * e.mfu:.1f}% ({_mfu_basis(layout)})")
    ring = layout.cp // layout.cp_ulysses
    if ring > 1 and layout.document_median > 0:
        spreads = {order: attention_balance(layout.seq_len, ring, order=order, document_median=layout.document_median,
                                            document_sigma=layout.document_sigma)[1]
                   for order in _planner.OPTIONS["cp_order"]}
        print(f"attention over the {ring} ring ranks (documents: median {layout.document_median:g} tokens, sigma "
              f"{layout.document_sigma:g}), slowest rank's excess: "
              + ", ".join(f"{order} {100 * spread:.1f}%" for order, spread in spreads.items())
              + f" (this layout: {layout.cp_order})")
    if e.comm:
        print("communication per GPU per step:")
        for axis, c in e.comm.items():
            print(f"  {axis:<12} {c.bytes / 2**30:9.2f} GiB  {c.seconds:8.3f} s  "
                  f"exposed {c.exposed_seconds:8.3f} s  {'intra-domain' if c.intra_domain else 'inter-node'}")
    print("findings:" if findings else "findings: none")
    for f in findings:
        print(f"  {f}")


def _plot(path: str, entries, pp_layout: Layout | None) -> None:
    timeline, title = None, ""
    if pp_layout is not None and pp_layout.pp > 1:
        schedule = pp_layout.schedule
        passes = simulate_schedule(pp_layout.pp, pp_layout.num_microbatches, schedule,
                                   virtual_stages=pp_layout.virtual_stages)
        timeline = simulated_rows(passes, pp_layout.pp, schedule)
        title = f"{schedule} timeline: {pp_layout.pp} ranks, {pp_layout.num_microbatches} micro-batches"
        chunks = chunks_per_rank(schedule, pp_layout.virtual_stages)
        if chunks > 1:
            title += f", {chunks} chunks per rank"
    try:
        plot_plan(path, entries, timeline, title)
    except OSError as error:  # main reports it in one line
        raise ValueError(f"--plot {path}: cannot write it: {error.strerror or error}") from error


def _lint_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchdist_ext.planner lint")
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        findings = [f for path in args.paths for f in lint(path)]
    except ValueError as error:
        parser.error(str(error))
    if args.json:
        print(json.dumps([f.__dict__ for f in findings], indent=2))
    else:
        for f in findings:
            print(f)
        print(f"{len(findings)} finding(s)")
    return 1 if findings else 0


PLOT_FORMATS = (".png", ".pdf", ".svg")


def _check_plot_path(parser: argparse.ArgumentParser, path: str) -> None:
    """Refuses, before the plan is computed, a --plot that names no file of a format it writes, or a file in a
    directory that does not exist."""
    file = Path(path)
    if not path or file.is_dir() or file.suffix.lower() not in PLOT_FORMATS:
        what = "a directory" if path and file.is_dir() else f"a {file.suffix or 'suffix-less'} file"
        parser.error(f"argument --plot: {path!r} is {what}: it must name a {', '.join(PLOT_FORMATS)} file")
    directory = file.parent
    if not directory.is_dir():
        problem = "is not a directory" if directory.exists() else "does not exist"
        parser.error(f"argument --plot: {path}: its directory {directory} {problem}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "lint":
        return _lint_main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if args.plot is not None:
        _check_plot_path(parser, args.plot)
    try:
        return _plan(args)
    except ValueError as error:  # a layout the planner refuses: one line, as argparse reports its own
        parser.error(str(error))


def _plan(args) -> int:
    model = ModelSpec.preset(args.model)
    cluster = ClusterSpec.preset(args.gpu, args.gpus)
    if any(getattr(args, axis) is not None for axis in ("tp", "pp", "dp", "cp", "ep")):
        layout = _layout(args, args.gpus)
        e, findings = estimate(model, cluster, layout), check(model, cluster, layout)
        if args.json:
            print(json.dumps({"mode": "estimate", "model": model.name, "gpus": args.gpus, "gpu": args.gpu,
                              "layout": layout.__dict__, "estimate": e.to_dict(),
                              "findings": [f.__dict__ for f in findings]}, indent=2))
        else:
            _print_estimate(model, layout, e, findings)
        if args.plot is not None:
            _plot(args.plot, [(_describe(layout), e)], layout)
        return 0
    if args.dp_replicate != 1:
        raise ValueError(f"--dp-replicate {args.dp_replicate} prices a layout: give its axes (e.g. --dp); the search "
                         f"does not try HSDP layouts")
    global_batch = args.global_batch or 4 * args.gpus
    results = search(model, cluster, seq_len=args.seq, global_batch=global_batch, top=args.top,
                     expert_imbalance=args.expert_imbalance, compiled=args.compile)
    if args.json:
        print(json.dumps({"mode": "search", "model": model.name, "gpus": args.gpus, "gpu": args.gpu,
                          "results": [{"layout": layout.__dict__, "estimate": e.to_dict()} for layout, e in results]},
                         indent=2))
    else:
        print(f"{model.name} on {args.gpus} x {args.gpu}, seq {args.seq}, global batch {global_batch}: "
              f"{len(results)} fastest feasible layouts")
        print(f"{'#':>3} {'layout':<58} {'memory':>11} {'step s':>8} {'MFU':>6} {'tokens/s':>12}")
        for rank, (layout, e) in enumerate(results, 1):
            print(f"{rank:>3} {_describe(layout):<58} {_gib(e.total_memory)} {e.step_seconds:8.3f} "
                  f"{100 * e.mfu:5.1f}% {e.tokens_per_second:12,.0f}")
        if not results:
            print("no layout fits: more GPUs, a longer pipeline or full recomputation may")
    if args.plot and results:
        _plot(args.plot, [(_describe(layout), e) for layout, e in results[:6]],
              next((layout for layout, _ in results if layout.pp > 1), None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
