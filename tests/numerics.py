"""Comparison rule of the test suite: max abs error relative to the reference's scale."""

import torch

# fp32 tensor-parallel results vs one process: DESIGN.md's 1e-5 of the output scale.
# bf16: parameters, activations and gradients rounded to 8 mantissa bits (2^-8 = 3.9e-3)
# through two GEMMs and a reduction; 3e-2 of the scale covers a few roundings.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 3e-2}


def assert_close_to_scale(actual, expected, dtype=torch.float32, what=""):
    """max|actual - expected| <= TOLERANCE[dtype] * max(1, max|expected|)."""
    actual = actual.detach().double()
    expected = expected.detach().double()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    scale = max(1.0, expected.abs().max().item())
    error = (actual - expected).abs().max().item()
    bound = TOLERANCE[dtype] * scale
    assert error <= bound, f"{what}: max abs error {error:.3g} > {TOLERANCE[dtype]:.1g} * {scale:.3g}"
