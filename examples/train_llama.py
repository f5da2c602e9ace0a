"""Main job: train a Llama on a byte-level corpus with FSDP2 (dp) x context (cp) x tensor (tp) x pipeline (pp)
parallelism.

    torchrun --nproc-per-node 4 examples/train_llama.py                     # dp=2 x tp=2, sequence parallel
    torchrun --nproc-per-node 4 examples/train_llama.py --check             # + the same run in one process
    torchrun --nproc-per-node 4 examples/train_llama.py --cp 2 --cp-method ring   # dp=1 x cp=2 x tp=2
    torchrun --nproc-per-node 4 examples/train_llama.py --tp 1 --cp 4 --cp-method hybrid --cp-ulysses 2
    torchrun --nproc-per-node 4 examples/train_llama.py --bf16 --check      # FSDP2 mixed precision
    torchrun --nproc-per-node 4 examples/train_llama.py --tp 1 --dp-replicate 2 --check   # HSDP: 2 replicas x 2
    torchrun --nproc-per-node 8 examples/train_llama.py --device cuda       # 8 GPUs: dp=4 x tp=2, NCCL, bf16
    torchrun --nproc-per-node 4 examples/train_llama.py --experts 4 --ep 2 --check   # MoE FFNs: ep=2 of dp=2
    torchrun --nproc-per-node 4 examples/train_llama.py --fp8 delayed --check        # fp8 GEMMs, delayed scaling
    torchrun --nproc-per-node 4 examples/train_llama.py --pp 2 --schedule zb-h1 --microbatches 4 --check
    torchrun --nproc-per-node 4 examples/train_llama.py --pp 2 --tp 1 --experts 4 --ep 2 --check  # MoE stages
    torchrun --nproc-per-node 8 examples/train_llama.py --pp 2 --steps 2 --save ckpt  # dp2 x tp2 x pp2: ckpt/step-2
    torchrun --nproc-per-node 4 examples/train_llama.py --steps 4 --resume ckpt      # continued at dp2 x tp2
    torchrun --nproc-per-node 4 examples/train_llama.py --lr-schedule wsd --warmup-steps 5 --metrics run.jsonl
    torchrun --nproc-per-node 4 examples/train_llama.py --model llama3.2-1b --layers 2 --vocab 16384  # a real width

The layout is a ``torchdist_ext.parallel.ParallelDims``, which builds every mesh once
and gives the planner the same layout. The model is the byte-level default or ``--model``'s architecture (the
planner's preset, cut to ``--layers`` and ``--vocab``). Every rank builds it on the meta device, converts it to
tensor-parallel layers and shards it with FSDP2 over dp x cp (``--dp-replicate R``: HSDP, R replicas each
sharding over dp / R x cp), then gives its shards storage and initialises them as the whole model would be in
one process (``init_weights``: no rank holds the whole model). ``--experts E`` makes every FFN a mixture of E experts (top ``--top-k``,
dropless or ``--capacity-factor c``), split over ``--ep`` ranks carved out of the
dp x cp ranks (ep divides dp x cp), each step printing the busiest expert's load
over the mean; ``--check``'s single process then routes each rank's tokens as
that rank does (with ``--pp``, each micro-batch's on their own). The corpus is cut into byte windows read
in global batches, a new permutation each epoch (``torchdist_ext.data.DataParallelSampler``); data-parallel
rank d reads its block of each, and context-parallel
ranks split its sequence (tokens, targets and RoPE positions) zigzag, which
balances causal work (for the hybrid: zigzag over the ring ranks, contiguous
over the Ulysses ranks inside each ring shard); ``--cp-balance`` splits each
step's rows by a plan of their documents instead (``balanced_sequence_plan``:
long documents cut zigzag, short ones placed whole). The loss printed is
the global mean. ``--check`` then trains the plain model in one process
(rank 0, fp32) on the whole batches and prints the largest relative loss
difference over the steps; it exits non-zero above ``--check-tolerance``.
``--fp8 delayed|current`` runs every linear but the output head with fp8 GEMMs
(``torchdist_ext.fp8``), calling ``fp8_step`` after each optimizer step. ``--bf16`` trains with FSDP2 mixed precision: bf16 parameters, activations and
all-gathers, fp32 gradient reduction, master weights and optimizer state.
``--pp P --schedule S --microbatches M`` splits the blocks into pipeline stages
(``torchdist_ext.pipeline``; the embedding on the first, the norm and head on the last)
over P ranks, each stage tensor-/context-parallel and sharded by FSDP2 as above, and
prints the last step's measured bubble next to the planner's (``--timeline out.png``
draws it); the gradient norm is taken over every stage and mesh (``torchdist_ext.clip_grad_norm_``).
``--save DIR`` writes a distributed checkpoint ``DIR/step-N`` after the last step (and every ``--save-every``
steps: model, optimizer, fp8 histories, data position, step: ``torchdist_ext.checkpoint``), and ``--resume``
continues one at any layout up to ``--steps``: the losses equal the uninterrupted run's. ``--lr-schedule``
warms up and decays the learning rate (``torchdist_ext.lr_schedules``); each step prints its loss, gradient
norm, lr, tokens/s (MFU on a GPU) and peak memory, and ``--metrics`` appends
them to a JSON-lines file.
``--ledger`` counts every process group's communication (``torchdist_ext.ledger``) and prints, after the last
step, the planner's memory per rank, bubble and bytes per axis for the layout next to that step's measured peak
memory, idle fraction and ledger bytes (``examples/predicted_vs_measured.py``).
``--device cuda`` runs one process per GPU (NCCL, gloo for the few CPU
tensors), in bf16 unless ``--fp32``, and prints each step's tokens/s and model
FLOPs utilisation (MFU, against the GPU's dense bf16 peak from the planner's
presets when the GPU is one of them).
"""

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Iterable
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama import (  # noqa: E402
    Llama, LlamaConfig, LlamaStage, MixtureOfExperts, apply_fp8, check_layout, init_weights, parallelize_llama,
)

from one_process_check import check_losses, exit_now  # noqa: E402
from predicted_vs_measured import LedgerProbe  # noqa: E402

