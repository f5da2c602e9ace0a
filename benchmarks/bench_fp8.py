"""FP8: the fused cast + amax against the unfused torch expression, and an fp8 linear against bf16.

    python benchmarks/bench_fp8.py [--device cuda|cpu]

cast_amax   ours: tdx::fp8_cast_amax (one read of x, one byte written per element) | unfused:
            ``amax = x.abs().amax(); where(x.isfinite(), (x.float() * scale).clamp(..), nan).to(e4m3)``;
            with the fraction of the copy bandwidth measured in the same run that ours reaches
            (counting one read of x and one write of the fp8 bytes)
linear      forward + backward of Fp8Linear (delayed scaling, "hybrid") against nn.Linear in bf16 on
            the same shapes: on a CPU torch._scaled_mm has no fp8 hardware and may well be slower;
            the GPU figure is the one that matters. Also the signal-to-quantisation-noise ratio of the
            fp8 output and gradients against the same linear in fp32 (after the timed steps, so the
            delayed scales are set): 20 log10(|reference| / |fp8 - reference|) dB
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from device_timing import copy_bandwidth, median_seconds  # noqa: E402

from torchdist_ext.fp8 import DelayedScaling, Fp8Linear, fp8_step  # noqa: E402
from torchdist_ext.ops import fp8_cast_amax  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    casts, linears = cast_rows(args.device, args.repeats), linear_rows(args.device, args.repeats)
    for row in casts + linears:
        print(json.dumps(row), flush=True)
    print()
    print(f"{'device':>6} {'shape':>12} {'dtype':>9} {'ours ms':>9} {'unfused ms':>10} {'ours/unfused':>12} {'of bw':>6}")
    for r in casts:
        print(f"{r['device']:>6} {'x'.join(map(str, r['shape'])):>12} {r['dtype']:>9} {r['ours_ms']:9.3f} "
              f"{r['unfused_ms']:10.3f} {r['ours_over_unfused']:12.3f} {r['bandwidth_fraction']:6.3f}")
    print()
    print(f"{'device':>6} {'tokens x in x out':>20} {'bf16 ms':>9} {'fp8 ms':>9} {'fp8/bf16':>9} {'fp8 TFLOP/s':>11} "
          f"{'SQNR dB out / dx / dw':>22}")
    for r in linears:
        shape = f"{r['tokens']}x{r['in']}x{r['out']}"
        sqnr = f"{r['sqnr_out_db']:.1f} / {r['sqnr_grad_x_db']:.1f} / {r['sqnr_grad_w_db']:.1f}"
        print(f"{r['device']:>6} {shape:>20} {r['bf16_ms']:9.3f} {r['fp8_ms']:9.3f} {r['fp8_over_bf16']:9.3f} "
              f"{r['fp8_tflops']:11.3f} {sqnr:>22}")


if __name__ == "__main__":
    main()
