"""convert_to_fp8 on ranks that disagree (recipes, the modules their filter_fn picks) refuses on every rank,
before fp8_step's one all-reduce would cross mismatched buffers or run on one rank alone."""

import pytest
import torch.distributed as dist
from torch import nn

from torchdist_ext.fp8 import CurrentScaling, DelayedScaling, convert_to_fp8


def convert_per_rank(case: str) -> str:
    """Rank 1 converts differently from rank 0; returns what this rank raised."""
    rank = dist.get_rank()
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))
    recipe, filter_fn = DelayedScaling(), None
    if case == "reduce_amax" and rank == 1:
        recipe = DelayedScaling(reduce_amax=False)
    elif case == "delayed_and_current" and rank == 1:
        recipe = CurrentScaling()
    elif case == "format" and rank == 1:
        recipe = DelayedScaling(fp8_format="e4m3")
    elif case == "filter_fn" and rank == 1:
        filter_fn = lambda name, module: name == "0"  # noqa: E731
    try:
        convert_to_fp8(model, recipe, filter_fn=filter_fn)
    except ValueError as error:
        return str(error)
    return "converted"


@pytest.mark.parametrize("case, field", [("reduce_amax", "recipe"), ("delayed_and_current", "recipe"),
                                         ("format", "recipe"), ("filter_fn", "converted modules")])
def test_ranks_that_convert_differently_are_refused_on_every_rank(world2, case, field):
    for rank, text in enumerate(world2.run(convert_per_rank, case)):
        assert text.startswith(f"convert_to_fp8: the ranks of the group must agree on {field}: rank {rank} has "), text
    assert world2.alive


def test_ranks_that_agree_convert(world2):
    assert world2.run(convert_per_rank, "none") == ["converted", "converted"]


def step_per_rank(case: str) -> str:
    """Rank 1's Fp8Linear built with another recipe than rank 0's (``Fp8Linear.from_linear`` takes one per
    call, with no check across ranks); returns what fp8_step raised on this rank."""
    from torchdist_ext.fp8 import Fp8Linear, fp8_step

    recipe = DelayedScaling()
    if dist.get_rank() == 1:
        recipe = {"reduce_amax": DelayedScaling(reduce_amax=False), "delayed_and_current": CurrentScaling()}[case]
    layer = Fp8Linear.from_linear(nn.Linear(16, 16), recipe)
    try:
        fp8_step(layer)
    except ValueError as error:
        return str(error)
    return "stepped"


@pytest.mark.parametrize("case", ["reduce_amax", "delayed_and_current"])
def test_fp8_step_refuses_ranks_whose_modules_have_other_recipes_on_every_rank(world2, case):
    """Before the fix rank 0 all-reduced its amaxes alone until the collective's timeout."""
    for rank, text in enumerate(world2.run(step_per_rank, case)):
        assert text.startswith(f"fp8_step: the ranks of the group must agree on recipes: rank {rank} has "), text
    assert world2.alive
