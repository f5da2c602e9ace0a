"""parallelize_hf_model / shard_hf_batch on tiny random-init Hugging Face models (no download).

Each case builds the same model on every rank, keeps a single-process copy as the
reference, parallelises the other and runs the same batches: the loss, the logits
(gathered over tp and cp; padding positions excluded, where HF's own output is
arbitrary) and every parameter's gradient must equal the reference's. Batches:
plain, left-padded (labels -100 on the padding) and packed documents (position_ids
restarting at each document, HF's packed-sequence convention).
"""

import copy

import pytest
import torch
import torch.distributed as dist
import transformers
from torch.distributed.tensor import DTensor

from torchdist_ext.integrations.hf import parallelize_hf_model, shard_hf_batch
from torchdist_ext.parallel import RMSNorm, unshard_sequence
from torchdist_ext.testing import cached_mesh

VOCAB, SEQ = 64, 16
FAMILIES = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}
# Qwen3 adds per-head q/k norms (their gradients are sums over the tp ranks' heads).
QWEN3 = (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)


def tiny_model(family: str, tied: bool) -> torch.nn.Module:
    config_class, model_class = QWEN3 if family == "qwen3" else FAMILIES[family]
    extra = {"head_dim": 4} if family == "qwen3" else {}
    config = config_class(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128,
                          tie_word_embeddings=tied, attn_implementation="sdpa", **extra)
    torch.manual_seed(0)
    model = model_class(config)
    # Non-trivial norm weights, so that their gradients and the tp reductions over them are exercised.
    with torch.no_grad():
        for module in model.modules():
            if "RMSNorm" in type(module).__name__:
                module.weight.uniform_(0.5, 1.5)
    return model


def batches() -> dict[str, dict]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[0, :5] = 0
    padded_labels = ids.masked_fill(mask == 0, -100)
    documents = torch.cat([torch.arange(5), torch.arange(7), torch.arange(4)])
    positions = torch.stack([documents, torch.cat([torch.arange(10), torch.arange(6)])])
    return {
        "plain": {"input_ids": ids, "labels": ids.clone()},
        "left_padded": {"input_ids": ids, "labels": padded_labels, "attention_mask": mask},
        "packed": {"input_ids": ids, "labels": ids.clone(), "position_ids": positions},
    }


