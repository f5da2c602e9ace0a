"""The planner's Python API against hand computations, published figures and published layouts.

(The C++ formulas are also unit-tested in tests/cpp/test_planner.cpp.)
"""

import dataclasses
import math

import pytest

from torchdist_ext.planner import (
    GPU_PRESETS,
    ClusterSpec,
    Estimate,
    GpuSpec,
    Layout,
    ModelSpec,
    activation_bytes_per_layer,
    bubble_fraction,
    check,
    estimate,
    gemm_seconds,
    gpu_hours,
    layer_activation_bytes,
    model_state_bytes,
    search,
    simulate_schedule,
    training_flops,
)

GiB = 2**30


@pytest.mark.parametrize(
    "name, total, active",
    [
        ("llama3-8b", 8.03e9, None),      # Llama 3 paper
        ("llama3-70b", 70.6e9, None),
        ("llama3.1-405b", 405e9, None),
        ("mixtral-8x7b", 46.7e9, 12.9e9),  # Jiang et al. 2024
        ("deepseek-v3", 671e9, 37e9),      # DeepSeek-AI 2024
    ],
)
def test_presets_match_published_parameter_counts(name, total, active):
    count = ModelSpec.preset(name).count_params()
    assert count.total == pytest.approx(total, rel=0.02)
    if active is not None:
        # DeepSeek-V3's MLA attention is counted as plain attention: its active count is within 5%.
        assert count.active == pytest.approx(active, rel=0.05)


def test_llama3_8b_count_written_out():
    h, kv, ffn, vocab, layers = 4096, 8 * 128, 14336, 128256, 32
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * ffn + 2 * h
    assert ModelSpec.preset("llama3-8b").count_params().total == layers * per_layer + 2 * h * vocab + h


def test_a_published_total_rescales_the_counts():
    model = ModelSpec(2, 64, 4, ffn_hidden=128, vocab_size=100, num_params=1e6)
    counted = ModelSpec(2, 64, 4, ffn_hidden=128, vocab_size=100).count_params()
    assert model.num_params == 1e6 and model.count_params().total == pytest.approx(1e6)
    assert model.count_params().active == pytest.approx(counted.active * 1e6 / counted.total)


def test_model_states_and_the_reference_notes():
    # 16 bytes per parameter: 70B -> 1.12 TB, 13B -> 208 GB; ZeRO-3 over 32 -> 35 GB per GPU.
    assert model_state_bytes(70e9)["total"] == 1.12e12
    assert model_state_bytes(13e9)["total"] == 208e9
    assert model_state_bytes(70e9, zero_stage=3, dp=32)["total"] == 35e9
    zero1 = model_state_bytes(1, zero_stage=1, dp=8)
    assert zero1 == {"params": 2, "grads": 2, "optimizer": 12 / 8, "total": 4 + 12 / 8}


def test_activation_and_bubble_closed_forms():
    sbh = 4096 * 8192
    # Korthikanti's Table 2 assumes eager attention (the scores stored): 6.51 GB; a flash kernel keeps only
    # the fp32 log-sum-exp of each head and query instead.
    assert activation_bytes_per_layer(4096, 1, 8192, 64, attention="eager") == sbh * (34 + 5 * 64 * 4096 / 8192)
    assert activation_bytes_per_layer(4096, 1, 8192, 64) == sbh * 34 + 4 * 64 * 4096
    assert activation_bytes_per_layer(4096, 1, 8192, 64, tp=8, sequence_parallel=True,
                                      recompute="selective") == sbh * 34 / 8
    # p = 8, m = 4: 7/11 = 63.6% (the commonly quoted 46% is wrong: docs/planner.md); m >= 4p: 7/39 = 17.9%.
    assert bubble_fraction(8, 4) == pytest.approx(7 / 11)
    assert bubble_fraction(8, 32) == pytest.approx(7 / 39)
    assert bubble_fraction(8, 32, schedule="interleaved-1f1b", virtual_stages=4) == pytest.approx(7 / 135)
    assert bubble_fraction(8, 32, schedule="zb-v") == pytest.approx(7 / 199)
    for schedule, v in (("1f1b", 1), ("gpipe", 1), ("zb-h1", 1), ("zb-v", 1), ("interleaved-1f1b", 2)):
        passes = simulate_schedule(4, 8, schedule, virtual_stages=v)
        makespan = max(p.end for p in passes)
        busy = sum(p.end - p.start for p in passes)
        expected = bubble_fraction(4, 8, schedule=schedule, virtual_stages=v)
        assert 1 - busy / (4 * makespan) == pytest.approx(expected), schedule


