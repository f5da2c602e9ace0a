"""The examples' ``--check`` and their exit: a run's losses against the same run in one process.

    status = check_losses(losses, lambda: train_single_process(...), tolerance=1e-5)
    exit_now(status)
"""

import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

import torchdist_ext


def check_losses(losses: list[float], reference: Callable[[], list[float]], tolerance: float) -> int:
    """Rank 0 runs ``reference()`` (the same steps in one process) and compares each step's loss with this
    run's, relative to the reference; every rank returns the verdict (0: every step within ``tolerance``, 1:
    not), agreed in one all-reduce so that all ranks exit alike. Collective over the default group."""
    status = 0
    if dist.get_rank() == 0:
        # Alone while the others wait below: no call of the reference has peers to agree with.
        previous = torchdist_ext.set_agreement_checks("off")
        try:
            expected = reference()
        finally:
            torchdist_ext.set_agreement_checks(previous)
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, expected))
        print(f"check: single-process losses {expected[0]:.4f} -> {expected[-1]:.4f}; largest relative loss "
              f"difference over {len(losses)} steps: {worst:.2e} (tolerance {tolerance:.0e})", flush=True)
        status = 0 if worst <= tolerance else 1
    verdict = torch.tensor([status])
    dist.all_reduce(verdict)
    return int(verdict.item() != 0)


def exit_now(status: int) -> None:
    """Leaves without the interpreter's shutdown, once everything is reported and the process group destroyed.

    gloo's worker threads outlive the process group's Python handle: a collective returns once its work is
    complete, and the worker drops the work (and with it the last reference to a Python-owned tensor, which
    takes the GIL) a moment later. A thread that asks for the GIL during shutdown is ended by pthread_exit,
    which unwinds through a noexcept C++ frame and aborts the process ("terminate called without an active
    exception") in about one run in 30-50 on an oversubscribed machine."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