from torchdist_ext import checkpoint, clip_grad_norm_, cpu_memory, ledger  # noqa: E402
from torchdist_ext.data import DataParallelSampler  # noqa: E402
from torchdist_ext.token_data import TokenWindows  # noqa: E402
from torchdist_ext.fp8 import (  # noqa: E402
    BlockScaling,
    CurrentScaling,
    DelayedScaling,
    RowwiseScaling,
    fp8_modules,
    fp8_step,
)
from torchdist_ext.lr_schedules import WarmupCosine, WarmupStableDecay, lr_scheduler  # noqa: E402
from torchdist_ext.parallel import MoE, ParallelDims, shard_sequence  # noqa: E402
from torchdist_ext.parallel.recompute import RECOMPUTE_MODES  # noqa: E402
from torchdist_ext.pipeline import (  # noqa: E402
    SCHEDULES,
    Pipeline,
    gather_timelines,
    measured_idle_fractions,
    num_stages,
    partition_layers,
    plot_timeline,
    pool_steps,
    predicted_idle_fraction,
    stages_of_rank,
)
from torchdist_ext.planner import (  # noqa: E402
    GPU_PRESETS, MODEL_PRESETS, ClusterSpec, Layout, ModelSpec, bubble_fraction, check,
)

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"
# The planner's presets examples/llama.py builds (GQA, SwiGLU, RoPE, RMSNorm; its head untied), with their
# RoPE base: Llama 3's 500000, Mixtral's 1e6.
MODEL_ROPE_THETA = {"llama3.2-1b": 5e5, "llama3-8b": 5e5, "llama3-70b": 5e5, "llama3.1-405b": 5e5,
                    "mixtral-8x7b": 1e6}
# fp32: summation order only. bf16 against the fp32 run: every GEMM input and the loss
# rounded to 8 mantissa bits (2^-8 = 3.9e-3 relative), compounded over the steps'
# updates (measured: 5.2e-3 over the default 50 steps).
# fp8 (e4m3 forward, e5m2 gradients) against the fp32 run: GEMM inputs rounded to 3 mantissa bits
# (2^-4 relative per element, averaging out over each GEMM's sums; measured: 2.8e-3 over 50 steps).
# fp8 against one process running the same recipe: the same scales (every amax reduced over the ranks that
# share a tensor; the one process's backward scaled to the ranks' gradient magnitudes), so the same fp8
# inputs; only the GEMMs' summation order differs, and a sum that lands on the other side of a rounding
# boundary of the next cast moves an element by a whole fp8 step, which the updates compound (measured:
# 5e-6 after 2 steps, 7.7e-5 after 4 and 1.0e-4 after 10 at dp2 x tp2 x pp2 with experts, 2.0e-3 over 50).
CHECK_TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2, "fp8": 5e-3, "fp8-vs-fp32": 2e-2}
FP8_RECIPES = {"delayed": DelayedScaling(), "current": CurrentScaling(), "rowwise": RowwiseScaling(),
               "block": BlockScaling()}
# The planner's name for this run's precision: (precision(args), fp8 GEMMs) -> Layout.precision.
PLANNER_PRECISION = {("fp32", False): "fp32", ("bf16", False): "bf16-mixed",
                     ("fp32", True): "fp8-fp32", ("bf16", True): "fp8-mixed"}
