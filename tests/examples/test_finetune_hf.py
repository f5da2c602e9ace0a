"""examples/finetune_hf.py on N ranks: a Hugging Face Llama trains at dp x cp x tp and --check
matches one process to 1e-4 relative loss; --save-hf writes what from_pretrained reads; --hf trains a saved
model (a dense one read slice by slice, an MoE one with expert parallelism). (compile=True is tested in
tests/integrations/test_hf.py.)"""

import pytest
import torch
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


def save_tiny(family: str, path) -> None:
    """A 2-layer model of the byte vocabulary (MoE: 8 experts, top 2, non-trivial expert weights), saved."""
    sizes = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256)
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**sizes, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".mlp." in name:
                param.normal_(0, 0.1)
    model.save_pretrained(path)


@pytest.mark.parametrize("family, flags", [("qwen3_moe", ("--ep", "2")), ("llama", ("--tp", "2"))],
                         ids=["qwen3-moe-dp2-ep2", "llama-tp2-sp"])
def test_trains_a_saved_model(family, flags, tmp_path):
    save_tiny(family, tmp_path / "model")
    output = run_main_job("--steps", "3", "--seq", "32", "--batch", "4", "--hf", str(tmp_path / "model"), *flags,
                          processes=2, script=ROOT / "examples" / "finetune_hf.py")
    assert largest_relative_difference(output) <= 1e-4