def meshes(layout: str) -> dict:
    """parallelize_hf_model's mesh arguments for one layout name."""
    n = dist.get_world_size()
    if layout.startswith("tp"):
        return {"tp_mesh": cached_mesh((n,), ("tp",)), "sequence_parallel": layout.endswith("sp")}
    if layout == "cp2_tp2":
        mesh = cached_mesh((2, n // 2), ("cp", "tp"))
        return {"cp_mesh": mesh["cp"], "tp_mesh": mesh["tp"], "sequence_parallel": True}
    if layout == "cp4_hybrid":
        return {"cp_mesh": cached_mesh((2, n // 2), ("ring", "ulysses")), "cp_method": "hybrid"}
    if layout.startswith("cp"):
        return {"cp_mesh": cached_mesh((n,), ("cp",)), "cp_method": layout.split("_")[1]}
    mesh = cached_mesh((2, n // 2), ("dp", "tp"))
    return {"dp_mesh": mesh["dp"], "tp_mesh": mesh["tp"]}


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_logits(logits: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """The [batch, seq, vocab] logits from this rank's vocab (tp) and sequence (cp) shard."""
    tp_mesh = kwargs.get("tp_mesh")
    if tp_mesh is not None and tp_mesh.size() > 1:
        parts = [torch.empty_like(logits) for _ in range(tp_mesh.size())]
        dist.all_gather(parts, logits.contiguous(), group=tp_mesh.get_group())
        logits = torch.cat(parts, dim=-1)
    if kwargs.get("cp_mesh") is not None:
        logits = unshard_sequence(logits, cp_mesh=kwargs["cp_mesh"], dim=1)
    return logits


def check_matches_single_process(family: str, layout: str, tied: bool):
    kwargs = meshes(layout)
    for name, batch in batches().items():
        reference = tiny_model(family, tied)
        model = parallelize_hf_model(copy.deepcopy(reference), **kwargs)
        expected = reference(**batch, use_cache=False)  # HF applies packed position_ids only without a cache
        expected.loss.backward()
        cp_mesh = kwargs.get("cp_mesh")
        inputs = shard_hf_batch(batch, cp_mesh=cp_mesh) if cp_mesh is not None else batch
        actual = model(**inputs)
        actual.loss.backward()
        torch.testing.assert_close(actual.loss, expected.loss, rtol=1e-5, atol=1e-6, msg=f"{name}: loss")
        keep = batch.get("attention_mask", torch.ones(2, SEQ)).bool()
        torch.testing.assert_close(full_logits(actual.logits, kwargs)[keep], expected.logits[keep], rtol=1e-5,
                                   atol=1e-5, msg=f"{name}: logits")
        parameters = dict(model.named_parameters())
        assert parameters.keys() == dict(reference.named_parameters()).keys()
        for key, want in reference.named_parameters():
            torch.testing.assert_close(full(parameters[key].grad), want.grad, rtol=1e-4, atol=1e-6,
                                       msg=f"{name}: gradient of {key}")
        if tied:
            assert model.lm_head.weight is model.model.embed_tokens.weight
    return True


LAYOUTS = {"tp2": "world2", "tp4": "world4", "tp2_sp": "world2", "cp2_ring": "world2", "cp2_ulysses": "world2",
           "cp4_hybrid": "world4", "dp2_tp2": "world4", "cp2_tp2": "world4"}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_matches_single_process(family, layout, tied, request):
    world = request.getfixturevalue(LAYOUTS[layout])
    assert all(world.run(check_matches_single_process, family, layout, tied))


@pytest.mark.parametrize("layout", ["tp2_sp", "cp2_ring"])
def test_qwen3_matches_single_process(world2, layout):
    assert all(world2.run(check_matches_single_process, "qwen3", layout, False))


def check_one_optimizer_step_with_fsdp(family: str):
    """dp=2 x tp=2: each dp rank trains on its half of the batch; one AdamW step gives the reference's
    parameters (both halves hold the same number of target tokens, so the mean of means is the mean)."""
    mesh = cached_mesh((2, 2), ("dp", "tp"))
    batch = batches()["plain"]
    reference = tiny_model(family, tied=False)
    model = parallelize_hf_model(copy.deepcopy(reference), dp_mesh=mesh["dp"], tp_mesh=mesh["tp"],
                                 sequence_parallel=True)
    half = {key: value.chunk(2)[mesh["dp"].get_local_rank()] for key, value in batch.items()}
    for trained, inputs in ((reference, batch), (model, half)):
        # Adam's first step is lr * g / (|g| + eps): an eps well above the gradients' rounding keeps it a
        # well-conditioned function of them.
        optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-2, eps=1e-4)
        trained(**inputs, use_cache=False).loss.backward()
        optimizer.step()
    parameters = dict(model.named_parameters())
    for key, want in reference.named_parameters():
        torch.testing.assert_close(full(parameters[key]).detach(), want.detach(), rtol=1e-4, atol=1e-5, msg=key)
    return True


@pytest.mark.parametrize("family", list(FAMILIES))
def test_one_optimizer_step_with_fsdp(world4, family):
    assert all(world4.run(check_one_optimizer_step_with_fsdp, family))


def check_compiled(sequence_parallel: bool, kind: str):
    """torch.compile(fullgraph=True) of the tp (and tp + sp) model on one kind of batch: the eager parallel loss
    and gradients (one kind per call: each compile stays well inside the world's time limit)."""
    torch._dynamo.reset()
    tp_mesh = cached_mesh((dist.get_world_size(),), ("tp",))
    eager = parallelize_hf_model(tiny_model("llama", tied=True), tp_mesh=tp_mesh, sequence_parallel=sequence_parallel)
    compiled_model = parallelize_hf_model(tiny_model("llama", tied=True), tp_mesh=tp_mesh,
                                          sequence_parallel=sequence_parallel)
    compiled = torch.compile(compiled_model, fullgraph=True)
    batch = batches()[kind]
    want = eager(**batch).loss
    want.backward()
    got = compiled(**batch).loss
    got.backward()
    torch.testing.assert_close(got, want)
    for (key, p), q in zip(eager.named_parameters(), compiled_model.parameters()):
        torch.testing.assert_close(full(q.grad), full(p.grad), msg=key)
    return True


@pytest.mark.parametrize("kind", ["plain", "left_padded", "packed"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
def test_compile_fullgraph(world2, sequence_parallel, kind):
    assert all(world2.run(check_compiled, sequence_parallel, kind))


def test_from_rms_norm_takes_hf_norms(world2):
    assert all(world2.run(check_from_rms_norm))


def check_from_rms_norm():
    hf_norm = transformers.models.llama.modeling_llama.LlamaRMSNorm(8, eps=1e-5)
    with torch.no_grad():
        hf_norm.weight.uniform_(0.5, 1.5)
    norm = RMSNorm.from_rms_norm(hf_norm, tp_mesh=cached_mesh((dist.get_world_size(),), ("tp",)))
    assert norm.eps == 1e-5
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(norm(x), hf_norm(x))
    tp_mesh = cached_mesh((dist.get_world_size(),), ("tp",))
    with pytest.raises(TypeError, match=r"norm must be an RMSNorm \(no mean subtraction, no bias\), got LayerNorm"):
        RMSNorm.from_rms_norm(torch.nn.LayerNorm(8), tp_mesh=tp_mesh)
    with pytest.raises(TypeError, match="RMSNorm-like module with a 1-D weight and a float eps or variance_epsilon"):
        RMSNorm.from_rms_norm(torch.nn.Identity(), tp_mesh=tp_mesh)
    gemma_norm = transformers.models.gemma.modeling_gemma.GemmaRMSNorm(8)  # scales by 1 + weight
    for device in ("cpu", "meta"):
        with pytest.raises(TypeError, match=r"GemmaRMSNorm\) does not compute weight \* x / sqrt\(mean\(x\^2\) \+ eps\)"):
            RMSNorm.from_rms_norm(gemma_norm.to(device), tp_mesh=tp_mesh)
    return True


def refuses(case: str):
    n = dist.get_world_size()
    model = tiny_model("llama", tied=False)
    if case == "dropout":
        model.config.attention_dropout = 0.1
        parallelize_hf_model(model, tp_mesh=cached_mesh((n,), ("tp",)))
    elif case == "heads":
        model.config.num_key_value_heads = 3
        parallelize_hf_model(model, tp_mesh=cached_mesh((n,), ("tp",)))
    elif case == "sp_without_tp":
        parallelize_hf_model(model, sequence_parallel=True)
    elif case == "cp_method":
        parallelize_hf_model(model, cp_mesh=cached_mesh((n,), ("cp",)), cp_method="striped")
    elif case == "not_llama":
        parallelize_hf_model(torch.nn.Linear(2, 2), tp_mesh=cached_mesh((n,), ("tp",)))
    elif case == "cp_unsharded_batch":
        parallelize_hf_model(model, cp_mesh=cached_mesh((n,), ("cp",)))
        model(**batches()["plain"])
    elif case == "four_d_mask":
        parallelize_hf_model(model, tp_mesh=cached_mesh((n,), ("tp",)))
        model(input_ids=batches()["plain"]["input_ids"], attention_mask=torch.ones(2, 1, SEQ, SEQ))
    elif case == "output_attentions":
        parallelize_hf_model(model, tp_mesh=cached_mesh((n,), ("tp",)))
        model(input_ids=batches()["plain"]["input_ids"], output_attentions=True)
    elif case == "gemma":
        config = transformers.GemmaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=8)
        parallelize_hf_model(transformers.GemmaForCausalLM(config), tp_mesh=cached_mesh((n,), ("tp",)))
    elif case == "sliding_window":
        config = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
        parallelize_hf_model(transformers.MistralForCausalLM(config), tp_mesh=cached_mesh((n,), ("tp",)),
                             sequence_parallel=True)
    elif case == "order_mismatch":
        cp_mesh = cached_mesh((n,), ("cp",))
        parallelize_hf_model(model, cp_mesh=cp_mesh, cp_order="contiguous")
        model(**shard_hf_batch(batches()["plain"], cp_mesh=cp_mesh))
    elif case == "batch_shape":
        shard_hf_batch({"input_ids": torch.zeros(2, SEQ, dtype=torch.long), "attention_mask": torch.ones(1, SEQ)},
                       cp_mesh=cached_mesh((n,), ("cp",)))
    elif case == "twice":
        cp_mesh = cached_mesh((n,), ("cp",))
        parallelize_hf_model(model, cp_mesh=cp_mesh)
        parallelize_hf_model(model, cp_mesh=cp_mesh)
    elif case == "generate":
        parallelize_hf_model(model, tp_mesh=cached_mesh((n,), ("tp",)))
        model.generate(batches()["plain"]["input_ids"], max_new_tokens=2, use_cache=False)
    elif case == "batch_key":
        shard_hf_batch({"input_ids": torch.zeros(2, SEQ, dtype=torch.long), "pixel_values": 0},
                       cp_mesh=cached_mesh((n,), ("cp",)))


REFUSALS = [
    ("dropout", ValueError, r"config.attention_dropout=0.1 is not supported"),
    ("heads", ValueError, r"config.num_key_value_heads=3 must be divisible by the size of tp_mesh \(2\)"),
    ("sp_without_tp", ValueError, "sequence_parallel=True needs a tp_mesh"),
    ("cp_method", ValueError, "cp_method must be one of .* got 'striped'"),
    ("not_llama", TypeError, "parallelize_hf_model takes a Llama-family causal LM"),
    ("cp_unsharded_batch", ValueError, r"under context parallelism the model takes this rank's part .* shard_hf_batch"),
    ("four_d_mask", ValueError, r"attention_mask must be the 2-D \[batch, seq\] padding mask, got shape \(2, 1, 16, 16\)"),
    ("output_attentions", ValueError, "output_attentions=True is not supported"),
    ("gemma", ValueError, r"config.model_type='gemma' is not one parallelize_hf_model knows"),
    ("sliding_window", ValueError, r"sliding-window attention \(layers \[0, 1\], window 8\) is not supported"),
    ("order_mismatch", ValueError, r"sharded with shard_hf_batch\(order='zigzag'\) but the model was parallelised "
     r"with cp_order='contiguous'"),
    ("batch_shape", ValueError, r"batch\['attention_mask'\] has shape \(1, 16\); it must be \[batch, seq\] = \[2, 16\]"),
    ("twice", ValueError, "this model was already parallelised by parallelize_hf_model"),
    ("generate", ValueError, "generate is not supported on a tensor- or context-parallel parallelize_hf_model model"),
    ("batch_key", ValueError, r"batch has keys \['pixel_values'\] that shard_hf_batch does not know how to shard"),
]


@pytest.mark.parametrize("case, error, message", REFUSALS, ids=[case for case, _, _ in REFUSALS])
def test_refuses_what_it_cannot_honour(world2, case, error, message):
    with pytest.raises(error, match=message):
        world2.run(refuses, case)
    assert world2.alive