PRECISION_POLICY = {"fp32": MixedPrecisionPolicy(),
                    "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}


def counted_int(text: str, least: int) -> int:
    """An integer of at least ``least`` from the command line; argparse turns the ArgumentTypeError into its
    one-line usage error naming the flag."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= {least}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be an integer >= {least}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type of a size or count: an integer >= 1 (0 is refused, not read as the default)."""
    return counted_int(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type of a count where 0 means none (--experts 0: dense FFNs)."""
    return counted_int(text, 0)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=positive_int, default=None,
                        help="data-parallel size (default: world size / (tp x cp x pp))")
    parser.add_argument("--dp-replicate", type=positive_int, default=1,
                        help="HSDP: replicas among the dp ranks, each sharding over dp / this (default 1: FSDP)")
    parser.add_argument("--tp", type=positive_int, default=2, help="tensor-parallel size")
    parser.add_argument("--cp", type=positive_int, default=1, help="context-parallel size (sequence sharding)")
    parser.add_argument("--pp", type=positive_int, default=1,
                        help="pipeline-parallel size (stages of transformer blocks)")
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="pipeline schedule (with --pp > 1)")
    parser.add_argument("--microbatches", type=positive_int, default=None,
                        help="micro-batches per step with --pp > 1 (default: pp); divides the batch per dp rank")
    parser.add_argument("--virtual-stages", type=positive_int, default=2, help="chunks per rank of interleaved-1f1b")
    parser.add_argument("--recompute", choices=RECOMPUTE_MODES, default="none",
                        help="activation recompute of every block: selective keeps the outputs of the "
                             "communicating ops and GEMMs, full only the block's input")
    parser.add_argument("--timeline", type=Path, default=None,
                        help="with --pp > 1: write the last step's pipeline timeline PNG here")
    parser.add_argument("--cp-method", choices=("ring", "ulysses", "hybrid"), default="ring")
    parser.add_argument("--cp-ulysses", type=positive_int, default=2,
                        help="with --cp-method hybrid: the Ulysses degree inside (the ring gets cp / this)")
    parser.add_argument("--cp-balance", action="store_true",
                        help="with --cp: shard each step's rows by a balanced_sequence_plan of their documents "
                             "instead of zigzag, so packed documents of any lengths give every cp rank the same "
                             "attention work")
    parser.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false",
                        help="replicate activations between blocks instead of sharding them along the sequence")
    parser.add_argument("--steps", type=positive_int, default=50,
                        help="train up to this step (counted from the start of the run, --resume included)")
    parser.add_argument("--batch", type=positive_int, default=8, help="global batch (sequences per step)")
    parser.add_argument("--seq", type=positive_int, default=128, help="tokens per sequence")
    parser.add_argument("--grad-accum", type=positive_int, default=1,
                        help="micro-steps per step: each rank's rows in this many forward/backward passes, FSDP2 "
                             "reducing the gradients once, after the last (set_requires_gradient_sync)")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    parser.add_argument("--lr-schedule", choices=("constant", "warmup-cosine", "wsd"), default="constant",
                        help="warmup-cosine: linear warmup, then a cosine to --min-lr-ratio x --lr at --steps; wsd: "
                             "warmup, the peak held, then a decay over the last --decay-steps")
    parser.add_argument("--warmup-steps", type=non_negative_int, default=0)
    parser.add_argument("--decay-steps", type=non_negative_int, default=None,
                        help="wsd's decay (default: the last fifth of --steps)")
    parser.add_argument("--min-lr-ratio", type=float, default=None,
                        help="the last lr over the peak (default: 0.1 for warmup-cosine, 0 for wsd)")
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true", help="torch.compile every transformer block (fullgraph)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: one process per GPU (LOCAL_RANK), NCCL, bf16 unless --fp32")
    numerics = parser.add_mutually_exclusive_group()
    numerics.add_argument("--bf16", action="store_true",
                          help="FSDP2 mixed precision: bf16 parameters and activations, fp32 gradient reduction "
                               "(the default with --device cuda)")
    numerics.add_argument("--fp32", action="store_true", help="fp32 throughout (the default on the CPU)")
    parser.add_argument("--model", choices=sorted(MODEL_ROPE_THETA), default=None,
                        help="a published architecture (the planner's preset of that name; default: a 0.66M-parameter "
                             "byte-level model), built on the meta device and initialised shard by shard")
    parser.add_argument("--layers", type=positive_int, default=None, help="keep the model's first this many blocks")
    parser.add_argument("--vocab", type=positive_int, default=None,
                        help="a smaller vocabulary than the model's (at least the data's: 256 for the built-in corpus)")
    parser.add_argument("--data", type=Path, default=None,
                        help="a token file (examples/prepare_data.py), its documents kept apart by attention (default: "
                             "the built-in byte corpus)")
    parser.add_argument("--experts", type=non_negative_int, default=None,
                        help="experts per MoE FFN (0: dense FFNs; default 0, or the --model's)")
    parser.add_argument("--top-k", type=positive_int, default=None, help="experts per token (default 2, or the --model's)")
    parser.add_argument("--ep", type=positive_int, default=1, help="expert-parallel size, dividing dp x cp")
    parser.add_argument("--capacity-factor", type=float, default=None, help="drop slots past this capacity")
    parser.add_argument("--aux-loss-coef", type=float, default=0.01, help="load-balancing loss weight")
    parser.add_argument("--fp8", choices=tuple(FP8_RECIPES), default=None,
                        help="fp8 GEMMs in every linear but the output head: delayed (TransformerEngine's), "
                             "current, rowwise (torchao's) or block (DeepSeek-V3's 1x128 / 128x128) scaling; the "
                             "last two on plain linears (--tp 1) and the CPU for now")
    parser.add_argument("--fp8-all-gather", action="store_true",
                        help="with --fp8 delayed: FSDP2 all-gathers the fp8 linears' weights as fp8 bytes")
    parser.add_argument("--losses", type=Path, default=None,
                        help="write the per-step global losses here as JSON (examples/plot_losses.py plots runs)")
    parser.add_argument("--metrics", type=Path, default=None,
                        help="append each step's line here as JSON (step, loss, grad_norm, lr, tokens_per_s, mfu, "
                             "peak_memory_bytes, expert_load; examples/plot_losses.py plots it)")
    parser.add_argument("--save", type=Path, default=None,
                        help="write a distributed checkpoint to DIR/step-N after the last step N (model, "
                             "optimizer, fp8 histories, data position, step)")
    parser.add_argument("--save-every", type=positive_int, default=None,
                        help="with --save: also after every this many steps")
    parser.add_argument("--resume", type=Path, default=None,
                        help="continue from this checkpoint (a step-N directory, or --save's DIR: its latest), "
                             "written at any layout, up to --steps")
    parser.add_argument("--ledger", action="store_true",
                        help="count every process group's communication (torchdist_ext.ledger, a c10d backend "
                             "wrapping gloo / NCCL) and print the last step's bytes per axis, peak memory and "
                             "pipeline bubble next to the planner's prediction for this layout")
    parser.add_argument("--check", action="store_true", help="also train in one process (fp32) and compare losses")
    parser.add_argument("--check-reference", choices=("same", "fp32"), default="same",
                        help="with --fp8: the one process runs the same fp8 recipe (same) or plain fp32 GEMMs")
    parser.add_argument("--check-tolerance", type=float, default=None,
                        help=f"largest relative loss difference allowed by --check (default: "
                             f"{CHECK_TOLERANCE['fp32']:.0e}, with --bf16 {CHECK_TOLERANCE['bf16']:.0e}, "
                             f"with --fp8 {CHECK_TOLERANCE['fp8']:.0e} against the same recipe or "
                             f"{CHECK_TOLERANCE['fp8-vs-fp32']:.0e} against fp32)")
    args = parser.parse_args(argv)
    resolve_experts(parser, args)
    try:
        data_vocab = 256 if args.data is None else TokenWindows(args.data, args.seq).vocab_size
    except ValueError as error:
        parser.error(f"--data {args.data}: {error}")
    if model_config(args).vocab_size < data_vocab:
        parser.error(f"the model's vocabulary ({model_config(args).vocab_size}) must hold the data's: "
                     f"{'--data ' + str(args.data) if args.data else 'the built-in corpus (bytes)'} has {data_vocab}")
    if args.fp8_all_gather and args.fp8 != "delayed":
        parser.error(f"--fp8-all-gather needs --fp8 delayed (every rank casts its shard with the shared delayed "
                     f"scale), got --fp8 {args.fp8}")
    if args.grad_accum > 1 and args.pp > 1:
        parser.error("--grad-accum with --pp: the pipeline's --microbatches already accumulate; use those")
    if args.fp8 == "delayed" and args.compile and args.pp > 1:
        parser.error("--fp8 delayed with --compile and --pp is not supported: a compiled block saves its amax history "
                     "for the backward, and the next micro-batch's forward updates it first (autograd refuses); "
                     "drop --compile or use --fp8 current")
    if args.check and args.resume is not None:
        parser.error("--check trains a whole run in one process: it cannot start from --resume")
    if args.save_every is not None and args.save is None:
        parser.error("--save-every needs --save DIR (where the step-N checkpoints go)")
    try:
        lr_schedule(args)
    except ValueError as error:
        parser.error(f"--lr-schedule {args.lr_schedule}: {error}")
    refusals = layout_refusals(args, int(os.environ.get("WORLD_SIZE", "1")))
    if refusals:  # before any process group is built
        parser.error("this layout cannot run:\n  " + "\n  ".join(refusals))
    dims = parallel_dims(args, int(os.environ.get("WORLD_SIZE", "1")))
    if args.ledger and dims.dp_shard % dims.ep:
        parser.error(f"--ledger sets the run beside the planner, whose expert-parallel ranks are data-parallel "
                     f"ranks: --ep {args.ep} must divide "
                     f"{f'dp={dims.dp}' if dims.dp_replicate == 1 else f'dp / --dp-replicate = {dims.dp_shard}'} "
                     f"(here ep spans cp ranks, which the planner does not model)")
    if args.resume is not None:
        check_resumed_step(parser, args)
    if args.check_tolerance is None:
        args.check_tolerance = CHECK_TOLERANCE[check_tolerance_key(args)]
    return args


def check_resumed_step(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses (before any process group) a --resume checkpoint that cannot be read, and a --steps below the step
    it was saved at: --steps counts from the start of the run, so such a run would train no step."""
    try:
        args.resume = checkpoint.latest(args.resume)
        saved = checkpoint.load_extra(args.resume, {"step": 0})["step"]
    except (FileNotFoundError, ValueError) as error:
        parser.error(f"--resume {args.resume}: {error}")
    if args.steps < saved:
        parser.error(f"--steps {args.steps} is smaller than step {saved}, where the checkpoint --resume {args.resume} "
                     f"was saved: --steps counts from the start of the run, so give --steps {saved} or more")
    try:  # a schedule's lr at a step depends on --steps and its flags: a resumed run keeps them
        saved_schedule = checkpoint.load_extra(args.resume, {"lr_schedule": ""})["lr_schedule"]
    except (ValueError, RuntimeError, KeyError):  # saved without one: a constant lr
        saved_schedule = "constant"
    if saved_schedule != lr_schedule_name(args):
        parser.error(f"--resume {args.resume} was saved by a run with the lr schedule {saved_schedule}; this run's "
                     f"is {lr_schedule_name(args)}: resume with the same --steps and --lr-schedule flags")


def lr_schedule(args):
    """The lr factor of each step (``torchdist_ext.lr_schedules``) of --lr-schedule over --steps."""
    if args.lr_schedule == "constant":
        return lambda step: 1.0
    if args.lr_schedule == "warmup-cosine":
        return WarmupCosine(total_steps=args.steps, warmup_steps=args.warmup_steps,
                            min_ratio=0.1 if args.min_lr_ratio is None else args.min_lr_ratio)
    decay = args.steps // 5 if args.decay_steps is None else args.decay_steps
    return WarmupStableDecay(total_steps=args.steps, decay_steps=decay, warmup_steps=args.warmup_steps,
                             min_ratio=0.0 if args.min_lr_ratio is None else args.min_lr_ratio)


def lr_schedule_name(args) -> str:
    """The schedule of this run as a checkpoint records it: "constant" or the schedule's repr."""
    return "constant" if args.lr_schedule == "constant" else repr(lr_schedule(args))


def resolve_experts(parser: argparse.ArgumentParser, args) -> None:
    """--experts and --top-k: the --model's (which they may not contradict), else given or 0 and 2."""
    if args.model is None:
        args.experts = 0 if args.experts is None else args.experts
        args.top_k = 2 if args.top_k is None else args.top_k
        return
    spec = MODEL_PRESETS[args.model]
    experts, top_k = (spec.num_experts, spec.experts_per_token) if spec.num_experts > 1 else (0, 2)
    for flag, given, preset in (("--experts", args.experts, experts), ("--top-k", args.top_k, top_k)):
        if given is not None and given != preset:
            parser.error(f"{flag} {given} contradicts --model {args.model}, whose is {preset}")
    args.experts, args.top_k = experts, top_k


def model_config(args) -> LlamaConfig:
    """The model of this run: --model's architecture (the byte-level default without it), cut to --layers
    blocks and a --vocab vocabulary, for sequences of --seq tokens."""
    if args.model is None:
        base = LlamaConfig()
    else:
        spec = MODEL_PRESETS[args.model]
        base = LlamaConfig(vocab_size=spec.vocab_size, dim=spec.hidden, num_layers=spec.num_layers,
                           num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads or spec.num_heads,
                           ffn_dim=spec.moe_ffn_hidden if spec.num_experts > 1 else spec.ffn_hidden,
                           rope_theta=MODEL_ROPE_THETA[args.model])
    return replace(base, num_layers=args.layers or base.num_layers, vocab_size=args.vocab or base.vocab_size,
                   max_seq_len=args.seq, num_experts=args.experts, top_k=args.top_k,
                   capacity_factor=args.capacity_factor, aux_loss_coef=args.aux_loss_coef)


def planner_model(args) -> ModelSpec:
    """The main job's model as the planner sees it."""
    cfg = model_config(args)
    experts = (dict(num_experts=args.experts, experts_per_token=args.top_k, moe_ffn_hidden=cfg.ffn_dim)
               if args.experts else {})
    # Its attention projects q, k and v (its FFNs gate and up) with separate tensor-parallel linears.
    return ModelSpec(cfg.num_layers, cfg.dim, cfg.num_heads, num_kv_heads=cfg.num_kv_heads, ffn_hidden=cfg.ffn_dim,
                     vocab_size=cfg.vocab_size, fused_projections=False, name=args.model or "custom", **experts)


def layout_refusals(args, world_size: int) -> list[str]:
    """Why this run's layout cannot run on ``world_size`` processes: the world and batch split, the planner's
    TDX008 findings (sizes that do not divide the model, a schedule without the micro-batches it needs) and the
    model's and experts' own divisibility rules. Empty when it can run."""
    try:
        dims = parallel_dims(args, world_size)
        check_layout(model_config(args), args.tp)
        check_pipeline_stages(args, model_config(args).num_layers)
    except ValueError as error:
        return [str(error)]
    try:
        # The planner's ep ranks are data-parallel ranks; an ep reaching into cp is checked by
        # check_expert_parallel above, and the planner checks the rest without it.
        planned = dims if dims.dp_shard % dims.ep == 0 else replace(dims, ep=1)
        findings = check(planner_model(args), ClusterSpec.preset("h100-80gb", world_size),
                         planner_layout(args, planned))
    except ValueError as error:
        return [str(error)]
    return [f"{f.code} {f.severity}: {f.message}" for f in findings if f.code == "TDX008"]


def planner_layout(args, dims: ParallelDims) -> Layout:
    """This run's layout as the planner sees it: the dims' (FSDP2 is ZeRO-3 over dp_shard x cp), its
    micro-batches those of the pipeline (or of --grad-accum), in the run's precision; recompute stops at the
    experts (``apply_recompute_and_compile``)."""
    m = microbatches(args) if args.pp > 1 else args.grad_accum
    return dims.layout(sequence_parallel=args.sequence_parallel, recompute=args.recompute,
                  recompute_experts=False, seq_len=args.seq,
                  micro_batch=args.batch // dims.dp // m, num_microbatches=m,
                  schedule=args.schedule if args.pp > 1 else "1f1b",
                  virtual_stages=virtual_stages(args) if args.pp > 1 else 1,
                  precision=PLANNER_PRECISION[precision(args), bool(args.fp8)],
                  norm="composite" if args.device == "cpu" else "fused")


def check_tolerance_key(args: argparse.Namespace) -> str:
    """The key of CHECK_TOLERANCE for this run's --check."""
    if not args.fp8:
        return precision(args)
    return "fp8" if args.check_reference == "same" and precision(args) == "fp32" else "fp8-vs-fp32"


def precision(args: argparse.Namespace) -> str:
    """The key of CHECK_TOLERANCE and PRECISION_POLICY for this run."""
    return "bf16" if args.bf16 or (args.device == "cuda" and not args.fp32) else "fp32"


def model_flops_per_token(model: Llama, seq: int) -> float:
    """6 N for the weights' GEMMs (forward 2N, backward 4N; the embedding table is a lookup, norms are
    not GEMMs) plus causal attention's 6 L S d (QK^T and PV: 4 S d per token and layer forward, half of
    it masked, x3 with backward)."""
    cfg = model.cfg
    weights = sum(p.numel() for name, p in model.named_parameters() if "norm" not in name and "embeddings" not in name)
    return 6 * weights + 6 * cfg.num_layers * seq * cfg.dim


def gpu_peak_flops(device: torch.device) -> float | None:
    """The dense bf16 peak of this GPU from the planner's presets (None if it is not one of them)."""
    name = torch.cuda.get_device_name(device).lower()
    for key in ("gb200", "b200", "h200", "h100", "a100"):
        if key in name:
            return next(gpu.bf16_flops for preset, gpu in GPU_PRESETS.items() if preset.startswith(key))
    return None


def training_windows(args) -> torch.Tensor | TokenWindows:
    """The data cut into windows of --seq + 1 tokens (inputs and next-token targets): --data's token file
    (memory-mapped), or the built-in corpus's bytes ``[n, seq + 1]`` uint8 (``batches`` widens the rows)."""
    if args.data is not None:
        return TokenWindows(args.data, args.seq)
    data = torch.frombuffer(bytearray(CORPUS.read_bytes()), dtype=torch.uint8)
    count = data.numel() // (args.seq + 1)
    return data[: count * (args.seq + 1)].view(count, args.seq + 1)


def batches(windows: torch.Tensor | TokenWindows, sampler: DataParallelSampler):
    """(tokens, target, document_ids) ``[sampler.batch_size, seq]``: this dp rank's rows of each global batch,
    epoch after epoch (each pass over the sampler reads a new permutation). ``document_ids`` (a token file's
    documents packed in each row, which attention keeps apart) is None for the built-in corpus."""
    while True:
        for rows in torch.tensor(list(sampler), dtype=torch.long).split(sampler.batch_size):
            window = windows[rows].long()
            documents = windows.document_ids(window)[:, :-1].contiguous() if isinstance(windows, TokenWindows) else None
            yield window[:, :-1].contiguous(), window[:, 1:].contiguous(), documents


def build_model(args) -> Llama:
    """The model on the meta device: no storage until ``materialise`` (after parallelisation, each rank's
    shards only)."""
    with torch.device("meta"):
        return Llama(model_config(args))


def materialise(parts: Iterable[torch.nn.Module], args, device: torch.device) -> None:
    """Storage on ``device`` for each part (the model, or this rank's pipeline stages), initialised from
    --seed as the whole model would be in one process (``init_weights``)."""
    for part in parts:
        part.to_empty(device=device)
        init_weights(part, args.seed)


def check_pipeline_stages(args, num_layers: int) -> None:
    """With --pp, the schedule's stages (pp x its chunks per rank) must split the model's blocks into equal
    groups (``pipeline_stages``, ``partition_layers``)."""
    if args.pp == 1:
        return
    stages = num_stages(args.schedule, args.pp, virtual_stages(args))
    if num_layers % stages:
        raise ValueError(f"--pp {args.pp} with --schedule {args.schedule} makes {stages} pipeline stages "
                         f"({stages // args.pp} per rank): num_layers={num_layers} must be divisible by "
                         f"num_stages={stages}")


def check_expert_parallel(args, ranks: int) -> None:
    """--ep must divide the dp x cp ``ranks`` (of one HSDP replica) and --experts."""
    if args.experts and (ranks % args.ep or args.experts % args.ep):
        raise ValueError(f"--ep {args.ep} must divide dp x cp = {ranks}"
                         f"{' of an HSDP replica' if args.dp_replicate > 1 else ''} and --experts {args.experts}")


def expert_token_groups(args, dims: ParallelDims) -> list[torch.Tensor]:
    """The flattened ``[batch * seq]`` token indices each dp x cp rank routes in one MoE call, in that rank's
    order: its batch rows (with --pp, one micro-batch of them at a time), and its sequence shard (zigzag over
    the ring ranks, or over the Ulysses ranks for --cp-method ulysses; the hybrid's Ulysses ranks take
    contiguous blocks of each ring shard)."""
    zigzag, inner = (dims.cp_ulysses, 1) if dims.ring == 1 else (dims.ring, dims.cp_ulysses)
    chunks = torch.arange(args.seq).chunk(2 * zigzag)
    groups = []
    for rank_rows in torch.arange(args.batch).chunk(dims.dp):
        for rows in rank_rows.chunk(microbatches(args) if args.pp > 1 else args.grad_accum):
            for z in range(zigzag):
                for positions in torch.cat([chunks[z], chunks[2 * zigzag - 1 - z]]).chunk(inner):
                    groups.append((rows.unsqueeze(1) * args.seq + positions).flatten())
    return groups


def expert_load(model, group) -> float:
    """The busiest expert's tokens over the mean, in the worst MoE layer, summed over `group`'s ranks."""
    counts = torch.stack([m.last_tokens_per_expert for m in model.modules() if isinstance(m, MoE)]).float()
    dist.all_reduce(counts, group=group)
    return (counts.max(1).values / counts.mean(1)).max().item()


def ulysses_ranks(args) -> int:
    """The Ulysses ranks within --cp (ParallelDims.cp_ulysses) of --cp-method."""
    if args.cp == 1 or args.cp_method == "ring":
        return 1
    if args.cp_method == "ulysses":
        return args.cp
    if args.cp % args.cp_ulysses:
        raise ValueError(f"--cp {args.cp} must be divisible by --cp-ulysses {args.cp_ulysses}")
    return args.cp_ulysses


def microbatches(args) -> int:
    """--microbatches, or pp when it is not given (parse_args refuses an explicit 0)."""
    return args.pp if args.microbatches is None else args.microbatches


def virtual_stages(args) -> int:
    return args.virtual_stages if args.schedule == "interleaved-1f1b" else 1


def pipeline_stages(args, single: Llama, pp_rank: int) -> list[LlamaStage]:
    """This pipeline rank's stages of ``single`` (contiguous equal groups of blocks), chunk 0 first."""
    stages = num_stages(args.schedule, args.pp, virtual_stages(args))
    layers = partition_layers(single.cfg.num_layers, stages)
    return {s: LlamaStage(single, layers[s], first=s == 0, last=s == stages - 1)
            for s in stages_of_rank(args.schedule, args.pp, pp_rank, virtual_stages(args))}


def report_bubble(args, pipe: Pipeline, kept: list[list], rank: int) -> tuple[float, float]:
    """Prints the measured idle fraction per pipeline rank, the mean over the steps of ``kept`` (this rank's
    ``pipe.timeline`` of each step, gathered here once) after the first (which compiles and warms up; the
    first if it is the only one), next to the planner's prediction for those steps' mean F / B / W times and
    its closed form (one step's bubble varies with its actions' times, several steps' mean is steadier);
    writes the last step's timeline PNG with --timeline. Returns (the planner's for the measured times, the
    measured)."""
    timed = gather_timelines(pipe, kept)
    steps = timed[1:] or timed
    fractions = [measured_idle_fractions(timelines) for timelines in steps]
    per_rank = [statistics.mean(f[0][r] for f in fractions) for r in range(pipe.pp)]
    overall = statistics.mean(f[1] for f in fractions)
    predicted = predicted_idle_fraction(pipe, pool_steps(steps))
    closed = bubble_fraction(args.pp, microbatches(args), schedule=args.schedule,
                             virtual_stages=virtual_stages(args))
    if rank == 0:
        print(f"pipeline {args.schedule}, pp={args.pp}, m={microbatches(args)}: measured bubble "
              f"{overall:.3f} (per pp rank {', '.join(f'{f:.3f}' for f in per_rank)}; mean of {len(steps)} "
              f"steps), planner {predicted:.3f} for the measured F/B/W times (closed form {closed:.3f})",
              flush=True)
        if args.timeline is not None:
            _, last = measured_idle_fractions(timed[-1])
            plot_timeline(args.timeline, timed[-1], title=f"{args.schedule}, pp={args.pp}, m={microbatches(args)}: "
                          f"measured bubble {last:.3f} (this step; mean {overall:.3f}), planner {predicted:.3f}")
    return predicted, overall


def parallel_dims(args, world_size: int) -> ParallelDims:
    """This run's axes, checked against the world size and the batch (each error naming its flags)."""
    ulysses = ulysses_ranks(args)
    others = args.tp * args.cp * args.pp
    if args.dp is None and world_size % others:
        raise ValueError(f"--cp {args.cp} x --tp {args.tp} x --pp {args.pp} = {others} must divide the world size "
                         f"{world_size} (dp takes the rest)")
    dp = world_size // others if args.dp is None else args.dp
    if dp * others != world_size:
        raise ValueError(f"--dp {dp} x --cp {args.cp} x --tp {args.tp} x --pp {args.pp} must equal the world size "
                         f"{world_size}")
    if args.batch % dp:
        raise ValueError(f"--batch {args.batch} must be divisible by dp={dp}")
    if (args.batch // dp) % args.grad_accum:
        raise ValueError(f"--batch {args.batch} / dp={dp} must be divisible by --grad-accum {args.grad_accum}")
    if args.pp > 1 and (args.batch // dp) % microbatches(args):
        raise ValueError(f"--batch {args.batch} / dp={dp} must be divisible by --microbatches {microbatches(args)}")
    if dp % args.dp_replicate:
        raise ValueError(f"--dp-replicate {args.dp_replicate} must divide dp={dp}")
    check_expert_parallel(args, dp // args.dp_replicate * args.cp)
    if args.cp_balance and args.cp == 1:
        raise ValueError("--cp-balance plans the sequence over the cp ranks: it needs --cp > 1")
    if args.cp_balance and args.check and args.experts and args.capacity_factor is not None:
        raise ValueError("--cp-balance with --check and --capacity-factor: the single process routes each rank's "
                         "tokens in the zigzag shards' groups, which each step's plan changes; use dropless experts")
    return ParallelDims(world_size=world_size, dp_replicate=args.dp_replicate, dp_shard=dp // args.dp_replicate,
                        cp=args.cp, cp_ulysses=ulysses, tp=args.tp, pp=args.pp, ep=args.ep if args.experts else 1)


def shard_step(args, meshes, tokens, target, documents, zigzag_positions):
    """(tokens, target, documents, positions) of this rank for one step: its cp shard of the rows (zigzag, or
    with --cp-balance the rows' balanced plan, whose positions [batch, seq_local] then also mask the
    attention), on the device; ``zigzag_positions`` [seq_local] otherwise."""
    device = zigzag_positions.device
    if meshes.cp is not None and args.cp_balance:
        plan = meshes.sequence_plan(torch.zeros_like(tokens) if documents is None else documents)
        tokens, target, documents = (t if t is None else plan.shard(t, dim=1, cp_mesh=meshes.cp)
                                     for t in (tokens, target, documents))
        positions = plan.positions(cp_mesh=meshes.cp)
    elif meshes.cp is not None:
        tokens, target, documents = (t if t is None else shard_sequence(t, cp_mesh=meshes.cp, dim=1, order="zigzag")
                                     for t in (tokens, target, documents))
        positions = zigzag_positions
    else:
        positions = zigzag_positions
    return tuple(t if t is None else t.to(device) for t in (tokens, target, documents, positions))


def accumulate_gradients(model, tokens: torch.Tensor, target: torch.Tensor, positions: torch.Tensor,
                         documents: torch.Tensor | None, micro_steps: int) -> torch.Tensor:
    """Forward and backward of this rank's rows in ``micro_steps`` equal parts, each loss weighed 1/micro_steps;
    FSDP2 reduces the accumulated gradients once, in the last backward (``set_requires_gradient_sync``, its
    own accumulation API: no manual ``no_sync``). Returns the mean loss."""
    total = torch.zeros((), device=tokens.device)
    parts = documents.chunk(micro_steps) if documents is not None else [None] * micro_steps
    # Per-row positions (--cp-balance) are split with the rows; a shared [seq] serves every part.
    position_parts = positions.chunk(micro_steps) if positions.dim() == 2 else [positions] * micro_steps
    for index, (rows, targets, part, part_positions) in enumerate(
            zip(tokens.chunk(micro_steps), target.chunk(micro_steps), parts, position_parts)):
        model.set_requires_gradient_sync(index == micro_steps - 1)
        loss = model(rows, targets, part_positions, part) / micro_steps
        loss.backward()
        total += loss.detach().float()
    return total


def train_parallel(args, world_size: int, rank: int, device: torch.device) -> list[float]:
    dims = parallel_dims(args, world_size)
    # FSDP2 shards over dp_shard x cp (context-parallel ranks hold the same parameters and see other tokens),
    # HSDP replicates that over dp_replicate; fp8 reduces its amaxes over a pipeline stage's ranks.
    meshes = dims.build_meshes(args.device)
    before_build = allocated_memory(device, reset_peak=True)
    single = build_model(args)
    flops_per_token = model_flops_per_token(single, args.seq)
    peak = gpu_peak_flops(device) if device.type == "cuda" else None
    experts = {"ep_mesh": meshes.ep, "expert_dp_mesh": meshes.expert_fsdp} if args.experts else {}
    parallelize = partial(parallelize_llama, tp_mesh=meshes.tp, dp_mesh=meshes.fsdp,
                          sequence_parallel=args.sequence_parallel, attend=meshes.context_attention(),
                          compile=args.compile, mp_policy=PRECISION_POLICY[precision(args)], **experts,
                          fp8=FP8_RECIPES.get(args.fp8), fp8_all_gather=args.fp8_all_gather,
                          fp8_amax_mesh=meshes.stage, recompute_mode=args.recompute)
    pipe = None
    if args.pp > 1:
        stages = {s: parallelize(stage) for s, stage in pipeline_stages(args, single, meshes.pp.get_local_rank()).items()}
        del single  # with the other stages' blocks, which this rank never runs
        materialise(stages.values(), args, device)  # before the pipeline gives its layers their split state
        last = num_stages(args.schedule, args.pp, virtual_stages(args)) - 1
        pipe = Pipeline(stages, pp_mesh=meshes.pp, schedule=args.schedule, num_microbatches=microbatches(args),
                        loss_fn=lambda logits, target: stages[last].loss_fn(logits, target),
                        virtual_stages=virtual_stages(args))
        model = torch.nn.ModuleList(pipe.stages.values())
    else:
        model = parallelize(single)
        materialise([model], args, device)
    # One optimizer per part (pipeline stage), so that a checkpoint names each state by its parameter's name in
    # the whole model and loads at any other split.
    parts = list(model) if pipe is not None else [model]
    if rank == 0:
        report_build(args, parts, device, before_build)
    # The loss is the mean over the pipeline's micro-batches (or --grad-accum's micro-steps), and each MoE call
    # adds its auxiliary losses' gradient on its own: weigh them as one call's share.
    calls_per_step = microbatches(args) if pipe is not None else args.grad_accum
    for moe in (m for part in parts for m in part.modules() if isinstance(m, MoE)):
        moe.aux_loss_coef /= calls_per_step
        moe.z_loss_coef /= calls_per_step
    optimizers = [torch.optim.AdamW(part.parameters(), lr=args.lr) for part in parts]
    # Made before a checkpoint's load, whose optimizer state then keeps the base lr (initial_lr).
    schedulers = [lr_scheduler(optimizer, lr_schedule(args)) for optimizer in optimizers]
    batch_group = meshes.batch.get_group()  # the ranks whose losses make the step's mean
    windows = training_windows(args)
    sampler = DataParallelSampler(len(windows), dp_mesh=meshes.dp, batch_size=args.batch // dims.dp, seed=args.seed)
    first_step = 0
    if args.resume is not None:
        saved = checkpoint.load(args.resume, parts, optimizers, extra={"step": 0, "sampler": sampler.state_dict()})
        sampler.load_state_dict(saved["sampler"])
        first_step = saved["step"]
        schedulers = [lr_scheduler(optimizer, lr_schedule(args), step=first_step) for optimizer in optimizers]
    if rank == 0:
        print(f"world {world_size}: "
              f"{f'pp={args.pp} ({args.schedule}, {microbatches(args)} micro-batches) x ' if args.pp > 1 else ''}"
              f"dp={dims.dp}{f' (HSDP: {dims.dp_replicate} x {dims.dp_shard})' if dims.dp_replicate > 1 else ''} "
              f"x cp={args.cp} ({dims.cp_method or 'off'}: "
              f"ring {dims.ring} x ulysses {dims.cp_ulysses}) x tp={args.tp}, sequence_parallel={args.sequence_parallel}, "
              f"compile={args.compile}, recompute={args.recompute}, {precision(args)}"
              f"{f' with fp8 GEMMs ({args.fp8}) in {len(fp8_modules(model))} linears' if args.fp8 else ''}"
              f"{' (fp8 all-gathers)' if args.fp8_all_gather else ''} "
              f"on {args.device}"
              f"{f', {args.experts} experts (top {args.top_k}) over ep={args.ep}' if args.experts else ''}; "
              f"{sum(p.numel() for p in model.parameters()):,} parameters"
              f"{' on pipeline rank 0' if args.pp > 1 else ''}", flush=True)
    # --ledger measures the last step against the planner (examples/predicted_vs_measured.py).
    probe = LedgerProbe(meshes, parts, device, args.steps - 1, bool(args.experts)) if args.ledger else None
    zigzag_positions = torch.arange(args.seq, device=device)
    if meshes.cp is not None:
        zigzag_positions = shard_sequence(zigzag_positions, cp_mesh=meshes.cp, dim=0, order="zigzag")
    losses, kept = [], []  # kept: this rank's pipeline timeline of each step
    data = batches(windows, sampler)
    for step in range(first_step, args.steps):
        if probe is not None:
            probe.start(step)
        start = time.perf_counter()
        tokens, target, documents = next(data)
        tokens, target, documents, positions = shard_step(args, meshes, tokens, target, documents, zigzag_positions)
        if pipe is None:
            loss = accumulate_gradients(model, tokens, target, positions, documents, args.grad_accum)
        else:
            stage_inputs = {name: t for name, t in (("document_ids", documents), ("positions", positions))
                            if t is not None and t.dim() == 2}
            if positions.dim() == 1:  # shared by every micro-batch; per-row ones travel in stage_inputs
                for stage in pipe.stages.values():
                    stage.positions = positions
            loss = pipe.step(tokens, target, stage_inputs or None)
        # The norm of the whole model's gradient (every mesh, every stage), as one process would clip.
        grad_norm = clip_grad_norm_(parts, args.max_grad_norm, pp_mesh=meshes.pp)
        lr = optimizers[0].param_groups[0]["lr"]
        for part, optimizer, scheduler in zip(parts, optimizers, schedulers):
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            fp8_step(part)  # no-op without --fp8; one amax all-reduce per stage
        if probe is not None:
            probe.finish(step, pipe)
        sampler.advance()
        # Every dp x cp rank's loss is the mean over the same number of tokens.
        global_loss = loss.detach().to(torch.float32, copy=True)  # with --bf16 the loss is bf16
        dist.all_reduce(global_loss, group=batch_group)
        global_loss /= meshes.batch.size()
        losses.append(global_loss.item())
        elapsed = time.perf_counter() - start  # .item() above waited for the step's work
        if pipe is not None:
            kept.append(pipe.timeline)
        load = expert_load(model, batch_group) if args.experts else None
        if rank == 0:
            tokens_per_second = args.batch * args.seq / elapsed  # the whole world's: one global batch per step
            log_step(args, {"step": step, "loss": losses[-1], "grad_norm": grad_norm.item(), "lr": lr,
                            "tokens_per_s": tokens_per_second,
                            "mfu": tokens_per_second * flops_per_token / (peak * world_size) if peak else None,
                            "peak_memory_bytes": step_peak_memory(device), "expert_load": load})
        if args.save_every is not None and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            save_checkpoint(args, step + 1, parts, optimizers, sampler, rank)
    bubbles = report_bubble(args, pipe, kept, rank) if kept else None
    if probe is not None:
        probe.report(planner_model(args), planner_layout(args, dims), world_size, bubbles, rank)
    if args.save is not None:
        save_checkpoint(args, args.steps, parts, optimizers, sampler, rank)
    return first_step, losses


def log_step(args, metrics: dict) -> None:
    """Rank 0's line for a step (what a person reads at a glance), and with --metrics the same as a JSON line."""
    line = (f"step {metrics['step']:3d}  loss {metrics['loss']:.4f}  grad_norm {metrics['grad_norm']:.3f}  "
            f"lr {metrics['lr']:.2e}  {metrics['tokens_per_s']:,.0f} tokens/s")
    if metrics["mfu"] is not None:
        line += f"  MFU {100 * metrics['mfu']:.2f}%"
    if metrics["peak_memory_bytes"] is not None:
        line += f"  peak {metrics['peak_memory_bytes'] / 2**20:,.1f} MiB"
    if metrics["expert_load"] is not None:
        line += f"  expert load max/mean {metrics['expert_load']:.2f}"
    print(line, flush=True)
    if args.metrics is not None:
        with args.metrics.open("a") as file:
            file.write(json.dumps(metrics) + "\n")


def step_peak_memory(device: torch.device) -> int | None:
    """This rank's peak of live tensor bytes so far (CUDA's allocator; on the CPU when ``cpu_memory`` tracks,
    as main() has it), or None."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return cpu_memory.max_memory_allocated() if cpu_memory.tracking() else None


def allocated_memory(device: torch.device, *, reset_peak: bool = False) -> int | None:
    """This rank's live tensor bytes now (as ``step_peak_memory`` counts them), or None; ``reset_peak``: the
    peak starts again from here."""
    if device.type == "cuda":
        if reset_peak:
            torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    if not cpu_memory.tracking():
        return None
    if reset_peak:
        cpu_memory.reset_peak_memory_stats()
    return cpu_memory.memory_allocated()


def report_build(args, parts: list[torch.nn.Module], device: torch.device, before: int | None) -> None:
    """Prints (rank 0) the model's size and what building it cost this rank: the bytes of its parameter
    shards and the peak of live tensor bytes from before the model to now, above ``before``."""
    whole = int(planner_model(args).count_params().total)
    local = sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for part in parts for p in part.parameters())
    peak = step_peak_memory(device)
    element = next(p for part in parts for p in part.parameters()).element_size()
    blocks = model_config(args).num_layers
    print(f"model {args.model or 'byte-level'} ({blocks} block{'s' if blocks != 1 else ''}, vocab "
          f"{model_config(args).vocab_size:,}): {whole:,} parameters ({whole * element / 2**20:,.1f} MiB); built "
          f"on the meta device, rank 0 holds {local / 2**20:,.1f} MiB of them"
          f"{'' if peak is None or before is None else f', peak {(peak - before) / 2**20:,.1f} MiB while building'}",
          flush=True)


def save_checkpoint(args, step: int, parts, optimizers, sampler: DataParallelSampler, rank: int) -> None:
    """The model, optimizers, data position and step after ``step`` steps, to --save's DIR/step-{step}."""
    path = args.save / f"step-{step}"
    checkpoint.save(path, parts, optimizers, extra={"step": step, "sampler": sampler.state_dict(),
                                                    "lr_schedule": lr_schedule_name(args)})
    if rank == 0:
        print(f"saved step {step} to {path}", flush=True)


def train_single_process(args, device: torch.device, dims: ParallelDims) -> list[float]:
    model = build_model(args)
    materialise([model], args, device)
    if args.fp8 and args.check_reference == "same":  # one process sees every amax: nothing to reduce
        recipe = replace(FP8_RECIPES[args.fp8], reduce_amax=False) if args.fp8 == "delayed" else FP8_RECIPES[args.fp8]
        apply_fp8(model, recipe, all_gather=False, amax_mesh=None)
    experts = [m for m in model.modules() if isinstance(m, MixtureOfExperts)]
    for moe in experts:  # route as the parallel ranks do: each rank's tokens on their own
        moe.groups = [group.to(device) for group in expert_token_groups(args, dims)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = lr_scheduler(optimizer, lr_schedule(args))
    windows = training_windows(args)
    data = batches(windows, DataParallelSampler(len(windows), batch_size=args.batch, seed=args.seed))
    # Against the same fp8 recipe: each rank's gradients are those of its own tokens' mean loss (FSDP2 then
    # averages them), dp x cp times the whole batch's. Scale the backward alike, so that the gradients' amaxes,
    # and with them the delayed scales (which decide what underflows), are the ranks'.
    grad_scale = dims.dp * dims.cp if args.fp8 and args.check_reference == "same" else 1
    losses = []
    for _ in range(args.steps):
        tokens, target, documents = (t if t is None else t.to(device) for t in next(data))
        loss = model(tokens, target, document_ids=documents)
        ((loss + sum(moe.auxiliary for moe in experts)) * grad_scale).backward()
        if grad_scale != 1:
            for param in model.parameters():
                if param.grad is not None:
                    param.grad.div_(grad_scale)
        clip_grad_norm_(model, args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        fp8_step(model)  # no-op without fp8 modules
        losses.append(loss.item())
    return losses


def main(argv=None) -> int:
    args = parse_args(argv)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is visible to this process")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group(ledger.backend("cpu:gloo,cuda:nccl") if args.ledger else "cpu:gloo,cuda:nccl",
                                device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group(ledger.backend("gloo") if args.ledger else "gloo")
        cpu_memory.track()  # before the model: every tensor of this rank counted
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        first_step, losses = train_parallel(args, world_size, rank, device)
        if args.losses is not None and rank == 0:
            args.losses.write_text(json.dumps({"command": " ".join(sys.argv), "first_step": first_step,
                                               "losses": losses}))
        if not args.check:
            return 0
        dims = parallel_dims(args, world_size)
        return check_losses(losses, lambda: train_single_process(args, device, dims), args.check_tolerance)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    exit_now(main())
