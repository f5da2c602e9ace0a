"""The planner's closed forms (csrc/planner/{memory,pipeline,estimate,compute,documents}.h), with keyword
arguments."""

from __future__ import annotations

from torchdist_ext import _planner
from torchdist_ext.planner.specs import ClusterSpec, GpuSpec, Layout, ModelSpec

__all__ = [
    "activation_bytes_per_layer",
    "attention_balance",
    "layer_activation_bytes",
    "layer_rerun_bytes",
    "layer_backward_bytes",
    "layer_weight_grad_input_bytes",
    "head_activation_bytes",
    "head_backward_bytes",
    "head_weight_grad_input_bytes",
    "embedding_weight_grad_input_bytes",
    "bubble_fraction",
    "gemm_seconds",
    "gpu_hours",
    "model_state_bytes",
    "training_flops",
]


def gemm_seconds(m: float, n: float, k: float, gpu: GpuSpec, *, precision: str = "bf16-mixed") -> float:
    """Seconds of one GEMM ``[m, k] x [k, n]`` on ``gpu``: its FLOPs at the sustained rate of ``precision`` (fp8
    operands at ``fp8_flops x fp8_gemm_efficiency``, TF32 at half the bf16 rate) or its operands' and result's
    bytes at 80 % of the memory bandwidth, whichever is longer (csrc/planner/compute.h)."""
    return _planner.gemm_seconds(float(m), float(n), float(k), gpu.to_cpp(), precision)


