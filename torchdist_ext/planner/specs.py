"""Model, cluster and layout descriptions of the planner, with presets.

Thin Python faces of the C++ structs in ``csrc/planner/specs.h`` (validation
and every formula live there). Bad values raise ``ValueError`` naming the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torchdist_ext import _planner

__all__ = ["ModelSpec", "GpuSpec", "ClusterSpec", "Layout", "MODEL_PRESETS", "GPU_PRESETS"]

GiB = 2**30
# The C++ width of the integer fields (csrc/planner/specs.h): int64_t, but Layout.zero_stage is an int.
_INT_BITS = {"zero_stage": 32}


def _cpp_int(owner: str, name: str, value) -> int:
    """``value`` checked for the C++ integer field ``owner.name``: a Python int (not a bool) that the field's
    width holds (the C++ validation then applies the field's own rule, such as positive)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{owner}.{name} must be an int, got {value!r}")
    bits = _INT_BITS.get(name, 64) if owner == "Layout" else 64
    low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    if not low <= value <= high:
        raise ValueError(f"{owner}.{name}={value} is out of range: the planner holds it as a {bits}-bit integer, "
                         f"in [{low}, {high}]")
    return value


def _cpp_float(owner: str, name: str, value) -> float:
    """``value`` checked for the C++ double field ``owner.name``: an int or float (not a bool) a double holds."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{owner}.{name} must be a number, got {value!r}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{owner}.{name}={value} is out of range: the planner holds it as a double") from None


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer: Llama-style (GQA, SwiGLU, untied embeddings), MoE optional.

    ``num_params`` is the published total for an architecture the shape formula
    does not cover exactly (None: counted from the shapes); ``count_params()``
    gives the counts (``total``, ``active`` per token, ``expert``, ...) either way.
    Beyond the basic shape, ``num_dense_layers`` (leading layers with a dense MLP
    in an MoE model) and ``num_shared_experts`` (experts every token uses)
    describe DeepSeek-style MoE. ``fused_projections=False`` describes a model whose attention computes
    q, k and v (and whose MLP its gate and up projections) with separate tensor-parallel linears, each
    communicating its input on its own (the planner's tp bytes count each).
    """

    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int | None = None
    ffn_hidden: int | None = None
    vocab_size: int = 32000
    num_experts: int = 1
    experts_per_token: int = 1
    moe_ffn_hidden: int | None = None
    num_params: float | None = None
    num_dense_layers: int = 0
    num_shared_experts: int = 0
    name: str = "custom"
    fused_projections: bool = True

    def __init__(self, num_layers: int, hidden: int, num_heads: int, *, num_kv_heads: int | None = None,
                 ffn_hidden: int | None = None, vocab_size: int = 32000, num_experts: int = 1,
                 experts_per_token: int = 1, moe_ffn_hidden: int | None = None, num_params: float | None = None,
                 num_dense_layers: int = 0, num_shared_experts: int = 0, name: str = "custom",
                 fused_projections: bool = True):
        values = dict(num_layers=num_layers, hidden=hidden, num_heads=num_heads, num_kv_heads=num_kv_heads,
                      ffn_hidden=ffn_hidden, vocab_size=vocab_size, num_experts=num_experts,
                      experts_per_token=experts_per_token, moe_ffn_hidden=moe_ffn_hidden,
                      num_params=num_params, num_dense_layers=num_dense_layers,
                      num_shared_experts=num_shared_experts, name=name, fused_projections=fused_projections)
        for key, value in values.items():
            object.__setattr__(self, key, value)
        self.to_cpp().validate()

    def to_cpp(self) -> _planner.ModelSpec:
        spec = _planner.ModelSpec()
        spec.name = self.name
        for key in ("num_layers", "hidden", "num_heads", "vocab_size", "num_experts", "experts_per_token",
                    "num_dense_layers", "num_shared_experts"):
            setattr(spec, key, _cpp_int("ModelSpec", key, getattr(self, key)))
        optional = {"num_kv_heads": self.num_heads, "ffn_hidden": 0, "moe_ffn_hidden": 0}  # None: this value
        for key, default in optional.items():
            value = getattr(self, key)
            setattr(spec, key, default if value is None else _cpp_int("ModelSpec", key, value))
        spec.num_params = 0.0 if self.num_params is None else _cpp_float("ModelSpec", "num_params", self.num_params)
        if not isinstance(self.fused_projections, bool):
            raise TypeError(f"ModelSpec.fused_projections must be a bool, got {self.fused_projections!r}")
        spec.fused_projections = self.fused_projections
        return spec

    def count_params(self) -> _planner.ParamCount:
        """Parameter counts: ``total`` (embeddings and LM head included), ``active`` (what a token goes
        through: for MoE the routed top-k experts plus shared ones), ``expert`` (in routed experts),
        ``moe_active`` (of ``active``, the MoE layers' routers, shared and top-k routed experts),
        ``routed_active`` (of ``moe_active``, the top-k routed experts),
        ``embedding``, ``per_layer_dense``."""
        return _planner.count_params(self.to_cpp())

    @classmethod
    def preset(cls, name: str) -> "ModelSpec":
        """One of ``MODEL_PRESETS`` (published architectures)."""
        if name not in MODEL_PRESETS:
            raise ValueError(f"unknown model preset {name!r}; known: {', '.join(sorted(MODEL_PRESETS))}")
        return MODEL_PRESETS[name]


MODEL_PRESETS: dict[str, ModelSpec] = {
    # Llama 3 (Meta 2024, "The Llama 3 Herd of Models", Table 3); published totals 8.03B, 70.6B, 405B.
    "llama3-8b": ModelSpec(32, 4096, 32, num_kv_heads=8, ffn_hidden=14336, vocab_size=128256, name="llama3-8b"),
    "llama3-70b": ModelSpec(80, 8192, 64, num_kv_heads=8, ffn_hidden=28672, vocab_size=128256, name="llama3-70b"),
    "llama3.1-405b": ModelSpec(126, 16384, 128, num_kv_heads=8, ffn_hidden=53248, vocab_size=128256,
                               name="llama3.1-405b"),
    # Llama 3.2 1B (Meta 2024, model card): 1.24B with its embedding tied to the head; counted here with an
    # untied head (1.50B), as examples/llama.py builds it.
    "llama3.2-1b": ModelSpec(16, 2048, 32, num_kv_heads=8, ffn_hidden=8192, vocab_size=128256, name="llama3.2-1b"),
    # Mixtral 8x7B (Jiang et al. 2024): 46.7B total, 12.9B active.
    "mixtral-8x7b": ModelSpec(32, 4096, 32, num_kv_heads=8, vocab_size=32000, num_experts=8, experts_per_token=2,
                              moe_ffn_hidden=14336, name="mixtral-8x7b"),
    # DeepSeek-V3 (DeepSeek-AI 2024): 671B total, 37B active; 3 dense layers, 1 shared + 256 routed experts
    # (top-8). Its MLA attention is counted as 128-head attention of width 7168 (within 0.2% of the total).
    "deepseek-v3": ModelSpec(61, 7168, 128, ffn_hidden=18432, vocab_size=129280, num_experts=256,
                             experts_per_token=8, moe_ffn_hidden=2048, num_dense_layers=3, num_shared_experts=1,
                             name="deepseek-v3"),
}


@dataclass(frozen=True)
class GpuSpec:
    """One GPU type: memory, dense bf16 and fp8 peaks, per-direction link bandwidths per GPU, memory
    bandwidth, and the shares of the peaks its kernels sustain (``csrc/planner/compute.h`` prices each op
    with them): large GEMMs in bf16 and in fp8, and a flash attention's forward and backward."""

    name: str
    memory_bytes: float
    bf16_flops: float
    nvlink_bytes_per_s: float
    internode_bytes_per_s: float
    hbm_bytes_per_s: float
    fp8_flops: float  # 0: no fp8 tensor cores
    gemm_efficiency: float
    fp8_gemm_efficiency: float  # 0 without fp8
    attention_efficiency: float

    def to_cpp(self) -> _planner.GpuSpec:
        spec = _planner.GpuSpec()
        for f in dataclasses.fields(self):
            setattr(spec, f.name, getattr(self, f.name))
        return spec


# Peaks, memory and bandwidths: vendor datasheets (dense, without sparsity). NVLink: per GPU, one direction
# (half the quoted bidirectional figure). Inter-node: one NIC per GPU (HDR 200 Gb/s for A100, NDR 400 Gb/s
# after). The efficiencies (docs/planner.md, "Compute, op by op", has the table and its sources):
#   gemm: measured here for H100 and H200 (benchmarks/README.md, bench_fp8's bf16 linear forward + backward at
#     Llama-3-8B shapes: 747 and 702 TFLOP/s on the H100, 746 and 718 on the H200, 2026-12-04/05); A100's and
#     Blackwell's are assumed, not measured here.
#   fp8 gemm: assumed 1.5x the bf16 GEMM's rate (not measured here: our Fp8Linear with its unfused casts ran
#     at 789-884 TFLOP/s, a bound from below).
#   attention: FlashAttention-2 as published (Dao 2023: A100 forward 73 %, backward 63 % of the peak: 0.65 for
#     the forward and 2.5x as much backward; Shah et al. 2024: about 350 / 310 TFLOP/s forward / backward on
#     an H100 at head dim 128: 0.33); Blackwell assumed at Hopper's.
GPU_PRESETS: dict[str, GpuSpec] = {
    "a100-80gb": GpuSpec("a100-80gb", 80 * GiB, 312e12, 300e9, 25e9, 2.039e12, 0.0, 0.80, 0.0, 0.65),
    "h100-80gb": GpuSpec("h100-80gb", 80 * GiB, 989e12, 450e9, 50e9, 3.35e12, 1979e12, 0.73, 0.56, 0.33),
    "h200-141gb": GpuSpec("h200-141gb", 141e9, 989e12, 450e9, 50e9, 4.8e12, 1979e12, 0.74, 0.56, 0.33),
    # Meta's Grand Teton H100 (torchtitan's published runs): 96 GB HBM2e at 2.4 TB/s, capped at 500 W. Its
    # peak under the cap is not published ("between SXM and NVL"): the SXM's efficiencies x 0.63, the one
    # figure fitted to a published run (torchtitan's compiled bf16 Llama-3.1-8B on 8 of them, 6,667 tokens/s
    # per GPU); docs/planner.md sets the other published runs against it.
    "h100-96gb-500w": GpuSpec("h100-96gb-500w", 96e9, 989e12, 450e9, 50e9, 2.4e12, 1979e12, 0.73 * 0.63,
                              0.56 * 0.63, 0.33 * 0.63),
    "b200-192gb": GpuSpec("b200-192gb", 192e9, 2.25e15, 900e9, 50e9, 8e12, 4.5e15, 0.73, 0.56, 0.33),
    "gb200-nvl72": GpuSpec("gb200-nvl72", 186e9, 2.5e15, 900e9, 50e9, 8e12, 5e15, 0.73, 0.56, 0.33),
}
_DOMAIN_SIZE = {"gb200-nvl72": 72}


@dataclass(frozen=True)
class ClusterSpec:
    """GPUs numbered in ``groups`` order, in NVLink domains of ``gpus_per_domain`` consecutive GPUs.

    ``groups`` is a tuple of ``(GpuSpec, count)``; several entries make a mixed cluster.
    """

    groups: tuple[tuple[GpuSpec, int], ...]
    gpus_per_domain: int = 8

    @classmethod
    def preset(cls, name: str, num_gpus: int) -> "ClusterSpec":
        """``num_gpus`` GPUs of one preset type (``GPU_PRESETS``)."""
        if name not in GPU_PRESETS:
            raise ValueError(f"unknown GPU preset {name!r}; known: {', '.join(sorted(GPU_PRESETS))}")
        cluster = cls(((GPU_PRESETS[name], num_gpus),), _DOMAIN_SIZE.get(name, 8))
        cluster.to_cpp()
        return cluster

    @property
    def num_gpus(self) -> int:
        return sum(count for _, count in self.groups)

    def to_cpp(self) -> _planner.ClusterSpec:
        spec = _planner.ClusterSpec()
        spec.groups = [(gpu.to_cpp(), count) for gpu, count in self.groups]
        spec.gpus_per_domain = self.gpus_per_domain
        spec.validate()
        return spec


@dataclass(frozen=True)
class Layout:
    """A 5-D parallel layout and its training settings (mesh order, innermost first: tp, cp, ep, dp, pp).

    Expert-parallel ranks see different tokens (dense parameters are
    data-parallel over dp x ep). A step trains micro_batch x num_microbatches
    x dp x ep sequences of seq_len tokens. The fp8 fields apply with
    ``precision="fp8-mixed"``. ``expert_imbalance``: the busiest ep rank's routed (token, expert) rows over
    the mean, in [1, ep] (1: uniform routing; a capacity factor c bounds that rank's rows by c times the
    dropless mean): that many times the rows that rank's experts keep and compute, and what it sends
    (csrc/planner/specs.h). ``cp_ulysses``: the Ulysses ranks within cp (1: ring attention over every cp
    rank; cp: Ulysses over every one; between: ``hybrid_attention``'s cp / cp_ulysses ring ranks around
    Ulysses groups), which sets how cp communicates: Ulysses' all-to-alls on the critical path, the ring's
    K/V hidden behind the attention. ``cp_order`` ("zigzag", "contiguous" or "balanced": a
    ``balanced_sequence_plan``) and the documents packed in each sequence (log-normal lengths of median
    ``document_median`` tokens, log-space deviation ``document_sigma``; median 0: one document) set the
    attention's work and its spread over the ring ranks, which the slowest rank pays
    (csrc/planner/documents.h; ``Estimate.attention_spread``). ``dp_replicate``: HSDP's replicas among the dp ranks (1: none; needs
    ``zero_stage`` >= 1): the ZeRO shards span one replica's dp x cp x ep / dp_replicate ranks, and the replicas
    all-reduce the gradient shards (the ``dp_replicate`` axis of the estimate's communication).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    cp_ulysses: int = 1
    cp_order: str = "zigzag"
    document_median: float = 0.0
    document_sigma: float = 1.2
    dp_replicate: int = 1
    zero_stage: int = 0
    sequence_parallel: bool = False
    recompute: str = "none"
    recompute_experts: bool = True
    expert_imbalance: float = 1.0
    attention: str = "flash"
    norm: str = "fused"
    micro_batch: int = 1
    num_microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    seq_len: int = 4096
    precision: str = "bf16-mixed"
    fp8_amax_history: int = 1024
    fp8_grad_format: str = "e5m2"
    fp8_attention: bool = False
    compiled: bool = False  # torch.compile of the blocks: memory-bound ops fused (csrc/planner/compute.h)

    def __post_init__(self):
        self.to_cpp()

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp * self.ep

    def to_cpp(self) -> _planner.Layout:
        spec = _planner.Layout()
        for f in dataclasses.fields(self):
            setattr(spec, f.name, _layout_value(f.name, f.type, getattr(self, f.name)))
        spec.validate()
        return spec

    @classmethod
    def from_cpp(cls, spec: _planner.Layout) -> "Layout":
        return cls(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(cls)})


def _layout_value(name: str, annotation: str, value):
    """A Layout field's value checked against its type (and an integer against its C++ width) before it reaches
    the C++ struct, whose binding would refuse it without naming the field."""
    if annotation == "int":
        return _cpp_int("Layout", name, value)
    if annotation == "float":
        return _cpp_float("Layout", name, value)
    if annotation == "bool" and not isinstance(value, bool):
        raise TypeError(f"Layout.{name} must be a bool, got {value!r}")
    if annotation == "str" and not isinstance(value, str):
        raise TypeError(f"Layout.{name} must be a str, got {value!r}")
    return value
