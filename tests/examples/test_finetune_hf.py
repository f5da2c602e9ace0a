"""examples/finetune_hf.py on N ranks: a Hugging Face Llama trains at dp x cp x tp and --check
matches one process to 1e-4 relative loss; --save-hf writes what from_pretrained reads. (compile=True is
tested in tests/integrations/test_hf.py.)"""

import pytest
import transformers

from tests.examples.test_train_llama import (
    ROOT,
    largest_relative_difference,
    run_main_job,
)


@pytest.mark.parametrize(
    "flags",
    [("--tp", "2"), ("--cp", "2", "--tp", "2", "--packed"),
     ("--cp", "4", "--cp-method", "ulysses", "--packed")],
    ids=["dp2-tp2-sp", "cp2-ring-tp2-sp-packed", "cp4-ulysses-packed"],
)
def test_matches_single_process(flags, tmp_path):
    output = run_main_job("--steps", "3", *flags, "--save-hf", str(tmp_path), script=ROOT / "examples" / "finetune_hf.py")
    assert "tokens/s" in output
    assert largest_relative_difference(output) <= 1e-4
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
