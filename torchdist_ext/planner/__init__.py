"""The planner: memory, bubble, communication and step time of a 5-D layout before booking a cluster.

The cost model is torch-free C++ (``csrc/planner``); this package is its Python face and
``python -m torchdist_ext.planner`` its command line (``--help``).

    model, cluster = ModelSpec.preset("llama3-70b"), ClusterSpec.preset("h100-80gb", 32)
    layout = Layout(tp=8, dp=4, zero_stage=3, sequence_parallel=True)
    e = estimate(model, cluster, layout)               # memory per GPU, step time, MFU, bytes per axis
    check(model, cluster, layout)                      # findings: what would fail, and why
    search(model, cluster, seq_len=4096, global_batch=32)   # the fastest layouts that fit

Every function and its formula: docs/api.md and docs/planner.md.
"""

from torchdist_ext.planner.estimate import (
    AxisComm,
    ComputeTime,
    Estimate,
    Finding,
    RankMemory,
    check,
    estimate,
    search,
)
from torchdist_ext.planner.formulas import (
    activation_bytes_per_layer,
    attention_balance,
    bubble_fraction,
    embedding_weight_grad_input_bytes,
    gemm_seconds,
    gpu_hours,
    head_activation_bytes,
    head_backward_bytes,
    head_weight_grad_input_bytes,
    layer_activation_bytes,
    layer_backward_bytes,
    layer_rerun_bytes,
    layer_weight_grad_input_bytes,
    model_state_bytes,
    training_flops,
)
from torchdist_ext.planner.lint import lint
from torchdist_ext.planner.schedule import (
    SCHEDULES,
    ScheduledPass,
    chunks_per_rank,
    idle_fraction,
    replay_schedule,
    simulate_schedule,
    stage_of,
)
from torchdist_ext.planner.specs import GPU_PRESETS, MODEL_PRESETS, ClusterSpec, GpuSpec, Layout, ModelSpec

__all__ = [
    "AxisComm",
    "GPU_PRESETS",
    "MODEL_PRESETS",
    "ClusterSpec",
    "ComputeTime",
    "Estimate",
    "Finding",
    "GpuSpec",
    "Layout",
    "ModelSpec",
    "RankMemory",
    "SCHEDULES",
    "ScheduledPass",
    "activation_bytes_per_layer",
    "attention_balance",
    "bubble_fraction",
    "check",
    "chunks_per_rank",
    "embedding_weight_grad_input_bytes",
    "estimate",
    "gemm_seconds",
    "gpu_hours",
    "head_activation_bytes",
    "head_backward_bytes",
    "head_weight_grad_input_bytes",
    "idle_fraction",
    "layer_activation_bytes",
    "layer_backward_bytes",
    "layer_rerun_bytes",
    "layer_weight_grad_input_bytes",
    "lint",
    "model_state_bytes",
    "replay_schedule",
    "search",
    "simulate_schedule",
    "stage_of",
    "training_flops",
]
