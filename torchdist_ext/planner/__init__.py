"""The planner: memory, bubble, communication and step time of a 5-D layout before booking a cluster.

The cost model is torch-free C++ (``csrc/planner``, bound as ``torchdist_ext._planner``);
this package is its Python face, and ``python -m torchdist_ext.plan`` its CLI.

    ModelSpec(num_layers, hidden, num_heads, *, num_kv_heads=None, ffn_hidden=None, vocab_size=32000,
              num_experts=1, experts_per_token=1, moe_ffn_hidden=None, num_params=None)
    ModelSpec.preset("llama3-70b")        llama3-8b, llama3-70b, llama3.1-405b, mixtral-8x7b, deepseek-v3
    ModelSpec.count_params()              total, active, expert, moe_active, routed_active, embedding, per_layer_dense
    ClusterSpec.preset("h100-80gb", 32)   a100-80gb, h100-80gb, h200-141gb, b200-192gb, gb200-nvl72
    Layout(tp=1, pp=1, dp=1, cp=1, ep=1, *, zero_stage=0, sequence_parallel=False, recompute="none", ...)
    model_state_bytes, bubble_fraction, training_flops, gpu_hours
    layer_activation_bytes(model, layout)   what one layer stores for the backward (the estimate's model)
    layer_weight_grad_input_bytes           what it keeps for a deferred weight gradient (zero-bubble)
    layer_rerun_bytes                       what its recomputation recreates during its backward
    layer_backward_bytes                    the gradients its backward allocates at once
    head_activation_bytes, head_backward_bytes, head_weight_grad_input_bytes,
    embedding_weight_grad_input_bytes         the model's ends
    activation_bytes_per_layer               Korthikanti et al.'s published GPT formula
    estimate(model, cluster, layout) -> Estimate
    check(model, cluster, layout) -> list[Finding];  lint(path) -> list[Finding]
    search(model, cluster, *, seq_len, global_batch, top=10) -> list[(Layout, Estimate)]
"""

from torchdist_ext.planner.estimate import AxisComm, Estimate, Finding, RankMemory, check, estimate, search
from torchdist_ext.planner.formulas import (
    activation_bytes_per_layer,
    bubble_fraction,
    embedding_weight_grad_input_bytes,
    gpu_hours,
    head_activation_bytes,
    head_backward_bytes,
    head_weight_grad_input_bytes,
    layer_activation_bytes,
    layer_backward_bytes,
    layer_rerun_bytes,
    layer_weight_grad_input_bytes,
    model_state_bytes,
    simulate_schedule,
    training_flops,
)
from torchdist_ext.planner.lint import lint
from torchdist_ext.planner.specs import GPU_PRESETS, MODEL_PRESETS, ClusterSpec, GpuSpec, Layout, ModelSpec

__all__ = [
    "AxisComm",
    "GPU_PRESETS",
    "MODEL_PRESETS",
    "ClusterSpec",
    "Estimate",
    "Finding",
    "GpuSpec",
    "Layout",
    "ModelSpec",
    "RankMemory",
    "activation_bytes_per_layer",
    "bubble_fraction",
    "check",
    "embedding_weight_grad_input_bytes",
    "estimate",
    "gpu_hours",
    "head_activation_bytes",
    "head_backward_bytes",
    "head_weight_grad_input_bytes",
    "layer_activation_bytes",
    "layer_backward_bytes",
    "layer_rerun_bytes",
    "layer_weight_grad_input_bytes",
    "lint",
    "model_state_bytes",
    "search",
    "simulate_schedule",
    "training_flops",
]
