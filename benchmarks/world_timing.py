"""Timing of calls (forward + backward steps, collectives) on every rank of a world, shared by the multi-rank
benchmarks."""

import statistics
import time

import torch.distributed as dist

__all__ = ["median_call_seconds", "median_step_seconds"]


def step(model, x, upstream) -> None:
    """One forward + backward; the gradients are dropped. Reading the output makes torch's DTensor wait
    for its last (asynchronous) collective."""
    (model(x) * upstream).sum().backward()
    for p in model.parameters():
        p.grad = None
    x.grad = None


def median_call_seconds(calls: dict, repeats: int, warmup: int) -> dict[str, float]:
    """This rank's median time of each ``call()``. Variants are interleaved within a repeat, in alternating
    order, so that the machine's drift hits them alike, and every rank starts each call together (a barrier)."""
    for call in calls.values():
        for _ in range(warmup):
            call()
    times = {name: [] for name in calls}
    for repeat in range(repeats):
        order = list(calls.items())
        for name, call in order if repeat % 2 == 0 else reversed(order):
            dist.barrier()
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def median_step_seconds(cases: dict, repeats: int, warmup: int) -> dict[str, float]:
    """Median forward + backward time of each (model, x, upstream), timed as ``median_call_seconds``."""
    return median_call_seconds({name: (lambda case=case: step(*case)) for name, case in cases.items()}, repeats,
                               warmup)
