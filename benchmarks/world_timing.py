"""Timing of forward + backward steps on every rank of a world, shared by the multi-rank benchmarks."""

import statistics
import time

import torch.distributed as dist

__all__ = ["median_step_seconds"]


def step(model, x, upstream) -> None:
    """One forward + backward; the gradients are dropped. Reading the output makes torch's DTensor wait
    for its last (asynchronous) collective."""
    (model(x) * upstream).sum().backward()
    for p in model.parameters():
        p.grad = None
    x.grad = None


def median_step_seconds(cases: dict, repeats: int, warmup: int) -> dict[str, float]:
    """Median forward + backward time of each (model, x, upstream). Variants are interleaved within a
    repeat, in alternating order, so that the machine's drift hits them alike."""
    for case in cases.values():
        for _ in range(warmup):
            step(*case)
    times = {name: [] for name in cases}
    for repeat in range(repeats):
        order = list(cases.items())
        for name, case in order if repeat % 2 == 0 else reversed(order):
            dist.barrier()
            start = time.perf_counter()
            step(*case)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}
