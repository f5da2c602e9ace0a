"""Timing on one device, shared by the single-device kernel benchmarks."""

import statistics
import time

import torch

__all__ = ["median_seconds", "copy_bandwidth"]


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_seconds(fn, device: str, repeats: int, warmup: int = 3) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after ``warmup``, the device synchronised around each."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a large same-device copy (one read plus one write of every byte)."""
    src = torch.empty(256 * 2**20 if device == "cuda" else 64 * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / median_seconds(lambda: dst.copy_(src), device, repeats=10)
