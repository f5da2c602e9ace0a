"""The learning-rate schedules against their closed forms, and a scheduler resumed at a step against the
uninterrupted one."""

import math

import pytest
import torch

from torchdist_ext.lr_schedules import WarmupCosine, WarmupStableDecay, lr_scheduler


def test_warmup_cosine_closed_form():
    schedule = WarmupCosine(total_steps=10, warmup_steps=2, min_ratio=0.1)
    assert [schedule(s) for s in (0, 1, 2)] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert schedule(6) == pytest.approx(0.1 + 0.9 * 0.5)                     # half way down the cosine
    assert schedule(4) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert schedule(10) == schedule(25) == pytest.approx(0.1)


@pytest.mark.parametrize("decay, quarter", [
    ("linear", 0.75), ("cosine", 0.5 * (1 + math.cos(math.pi / 4))), ("1-sqrt", 0.5),
])
def test_warmup_stable_decay_closed_form(decay, quarter):
    schedule = WarmupStableDecay(total_steps=10, warmup_steps=2, decay_steps=4, min_ratio=0.2, decay=decay)
    assert [schedule(s) for s in range(7)] == pytest.approx([1 / 3, 2 / 3, 1, 1, 1, 1, 1])
    assert schedule(7) == pytest.approx(0.2 + 0.8 * quarter)
    assert schedule(10) == schedule(12) == pytest.approx(0.2)


def test_no_warmup_starts_at_the_peak():
    assert WarmupCosine(total_steps=4, min_ratio=0.0)(0) == 1.0
    assert WarmupStableDecay(total_steps=4, decay_steps=0)(3) == 1.0


def lrs(optimizer, scheduler, steps: int) -> list[float]:
    seen = []
    for _ in range(steps):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return seen


def test_a_resumed_scheduler_continues_the_uninterrupted_one():
    """Resumed at step 5 from the optimizer's state_dict (which holds the base lr as initial_lr), the lrs of
    steps 5.. are the uninterrupted run's: base x schedule(step)."""
    schedule = WarmupStableDecay(total_steps=12, warmup_steps=3, decay_steps=5, decay="1-sqrt")
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([param], lr=0.5)
    whole = lrs(optimizer, lr_scheduler(optimizer, schedule), 12)
    assert whole == pytest.approx([0.5 * schedule(s) for s in range(12)])

    first = torch.optim.SGD([param], lr=0.5)
    lrs(first, lr_scheduler(first, schedule), 5)
    resumed = torch.optim.SGD([param], lr=0.5)
    resumed.load_state_dict(first.state_dict())            # its lr is step 5's, its initial_lr the base
    assert lrs(resumed, lr_scheduler(resumed, schedule, step=5), 7) == pytest.approx(whole[5:])


@pytest.mark.parametrize("call, error, message", [
    (lambda: WarmupCosine(total_steps=0), ValueError, "WarmupCosine: total_steps=0 must be at least 1"),
    (lambda: WarmupCosine(total_steps=4, warmup_steps=4), ValueError, "warmup_steps=4 must be below total_steps=4"),
    (lambda: WarmupCosine(total_steps=4, warmup_steps=1.5), TypeError, "warmup_steps must be an int, got float"),
    (lambda: WarmupCosine(total_steps=4, min_ratio=1.5), ValueError, r"min_ratio=1.5 must be a number in \[0, 1\]"),
    (lambda: WarmupCosine(total_steps=4, min_ratio="0.1"), TypeError, "min_ratio must be a number, got str '0.1'"),
    (lambda: WarmupStableDecay(total_steps=4, decay_steps=3, warmup_steps=2), ValueError,
     "warmup_steps \\+ decay_steps = 2 \\+ 3 must not exceed total_steps=4"),
    (lambda: WarmupStableDecay(total_steps=4, decay_steps=-1), ValueError, "decay_steps=-1 must be at least 0"),
    (lambda: WarmupStableDecay(total_steps=4, decay_steps=2, decay="exp"), ValueError, "decay='exp' must be one of"),
    (lambda: lr_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), 0.5), TypeError,
     "schedule must be callable"),
    (lambda: lr_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), WarmupCosine(4), step=-1),
     ValueError, "lr_scheduler: step=-1 must be at least 0"),
])
def test_bad_arguments_are_refused_naming_them(call, error, message):
    with pytest.raises(error, match=message):
        call()