def test_flops_and_gpu_hours():
    assert training_flops(70e9, 1.4e12) == 5.88e23  # Chinchilla 70B: as in the notes
    hours = gpu_hours(5.88e23, ClusterSpec.preset("h100-80gb", 1), mfu=1.0)
    assert hours == pytest.approx(5.88e23 / 989e12 / 3600)  # 165,150 GPU-hours, not "13 million"
    assert gpu_hours(5.88e23, ClusterSpec.preset("h100-80gb", 1024), mfu=0.4) == pytest.approx(hours / 0.4)


def mt_nlg_530b() -> ModelSpec:
    # Smith et al. 2022: 105 layers, hidden 20480, 128 heads, GELU MLP 4h (8h^2 parameters, as SwiGLU
    # of width 8h/3), vocabulary 51200.
    return ModelSpec(105, 20480, 128, ffn_hidden=54613, vocab_size=51200, name="mt-nlg-530b")


def test_published_layouts_are_feasible():
    # MT-NLG 530B: 2240 A100 80GB, TP 8 x PP 35 x DP 8, sequence 2048, batch 1920, activation checkpointing.
    mt_nlg = mt_nlg_530b()
    assert mt_nlg.count_params().total == pytest.approx(530e9, rel=0.01)
    layout = Layout(tp=8, pp=35, dp=8, zero_stage=1, sequence_parallel=False, recompute="full",
                    micro_batch=1, num_microbatches=1920 // 8, seq_len=2048)
    cluster = ClusterSpec.preset("a100-80gb", 2240)
    e = estimate(mt_nlg, cluster, layout)
    assert e.fits, e
    assert not [f for f in check(mt_nlg, cluster, layout) if f.severity == "error"]
    assert 0.2 < e.mfu < 0.6  # the paper reports 126 TFLOP/s per A100, 40% of peak
    # Llama 3.1 405B: 16,384 H100, TP 8 x PP 16 x DP 128, sequence 8192, 16 sequences per DP rank.
    llama = ModelSpec.preset("llama3.1-405b")
    layout = Layout(tp=8, pp=16, dp=128, zero_stage=1, sequence_parallel=True, recompute="full",
                    micro_batch=1, num_microbatches=16, schedule="interleaved-1f1b", virtual_stages=2, seq_len=8192)
    cluster = ClusterSpec.preset("h100-80gb", 16384)
    e = estimate(llama, cluster, layout)
    assert e.fits, e
    findings = check(llama, cluster, layout)
    assert [f.code for f in findings] == ["TDX002"]  # m = 16 < 4p = 64: a warning, not an error
    assert 0.2 < e.mfu < 0.6  # the paper reports 38-43% MFU


def test_estimate_breakdown_is_consistent():
    model, cluster = ModelSpec.preset("llama3-70b"), ClusterSpec.preset("h100-80gb", 32)
    layout = Layout(tp=8, dp=4, zero_stage=3, sequence_parallel=True, recompute="full", num_microbatches=8)
    e = estimate(model, cluster, layout)
    parts = ("params", "grads", "optimizer", "activations", "backward", "buffers")
    assert e.backward > 0
    assert e.total_memory == pytest.approx(sum(getattr(e, p) for p in parts))
    assert e.params_per_gpu == pytest.approx(model.count_params().total / 8)
    assert e.params + e.grads + e.optimizer == pytest.approx(model.count_params().total / 8 * 16 / 4)
    assert e.tokens_per_step == 4 * 8 * 4096
    assert set(e.comm) == {"tp", "dp"}
    assert e.comm["tp"].intra_domain and not e.comm["dp"].intra_domain
    assert e.step_seconds >= e.compute.seconds
    assert e.tokens_per_second == pytest.approx(e.tokens_per_step / e.step_seconds)


def test_every_layout_finding_triggers_and_stays_silent_when_clean():
    model, cluster = ModelSpec.preset("llama3-70b"), ClusterSpec.preset("h100-80gb", 64)
    clean = Layout(tp=8, pp=2, dp=4, zero_stage=1, sequence_parallel=True, num_microbatches=8)
    assert check(model, cluster, clean) == []
    cases = {
        "TDX001": Layout(tp=16, pp=1, dp=4, sequence_parallel=True),
        "TDX002": Layout(tp=8, pp=8, dp=1, num_microbatches=4),
        "TDX007": Layout(tp=8, pp=2, dp=4, num_microbatches=8, precision="fp8-mixed", fp8_amax_history=1),
    }
    for code, layout in cases.items():
        assert [f.code for f in check(model, cluster, layout)] == [code]
    fp8 = Layout(tp=8, pp=2, dp=4, num_microbatches=8, precision="fp8-mixed", fp8_grad_format="e4m3",
                 fp8_attention=True)
    assert [f.code for f in check(model, cluster, fp8)] == ["TDX007", "TDX007"]
    assert check(model, cluster, Layout(tp=8, pp=2, dp=4, num_microbatches=8, precision="fp8-mixed")) == []
    h100, a100 = ClusterSpec.preset("h100-80gb", 1).groups[0][0], ClusterSpec.preset("a100-80gb", 1).groups[0][0]
    mixed = ClusterSpec(((h100, 60), (a100, 4)))  # the last node half A100: in a tp group and in pp groups
    findings = check(model, mixed, clean)
    assert [f.code for f in findings] == ["TDX006", "TDX006"]
    assert "a tp group" in findings[0].message and "a pp group" in findings[1].message
    assert check(model, ClusterSpec(((h100, 56), (a100, 8))), Layout(tp=8, dp=8)) == []


def test_search_returns_feasible_layouts_fastest_first():
    model, cluster = ModelSpec.preset("llama3-70b"), ClusterSpec.preset("h100-80gb", 32)
    results = search(model, cluster, seq_len=4096, global_batch=32, top=10)
    assert 1 <= len(results) <= 10
    times = [e.step_seconds for _, e in results]
    assert times == sorted(times)
    for layout, e in results:
        assert layout.num_gpus == 32 and e.fits
        assert layout.num_microbatches * layout.micro_batch * layout.dp * layout.ep == 32
        assert not [f for f in check(model, cluster, layout) if f.severity == "error"]
        assert layout.tp <= 8


def test_mixtral_with_expert_parallelism():
    model, cluster = ModelSpec.preset("mixtral-8x7b"), ClusterSpec.preset("h100-80gb", 64)
    e = estimate(model, cluster, Layout(tp=2, ep=8, dp=4, zero_stage=1, sequence_parallel=True,
                                        recompute="selective", num_microbatches=4))
    assert e.fits and "ep" in e.comm
    # Each GPU holds 1/8 of the experts (not split over tp: every tp rank holds its ep rank's experts) and
    # half of the rest.
    count = model.count_params()
    assert e.params_per_gpu == pytest.approx(count.expert / 8 + (count.total - count.expert) / 2)


def test_full_recompute_reruns_only_what_it_reaches():
    """Full recompute reruns the blocks' forward: each of their linears' forward GEMM (one of its three) and
    each attention's forward (1 of a flash kernel's 3.5), not the LM head outside the checkpointed blocks,
    and, under SP, each block's gathers. Where it does not reach the experts (``recompute_experts=False``,
    the main job's MoE blocks) the MoE layers' router and experts and the gather of their input are not
    rerun."""
    model, cluster = ModelSpec.preset("mixtral-8x7b"), ClusterSpec.preset("h100-80gb", 64)
    layout = Layout(tp=2, ep=8, dp=4, zero_stage=1, sequence_parallel=True, num_microbatches=4)
    none = estimate(model, cluster, layout)
    whole = estimate(model, cluster, dataclasses.replace(layout, recompute="full"))
    blocks = estimate(model, cluster, dataclasses.replace(layout, recompute="full", recompute_experts=False))
    head = 4 * 3 * gemm_seconds(4096, model.vocab_size / 2, model.hidden, GPU_PRESETS["h100-80gb"])
    assert whole.compute.gemm_seconds - none.compute.gemm_seconds == pytest.approx(
        (none.compute.gemm_seconds - head) / 3)
    assert none.compute.gemm_seconds < blocks.compute.gemm_seconds < whole.compute.gemm_seconds
    assert whole.compute.attention_seconds == pytest.approx(none.compute.attention_seconds * 4.5 / 3.5)
    assert blocks.compute.attention_seconds == whole.compute.attention_seconds
    # The gather of each MoE layer's input, (t - 1)/t of [b, s, h] per micro-batch, is not rerun.
    gather = 4 * model.num_layers * 0.5 * 4096 * model.hidden * 2
    assert whole.comm["tp"].bytes - blocks.comm["tp"].bytes == pytest.approx(gather)
    # Nor the experts' dispatch and combine: 4 all-to-alls per MoE layer, 6 where recompute reruns them.
    assert blocks.comm["ep"].bytes == none.comm["ep"].bytes
    assert whole.comm["ep"].bytes == pytest.approx(none.comm["ep"].bytes * 6 / 4)


def test_an_imbalanced_expert_rank_keeps_computes_and_sends_back_more_rows():
    """``expert_imbalance`` x: the busiest ep rank's experts get x times the mean of the routed rows. They keep x
    times the rows' activations and run x times the routed GEMMs (the step waits for them). With every rank's
    tokens sending x/ep of their rows there, that rank sends (1 - x/ep) of its own rows and (ep - 1) x/ep of a
    rank's rows back: at ep = 8, x = 1.5, (8 + 9) / 14 times uniform routing's bytes."""
    model, cluster = ModelSpec.preset("mixtral-8x7b"), ClusterSpec.preset("h100-80gb", 64)
    uniform = Layout(tp=2, ep=8, dp=4, zero_stage=1, sequence_parallel=True, num_microbatches=4)
    skewed = dataclasses.replace(uniform, expert_imbalance=1.5)
    tokens, h, k, f = 4096, model.hidden, model.experts_per_token, model.moe_ffn_hidden
    rows = layer_activation_bytes(model, skewed, moe_layer=True) - layer_activation_bytes(model, uniform, moe_layer=True)
    assert rows == pytest.approx(0.5 * tokens * 2 * k * (2 * h + 4 * f))  # bf16: e = 2
    e, busy = estimate(model, cluster, uniform), estimate(model, cluster, skewed)
    # Its routed GEMMs (compute-bound at these sizes) on its dp x ep share of the step's tokens, at the
    # H100's sustained 73 %.
    routed = 6 * model.count_params().routed_active * e.tokens_per_step / (4 * 8)
    assert busy.compute.gemm_seconds - e.compute.gemm_seconds == pytest.approx(0.5 * routed / (989e12 * 0.73))
    assert busy.comm["ep"].bytes == pytest.approx(e.comm["ep"].bytes * (8 + 1.5 * 6) / 14)
    assert busy.model_flops_per_step == e.model_flops_per_step
    with pytest.raises(ValueError, match=r"Layout.expert_imbalance must lie in \[1, ep=8\].*got 9"):
        dataclasses.replace(uniform, expert_imbalance=9)
    with pytest.raises(TypeError, match="Layout.expert_imbalance must be a number, got 'x'"):
        dataclasses.replace(uniform, expert_imbalance="x")


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: ModelSpec(0, 4096, 32), "ModelSpec.num_layers must be positive, got 0"),
        (lambda: ModelSpec(32, -1, 32), "ModelSpec.hidden must be positive"),
        (lambda: ModelSpec(32, 4096, 30), "hidden=4096 must be divisible by num_heads=30"),
        (lambda: Layout(tp=0), "Layout.tp must be positive, got 0"),
        (lambda: Layout(recompute="some"), "Layout.recompute must be one of none, selective, full"),
        (lambda: search(ModelSpec.preset("mixtral-8x7b"), ClusterSpec.preset("h100-80gb", 8), seq_len=4096,
                        global_batch=8, expert_imbalance=float("inf")),
         "expert_imbalance must be a finite number >= 1"),
        (lambda: estimate(ModelSpec.preset("llama3-8b"), ClusterSpec.preset("h100-80gb", 16), Layout(tp=8, dp=4)),
         r"tp x pp x dp x cp x ep = 8 x 1 x 4 x 1 x 1 = 32 must equal the cluster's 16 GPUs"),
        (lambda: estimate(ModelSpec.preset("llama3-8b"), ClusterSpec.preset("h100-80gb", 3), Layout(tp=3)),
         "Layout.tp=3 must divide ModelSpec.num_heads=32"),
        (lambda: Layout(cp=4, cp_ulysses=3), "Layout.cp_ulysses=3 must divide Layout.cp=4"),
        (lambda: Layout(cp_ulysses=0), "Layout.cp_ulysses must be positive, got 0"),
        (lambda: estimate(ModelSpec(4, 96, 6, num_kv_heads=6, ffn_hidden=256), ClusterSpec.preset("h100-80gb", 4),
                          Layout(cp=4, cp_ulysses=4, seq_len=128)),
         "Layout.cp_ulysses=4 must divide the heads of a tp rank, num_heads / tp = 6"),
        (lambda: estimate(ModelSpec(4, 96, 6, num_kv_heads=3, ffn_hidden=256), ClusterSpec.preset("h100-80gb", 2),
                          Layout(cp=2, cp_ulysses=2, seq_len=128)),
         "Layout.cp_ulysses=2 must divide or be a multiple of the kv heads of a tp rank, num_kv_heads / tp = 3"),
        (lambda: ModelSpec.preset("gpt-5"), "unknown model preset 'gpt-5'"),
        (lambda: ClusterSpec.preset("tpu-v5", 8), "unknown GPU preset 'tpu-v5'"),
        (lambda: ClusterSpec.preset("h100-80gb", 0), "GPU count must be positive"),
        (lambda: ClusterSpec(((GpuSpec("x", 0, 1, 1, 1, 1, 0, 0.5, 0, 0.5), 8),)).to_cpp(),
         r"GpuSpec\(x\).memory_bytes must be positive"),
        (lambda: ClusterSpec(((GpuSpec("x", 1, 1, 1, 1, 1, 0, 1.5, 0, 0.5), 8),)).to_cpp(),
         r"GpuSpec\(x\).gemm_efficiency must lie in \(0, 1\], got 1.5"),
        (lambda: ClusterSpec(((GpuSpec("x", 1, 1, 1, 1, 1, 2, 0.5, 0, 0.5), 8),)).to_cpp(),
         r"GpuSpec\(x\).fp8_gemm_efficiency must lie in \(0, 1\], got 0"),
        (lambda: estimate(ModelSpec.preset("llama3-8b"), ClusterSpec.preset("a100-80gb", 8),
                          Layout(dp=8, precision="fp8-mixed")),
         "Layout.precision=fp8-mixed runs fp8 GEMMs: GPU a100-80gb has no fp8 tensor cores"),
    ],
)
def test_bad_input_names_the_field(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_layout_rejects_non_integers():
    with pytest.raises(TypeError, match="Layout.tp must be an int"):
        Layout(tp=2.5)
    assert math.isclose(Layout(tp=2, dp=2).num_gpus, 4)


@pytest.mark.parametrize("make, error, message", [
    (lambda: Layout(tp=2**70), ValueError,
     r"Layout.tp=1180591620717411303424 is out of range: the planner holds it as a 64-bit integer"),
    (lambda: Layout(seq_len=-2**63 - 1), ValueError, r"Layout.seq_len=-9223372036854775809 is out of range"),
    (lambda: Layout(zero_stage=2**40), ValueError, r"Layout.zero_stage=1099511627776 is out of range: .* 32-bit"),
    (lambda: Layout(expert_imbalance=10**400), ValueError, r"Layout.expert_imbalance=1000.* is out of range"),
    (lambda: Layout(tp=True), TypeError, r"Layout.tp must be an int, got True"),
    (lambda: Layout(sequence_parallel=1), TypeError, r"Layout.sequence_parallel must be a bool, got 1"),
    (lambda: Layout(schedule=1), TypeError, r"Layout.schedule must be a str, got 1"),
    (lambda: ModelSpec(2**70, 64, 4), ValueError, r"ModelSpec.num_layers=1180591620717411303424 is out of range"),
    (lambda: ModelSpec(2, 64, 4, ffn_hidden=2**64), ValueError, r"ModelSpec.ffn_hidden=18446744073709551616 is out"),
], ids=["tp-2**70", "seq-below-int64", "zero-stage-int32", "imbalance-double", "bool-int", "int-bool", "int-str",
        "model-layers", "model-ffn"])
def test_values_the_cpp_fields_cannot_hold_name_the_field(make, error, message):
    """Checked in Python before the C++ struct's binding, which would refuse them without naming the field."""
    with pytest.raises(error, match=message):
        make()
    assert Layout(tp=2**62).tp == 2**62  # the largest sizes C++ holds pass on to its own validation


SMALL = dict(num_kv_heads=4, ffn_hidden=256, vocab_size=256)  # the main job's Llama (examples/llama.py)


def small_estimate(layout: Layout, **model) -> Estimate:
    return estimate(ModelSpec(4, 128, 8, **{**SMALL, **model}), ClusterSpec.preset("h100-80gb", layout.num_gpus), layout)


def test_tensor_parallel_bytes_count_every_ring():
    """In units of (t-1)/t X (X = b s h e): with SP a block of c column linears and a row linear moves 3c + 2
    (c gathers and a reduce-scatter forward; c reduce-scatters, the row's gather and each column's input
    gathered again backward), the embedding 2 and the head 3; the ledger counts exactly these
    (tests/test_ledger.py, tests/examples/test_train_llama.py)."""
    layout = Layout(tp=2, dp=2, zero_stage=3, sequence_parallel=True, seq_len=128, micro_batch=2, precision="fp32")
    x = 2 * 128 * 128 * 4
    assert small_estimate(layout).comm["tp"].bytes == (4 * (5 + 5) + 3 + 2) * x / 2
    # Separate q, k, v and gate, up linears: attention 3c + 2 = 11, MLP 8.
    assert small_estimate(layout, fused_projections=False).comm["tp"].bytes == (4 * (11 + 8) + 3 + 2) * x / 2
    # Without SP: each column's input gradient all-reduced backward and the row's output forward (2 + 2c), the
    # embedding's output (2) and the head's input gradient (2).
    plain = dataclasses.replace(layout, sequence_parallel=False)
    assert small_estimate(plain).comm["tp"].bytes == (4 * (4 + 4) + 2 + 2) * x / 2
    # bf16 halves every byte.
    assert small_estimate(dataclasses.replace(layout, precision="bf16-mixed")).comm["tp"].bytes == (4 * 10 + 5) * x / 4
    # fp8 GEMMs on bf16 activations: each block's column input and row output gradient travel as fp8 bytes (half
    # a unit each), the reduce-scatters' sums in bf16: (c + 1)(1 + 1/2) = 3 per block (bench_fp8.py's step: 1536
    # KiB against bf16's 2560 for one block; tests/test_ledger.py counts the rings).
    fp8 = dataclasses.replace(layout, precision="fp8-mixed")
    assert small_estimate(fp8).comm["tp"].bytes == (4 * (3 + 3) + 3 + 2) * x / 4


@pytest.mark.parametrize("cp, ulysses, tp, units", [
    (2, 1, 2, 2 * 2 * (3 * 1 + 1)),            # ring: 2 kv heads of K/V, 3 (r - 1) + 1 = 4 hops
    (4, 1, 1, 2 * 4 * (3 * 3 + 1)),            # ring of 4, 4 kv heads
    (2, 2, 2, 2 * (2 * 4 + 2 * 2) * 1 / 2),    # Ulysses: q + out (4 heads), k + v (2), both ways, half of each
    (4, 4, 2, 2 * (2 * 4 + 2 * 4) * 3 / 4),    # 2 kv heads replicated to one per Ulysses rank: 4
    (8, 2, 1, 2 * (2 * 8 + 2 * 4) / 2 + 2 * 4 * (3 * 3 + 1)),  # hybrid: Ulysses of 2 inside a ring of 4
])
def test_context_parallel_bytes_follow_the_attention(cp, ulysses, tp, units):
    """In units of one head of the local sequence, [b, s / cp, head_dim] (8 heads, 4 kv heads): the ring
    sends its K/V r - 1 times forward, again backward with the dK/dV accumulators' r hops; Ulysses sends
    (u - 1) / u of q, k, v and the output forward and of their gradients backward; hybrid both, the ring's
    K/V of the local sequence's kv heads. The main job's ledger counts the same (tests/examples)."""
    layout = Layout(tp=tp, cp=cp, cp_ulysses=ulysses, zero_stage=3, seq_len=128, micro_batch=2, precision="fp32")
    head = 2 * 128 // cp * 16 * 4
    assert small_estimate(layout).comm["cp"].bytes == pytest.approx(4 * units * head)


def test_ulysses_all_to_alls_are_exposed_and_the_ring_hides_behind_attention():
    """At 32k tokens on 8 H100s the ring's K/V hide behind the attention; Ulysses' all-to-alls never do, and
    hybrid exposes its Ulysses part only."""
    ring = Layout(cp=8, zero_stage=3, seq_len=32768, precision="fp32")
    cluster = ClusterSpec.preset("h100-80gb", 8)
    model = ModelSpec.preset("llama3-8b")
    assert estimate(model, cluster, ring).comm["cp"].exposed_seconds == 0
    ulysses = estimate(model, cluster, dataclasses.replace(ring, cp_ulysses=8)).comm["cp"]
    assert ulysses.exposed_seconds == ulysses.seconds > 0
    hybrid = estimate(model, cluster, dataclasses.replace(ring, cp_ulysses=2)).comm["cp"]
    two = estimate(model, ClusterSpec.preset("h100-80gb", 2), dataclasses.replace(ring, cp=2, cp_ulysses=2))
    # The hybrid's Ulysses part: (u - 1) / u of the same tensors as Ulysses over 2 ranks, at 8 ranks' s / cp.
    assert hybrid.exposed_seconds == pytest.approx(two.comm["cp"].seconds / 4)
    assert hybrid.exposed_seconds < hybrid.seconds


@pytest.mark.parametrize("pp, schedule, virtual_stages, sends", [
    (2, "1f1b", 1, 1),         # each rank sends one way
    (4, "1f1b", 1, 2),         # middle ranks send both ways
    (2, "interleaved-1f1b", 2, 3),  # rank 0: stage 0 forward, stage 2 both ways
    (2, "zb-v", 1, 2),         # the V's turn stays on the last rank
])
def test_pipeline_bytes_are_the_busiest_ranks(pp, schedule, virtual_stages, sends):
    layout = Layout(pp=pp, dp=1, seq_len=128, micro_batch=1, num_microbatches=8, schedule=schedule,
                    virtual_stages=virtual_stages, precision="fp32")
    assert small_estimate(layout).comm["pp"].bytes == 8 * sends * 128 * 128 * 4


def test_zero3_gathers_blocks_twice_per_micro_batch_the_root_once_and_under_pp_once_per_step():
    """Measured with the ledger (tests/examples/test_train_llama.py): FSDP2 gathers a block for its forward and
    its backward, the root unit (embedding, final norm, head) once per micro-batch, and reduce-scatters once
    per step; a pipeline keeps every parameter unsharded through the step. Shards over dp x cp."""
    count = ModelSpec(4, 128, 8, **SMALL).count_params()
    blocks, ends = count.total - count.embedding, count.embedding
    share = 3 / 4 * 4  # (n-1)/n bytes per fp32 parameter, n = dp x cp = 4
    layout = Layout(dp=2, cp=2, zero_stage=3, seq_len=128, micro_batch=1, num_microbatches=2, precision="fp32")
    assert small_estimate(layout).comm["dp"].bytes == pytest.approx(share * (blocks * 5 + ends * 3))
    piped = Layout(pp=2, dp=4, zero_stage=3, seq_len=128, micro_batch=1, num_microbatches=4, precision="fp32")
    stage = small_estimate(piped).params_per_gpu
    assert small_estimate(piped).comm["dp"].bytes == pytest.approx(3 / 4 * 4 * stage * 2)


def test_hsdp_shards_within_a_replica_and_all_reduces_the_shards_across_replicas():
    """dp=4 as 2 replicas of 2 shards (dp_replicate=2, cp=2): the states shard over one replica's dp x cp = 4
    ranks (twice the 8 ranks' shard of plain FSDP), the gathers and reduce-scatter run within it, and the
    replicas all-reduce each rank's gradient shard once per step: 2 (r - 1) / r x the shard's bytes."""
    count = ModelSpec(4, 128, 8, **SMALL).count_params()
    blocks, ends = count.total - count.embedding, count.embedding
    flat = Layout(dp=4, cp=2, zero_stage=3, seq_len=128, micro_batch=1, num_microbatches=2, precision="fp32")
    hsdp = dataclasses.replace(flat, dp_replicate=2)
    assert small_estimate(hsdp).params == pytest.approx(2 * small_estimate(flat).params)
    assert small_estimate(hsdp).optimizer == pytest.approx(count.total * 8 / 4)
    assert small_estimate(hsdp).comm["dp"].bytes == pytest.approx(3 / 4 * 4 * (blocks * 5 + ends * 3))
    assert small_estimate(hsdp).comm["dp_replicate"].bytes == pytest.approx(2 * 1 / 2 * count.total / 4 * 4)
    assert "dp_replicate" not in small_estimate(flat).comm


def test_hsdp_replicas_cross_nodes_while_shards_stay_inside_one():
    """16 GPUs as 2 replicas of 8: the shard groups are the 8 GPUs of a node (NVLink), the replicas' all-reduce
    crosses nodes; with no replicas FSDP's 16 ranks span both nodes."""
    model, cluster = ModelSpec.preset("llama3-8b"), ClusterSpec.preset("h100-80gb", 16)
    flat = estimate(model, cluster, Layout(dp=16, zero_stage=3, seq_len=8192, recompute="selective"))
    hsdp = estimate(model, cluster, Layout(dp=16, dp_replicate=2, zero_stage=3, seq_len=8192, recompute="selective"))
    assert not flat.comm["dp"].intra_domain
    assert hsdp.comm["dp"].intra_domain and not hsdp.comm["dp_replicate"].intra_domain
    assert hsdp.comm["dp_replicate"].bytes == pytest.approx(model.count_params().total / 8 * 2)


@pytest.mark.parametrize("fields, message", [
    ({"dp": 6, "dp_replicate": 4, "zero_stage": 3}, "Layout.dp_replicate=4 must divide Layout.dp=6"),
    ({"dp": 4, "dp_replicate": 2, "zero_stage": 0}, "Layout.dp_replicate=2 needs zero_stage >= 1"),
    ({"dp": 4, "dp_replicate": 0, "zero_stage": 3}, "dp_replicate"),
])
def test_hsdp_layouts_that_cannot_exist_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        Layout(**fields)


def test_fp32_training_states_are_sixteen_bytes_per_parameter():
    assert model_state_bytes(1, precision="fp32") == {"params": 4, "grads": 4, "optimizer": 8, "total": 16}
    layout = Layout(dp=1, seq_len=128, micro_batch=1)
    fp32, bf16 = small_estimate(dataclasses.replace(layout, precision="fp32")), small_estimate(layout)
    # The 16-bit activations double; the fp32 statistics (1/rms, log-sum-exp) do not.
    assert 1.5 * bf16.activations < fp32.activations < 2 * bf16.activations


def test_zero_bubble_v_counts_two_stages_per_rank_against_the_layers():
    """zb-v puts two stages on each rank: pp=4 needs 8 layers (the main job's 4 cannot split; 4 x 2 > 4)."""
    model, cluster = ModelSpec(4, 128, 8, **SMALL), ClusterSpec.preset("h100-80gb", 4)
    findings = check(model, cluster, Layout(pp=4, schedule="zb-v", num_microbatches=8))
    assert [(f.code, f.message.split(":")[0]) for f in findings] == [("TDX008", "Layout")]
    assert ("pp x stages per rank (zb-v) = 8 pipeline stages must not exceed ModelSpec.num_layers=4"
            in findings[0].message)
    assert check(model, cluster, Layout(pp=2, dp=2, schedule="zb-v", num_microbatches=8)) == []


@pytest.mark.parametrize("sizes, product", [
    (dict(tp=2**62, pp=4), rf"tp x pp x dp x cp x ep = {2**62} x 4 x 1 x 1 x 1"),
    (dict(micro_batch=2**40, seq_len=2**30),
     rf"micro_batch x num_microbatches x seq_len x dp = {2**40} x 1 x {2**30} x 1"),
], ids=["world", "tokens"])
def test_sizes_whose_product_overflows_are_refused(sizes, product):
    with pytest.raises(ValueError, match=rf"Layout: {product} overflows a 64-bit integer"):
        Layout(**sizes)
