"""The planner's kernel efficiencies, measured on this device: what a GpuSpec preset's figures should be.

    python -m benchmarks.bench_planner_calibration [--device cuda|cpu] [--repeats N]

gemm        forward + backward of a bf16 linear (the forward GEMM, the input gradient's and the weight
            gradient's) at Llama-3-8B shapes (16384 tokens: 4096 -> 4096, 4096 -> 14336, 14336 -> 4096):
            TFLOP/s and the share of the preset's dense bf16 peak (GpuSpec.gemm_efficiency)
fp8 gemm    torch._scaled_mm with tensorwise scales at 16384 x 4096 -> 14336, e4m3 operands, bf16 out:
            the share of the fp8 peak (GpuSpec.fp8_gemm_efficiency); skipped where torch has no fp8 GEMM
attention   causal SDPA forward + backward, bf16, batch 1, 32 heads of 128, sequence 8192: FLOPs counted
            as the planner counts them (forward 2 s^2 head_dim heads, backward 2.5x), the share of the bf16
            peak (GpuSpec.attention_efficiency)
copy        a large same-device copy: the share of the preset's HBM bandwidth

The preset is the GPU_PRESETS entry whose name matches the device's (H100, H200); elsewhere (a CPU run, a
dry run of the script) only the rates are printed.
"""

import torch
import torch.nn.functional as F

from benchmarks.device_timing import copy_bandwidth, median_seconds
from benchmarks.report import arguments, emit, print_table
from torchdist_ext.planner import GPU_PRESETS


def preset_for(device: str):
    """The planner's preset of this GPU, or None."""
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name().lower()
    for key, preset in (("h200", "h200-141gb"), ("h100", "h100-80gb"), ("a100", "a100-80gb"), ("b200", "b200-192gb")):
        if key in name:
            return GPU_PRESETS[preset]
    return None


def gemm_rates(device: str, repeats: int, scale: int) -> list[dict]:
    rows = []
    tokens = 16384 // scale
    for k, n in ((4096, 4096), (4096, 14336), (14336, 4096)):
        k, n = k // scale, n // scale
        x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(tokens, n, device=device, dtype=torch.bfloat16)

        def step():
            torch.autograd.backward(F.linear(x, w), grad)

        seconds = median_seconds(step, device, repeats)
        rows.append({"kernel": f"bf16 linear {tokens} x {k} -> {n}", "tflops": 6 * tokens * k * n / seconds / 1e12,
                     "peak": "bf16"})
    return rows


def fp8_rate(device: str, repeats: int, scale: int) -> list[dict]:
    if device != "cuda" or not hasattr(torch, "_scaled_mm"):
        return []
    m, k, n = 16384 // scale, 4096 // scale, 14336 // scale
    a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
    one = torch.ones((), device=device)
    try:
        seconds = median_seconds(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), device, repeats)
    except RuntimeError as error:  # no fp8 GEMM on this GPU or build
        print(f"fp8 gemm skipped: {error}")
        return []
    return [{"kernel": f"fp8 _scaled_mm {m} x {k} -> {n}", "tflops": 2 * m * k * n / seconds / 1e12, "peak": "fp8"}]


def attention_rate(device: str, repeats: int, scale: int) -> list[dict]:
    heads, seq, head_dim = 32, 8192 // scale, 128
    q, k, v = (torch.randn(1, heads, seq, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(1, heads, seq, head_dim, device=device, dtype=torch.bfloat16)

    def step():
        torch.autograd.backward(F.scaled_dot_product_attention(q, k, v, is_causal=True), grad)

    seconds = median_seconds(step, device, repeats)
    forward = 2 * seq * seq * head_dim * heads
    return [{"kernel": f"causal SDPA {heads} x {seq} x {head_dim}", "tflops": forward * 3.5 / seconds / 1e12,
             "peak": "bf16"}]


def main(argv=None) -> None:
    args = arguments(__doc__, repeats=10, device=True).parse_args(argv)
    device, preset = args.device, preset_for(args.device)
    scale = 1 if device == "cuda" else 8  # a CPU run is a dry run of the script at an eighth of each size
    rows = []
    for row in (*gemm_rates(device, args.repeats, scale), *fp8_rate(device, args.repeats, scale),
                *attention_rate(device, args.repeats, scale)):
        peak = None if preset is None else (preset.fp8_flops if row["peak"] == "fp8" else preset.bf16_flops)
        row["share"] = None if not peak else row["tflops"] * 1e12 / peak
        emit(row, rows)
    bandwidth = copy_bandwidth(device)
    emit({"kernel": "copy", "tflops": None, "peak": "hbm", "gbps": bandwidth / 1e9,
          "share": None if preset is None else bandwidth / preset.hbm_bytes_per_s}, rows)
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}; preset: "
          f"{preset.name if preset else 'none'}"
          + (f" (gemm {preset.gemm_efficiency}, fp8 gemm {preset.fp8_gemm_efficiency}, attention "
             f"{preset.attention_efficiency})" if preset else ""))
    print_table(rows, [("kernel", 40, "kernel"), ("TFLOP/s", 9, "tflops", ".1f"), ("GB/s", 8, "gbps", ".0f"),
                       ("share", 7, "share", ".3f")])


if __name__ == "__main__":
    main()
