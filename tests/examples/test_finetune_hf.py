"""examples/finetune_hf.py under torchrun: a Hugging Face Llama trains at dp x cp x tp and --check
matches one process to 1e-4 relative loss."""

import pytest

from tests.examples.test_train_llama import ROOT, largest_relative_difference, run_main_job


@pytest.mark.parametrize(
    "flags",
    [("--tp", "2"), ("--cp", "2", "--tp", "2", "--packed"), ("--cp", "4", "--cp-method", "ulysses", "--packed")],
    ids=["dp2-tp2-sp", "cp2-ring-tp2-sp-packed", "cp4-ulysses-packed"],
)
def test_matches_single_process(flags):
    output = run_main_job("--steps", "3", *flags, script=ROOT / "examples" / "finetune_hf.py")
    assert "tokens/s" in output
    assert largest_relative_difference(output) <= 1e-4
