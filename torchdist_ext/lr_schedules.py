"""Learning-rate schedules as functions of the step: warmup then cosine, and warmup-stable-decay (WSD).

    scheduler = lr_scheduler(optimizer, WarmupStableDecay(total_steps=1000, warmup_steps=100, decay_steps=200))
    ...; optimizer.step(); scheduler.step()
    lr_scheduler(optimizer, schedule, step=resumed_step)   # after loading a checkpoint: the lr of that step
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["DECAY_SHAPES", "WarmupCosine", "WarmupStableDecay", "lr_scheduler"]

DECAY_SHAPES = ("linear", "cosine", "1-sqrt")


def _warmup(step: int, warmup_steps: int) -> float:
    """Linear warmup: (step + 1) / (warmup_steps + 1) for step < warmup_steps (the first step trains), 1 after."""
    return (step + 1) / (warmup_steps + 1) if step < warmup_steps else 1.0


def _check_steps(owner: str, **steps: int) -> None:
    for name, value in steps.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{owner}: {name} must be an int, got {type(value).__name__} {value!r}")
        least = 1 if name == "total_steps" else 0
        if value < least:
            raise ValueError(f"{owner}: {name}={value} must be at least {least}")


def _check_ratio(owner: str, min_ratio: float) -> None:
    if isinstance(min_ratio, bool) or not isinstance(min_ratio, (int, float)):
        raise TypeError(f"{owner}: min_ratio must be a number, got {type(min_ratio).__name__} {min_ratio!r}")
    if not 0 <= min_ratio <= 1:
        raise ValueError(f"{owner}: min_ratio={min_ratio!r} must be a number in [0, 1] (the last lr over the peak)")


@dataclass(frozen=True)
class WarmupCosine:
    """The lr factor of a step: linear warmup over ``warmup_steps`` (``(s + 1) / (warmup_steps + 1)``), then a
    cosine from 1 down to ``min_ratio`` at ``total_steps``: ``min_ratio + (1 - min_ratio) (1 + cos(pi p)) / 2``,
    ``p = (s - warmup_steps) / (total_steps - warmup_steps)``; ``min_ratio`` from ``total_steps`` on (a run of
    ``total_steps`` steps trains steps 0 to total_steps - 1, the last one step short of the minimum)."""

    total_steps: int
    warmup_steps: int = 0
    min_ratio: float = 0.1

    def __post_init__(self):
        _check_steps("WarmupCosine", total_steps=self.total_steps, warmup_steps=self.warmup_steps)
        if self.warmup_steps >= self.total_steps:
            raise ValueError(f"WarmupCosine: warmup_steps={self.warmup_steps} must be below total_steps="
                             f"{self.total_steps}")
        _check_ratio("WarmupCosine", self.min_ratio)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return _warmup(step, self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class WarmupStableDecay:
    """WSD (MiniCPM, Hu et al. 2024; Hägele et al. 2024): linear warmup over ``warmup_steps`` as
    ``WarmupCosine``'s, the peak held, then over the last ``decay_steps`` before ``total_steps`` a decay to
    ``min_ratio``: ``min_ratio + (1 - min_ratio) f(p)``, ``p`` the decay's progress in [0, 1] and ``f`` by
    ``decay``: "linear" ``1 - p``, "cosine" ``(1 + cos(pi p)) / 2``, "1-sqrt" ``1 - sqrt(p)``."""

    total_steps: int
    decay_steps: int
    warmup_steps: int = 0
    min_ratio: float = 0.0
    decay: str = "linear"

    def __post_init__(self):
        _check_steps("WarmupStableDecay", total_steps=self.total_steps, decay_steps=self.decay_steps,
                     warmup_steps=self.warmup_steps)
        if self.warmup_steps + self.decay_steps > self.total_steps:
            raise ValueError(f"WarmupStableDecay: warmup_steps + decay_steps = {self.warmup_steps} + "
                             f"{self.decay_steps} must not exceed total_steps={self.total_steps}")
        _check_ratio("WarmupStableDecay", self.min_ratio)
        if self.decay not in DECAY_SHAPES:
            raise ValueError(f"WarmupStableDecay: decay={self.decay!r} must be one of {DECAY_SHAPES}")

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return _warmup(step, self.warmup_steps)
        decay_start = self.total_steps - self.decay_steps
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start) / self.decay_steps) if self.decay_steps else 1.0
        shape = {"linear": 1 - progress, "cosine": 0.5 * (1 + math.cos(math.pi * progress)),
                 "1-sqrt": 1 - math.sqrt(progress)}[self.decay]
        return self.min_ratio + (1 - self.min_ratio) * shape


def lr_scheduler(optimizer: torch.optim.Optimizer, schedule, *, step: int = 0) -> LambdaLR:
    """A ``LambdaLR`` setting each param group's lr to its base lr x ``schedule(s)`` at step ``s``, starting at
    ``step`` (a resumed run's: create it after loading the optimizer's state; the base lr is the group's
    ``initial_lr`` when the state holds one, else its lr). Call its ``step()`` after each ``optimizer.step()``."""
    if not callable(schedule):
        raise TypeError(f"lr_scheduler: schedule must be callable (step -> lr factor), got {type(schedule).__name__}")
    _check_steps("lr_scheduler", step=step)
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])
    return LambdaLR(optimizer, schedule, last_epoch=step - 1)