def attention_balance(seq_len: int, ranks: int, *, order: str = "zigzag", document_median: float = 0.0,
                      document_sigma: float = 1.2) -> tuple[float, float]:
    """``(work_share, spread)`` of the attention of sequences of ``seq_len`` tokens packing documents of
    log-normal lengths (median ``document_median`` tokens, log-space deviation ``document_sigma``; median 0:
    one document), cut over ``ranks`` ring ranks in ``order`` ("zigzag", "contiguous" or "balanced"): the
    (query, key) pairs over one causal document's, and the expected max / mean - 1 of the ranks' pairs
    (sampled rows, a fixed seed: csrc/planner/documents.h). The arguments follow ``Layout``'s rules."""
    for name, value in (("seq_len", seq_len), ("ranks", ranks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if ranks > seq_len:
        raise ValueError(f"ranks={ranks} must not exceed seq_len={seq_len}: every rank holds at least one token")
    Layout(cp=ranks, seq_len=seq_len, cp_order=order, document_median=document_median,
           document_sigma=document_sigma)  # the same rules for the order and the documents
    return _planner.attention_balance(seq_len, ranks, order, float(document_median), float(document_sigma))


def model_state_bytes(num_params: float, *, zero_stage: int = 0, dp: int = 1,
                      precision: str = "bf16-mixed") -> dict[str, float]:
    """Bytes per GPU of parameters, gradients and optimizer states (keys params, grads, optimizer, total).

    bf16-mixed Adam: 2 + 2 + 12 = 16 bytes per parameter; fp8-mixed 17 (a cached fp8 weight copy).
    ZeRO-1 shards the optimizer over ``dp``, ZeRO-2 also the gradients, ZeRO-3 also the parameters.
    """
    states = _planner.model_state_bytes(float(num_params), zero_stage, dp, precision)
    return {"params": states.params, "grads": states.grads, "optimizer": states.optimizer, "total": states.total()}


def activation_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int, num_heads: int, *, tp: int = 1,
                               sequence_parallel: bool = False, recompute: str = "none",
                               attention: str = "flash") -> float:
    """Activation bytes one layer stores per micro-batch (Korthikanti et al. 2022, Table 2, 16-bit), with a
    flash attention kernel (the scores never stored; the log-sum-exp is) or ``attention="eager"`` (their
    published 5as/h score term)."""
    return _planner.activation_bytes_per_layer(seq_len, micro_batch, hidden, num_heads, tp, sequence_parallel,
                                               recompute, attention)


def layer_activation_bytes(model: ModelSpec, layout: Layout, *, moe_layer: bool = False) -> float:
    """Activation bytes one layer of ``model`` stores per micro-batch under ``layout`` as our layers and
    recompute policies run it (16-bit activations; the estimate's model, written out in
    csrc/planner/memory.h): with ``layout.recompute="none"``, flash attention and fused norms,
    ``T e [4hR + (3 + 2g/a) h/t + 4f/t] + 4T (2R + a/t)`` for T tokens per micro-batch and rank of the cp group,
    e = 2, R = 1/tp with sequence parallelism, else 1."""
    return _planner.layer_activation_bytes(model.to_cpp(), layout.to_cpp(), moe_layer)


def layer_weight_grad_input_bytes(model: ModelSpec, layout: Layout, *, moe_layer: bool = False) -> float:
    """Bytes one layer keeps per micro-batch from its backward to its deferred weight-gradient pass under the
    zero-bubble schedules (what torchdist_ext's split layers queue; csrc/planner/memory.h): for a dense layer
    ``T e [6hR + (2 + 2g/a) h/t + 3f/t + 2h]``, with T, e and R as ``layer_activation_bytes``'s."""
    return _planner.layer_weight_grad_input_bytes(model.to_cpp(), layout.to_cpp(), moe_layer)


def layer_rerun_bytes(model: ModelSpec, layout: Layout, *, moe_layer: bool = False) -> float:
    """Bytes a recomputed layer's backward recreates per micro-batch on top of what the layer keeps
    (csrc/planner/memory.h): 0 without recomputation, ``layer_activation_bytes`` at recompute none under
    full, what selective drops plus the layer's output ``T e hR`` under selective; a layer whose experts are
    not recomputed reruns its attention region alone."""
    return _planner.layer_rerun_bytes(model.to_cpp(), layout.to_cpp(), moe_layer)


def layer_backward_bytes(model: ModelSpec, layout: Layout, *, moe_layer: bool = False) -> float:
    """Bytes a layer's backward allocates per micro-batch above what its rank holds at its start, at their
    largest, without recomputation (csrc/planner/memory.h): for a dense layer the larger of its down
    projection's input and weight gradients ``T e f + e h f`` (no weight gradient under zb-h1 and zb-v; with
    sequence parallelism plus the gathered output gradient and a block in flight, ``T e h (1 + R)``) and the
    gate's two input gradients ``2 T e f`` (``3 T e f``, ``+ T e h`` with SP, in split mode, whose W queue keeps the
    product), f = ffn_hidden / t; for an MoE layer, on its routed rows r, the larger of ``r e f`` and
    ``r e (2f - h)`` plus the grouped weight gradient of its local experts. A lower bound for narrow MLPs
    (f < h)."""
    return _planner.layer_backward_bytes(model.to_cpp(), layout.to_cpp(), moe_layer)


def head_activation_bytes(model: ModelSpec, layout: Layout) -> float:
    """Bytes the model's end keeps per micro-batch on the last stage from its forward to its backward: the
    final RMSNorm's input, output and 1/rms, and the vocab-parallel loss's logits, target and log-sum-exp
    (csrc/planner/memory.h)."""
    return _planner.head_activation_bytes(model.to_cpp(), layout.to_cpp())


def head_backward_bytes(model: ModelSpec, layout: Layout) -> float:
    """Bytes the head's backward allocates per micro-batch on top of what the last stage holds (its forward's
    bytes included): its input gradient ``T e h`` (``T e h R`` with SP) and weight gradient ``e V h / t`` (none
    under zb-h1 and zb-v), with SP the gathered input and an output-gradient block in flight ``T e (h + V R / t)``,
    less the loss's fp32 log-sum-exp ``4 T``, released first (csrc/planner/memory.h)."""
    return _planner.head_backward_bytes(model.to_cpp(), layout.to_cpp())


def head_weight_grad_input_bytes(model: ModelSpec, layout: Layout) -> float:
    """Bytes the final RMSNorm and the LM head in split mode keep per micro-batch from their backward to their
    deferred weight gradients: ``T e (3hR + V/t)`` (the norm's normalised input and output gradient, the head's
    input and its ``[T, V/t]`` output gradient)."""
    return _planner.head_weight_grad_input_bytes(model.to_cpp(), layout.to_cpp())


def embedding_weight_grad_input_bytes(model: ModelSpec, layout: Layout) -> float:
    """Bytes the vocab-parallel embedding in split mode keeps per micro-batch for its deferred weight
    gradient: its output gradient gathered over the sequence and its int64 ids made local, ``T (e h + 8)``."""
    return _planner.embedding_weight_grad_input_bytes(model.to_cpp(), layout.to_cpp())


def bubble_fraction(pp: int, num_microbatches: int, *, schedule: str = "1f1b", virtual_stages: int = 1) -> float:
    """Idle fraction of a pipeline step: (p-1)/(m+p-1) for 1F1B and GPipe, less for interleaved and zero-bubble."""
    return _planner.bubble_fraction(pp, num_microbatches, schedule, virtual_stages)


def training_flops(num_params: float, num_tokens: float) -> float:
    """6 N D: forward 2ND, backward 4ND."""
    return _planner.training_flops(float(num_params), float(num_tokens))


def gpu_hours(flops: float, cluster: ClusterSpec, *, mfu: float) -> float:
    """GPU-hours to run ``flops`` at ``mfu`` of the (slowest) GPU's dense bf16 peak."""
    return _planner.gpu_hours(float(flops), cluster.to_cpp(), float(mfu))
