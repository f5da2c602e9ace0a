"""parallelize_hf_model / shard_hf_batch on tiny random-init Hugging Face models (no download).

Each case builds the model twice from one config object (as ``from_config`` shares it), keeps one as the
single-process reference, parallelises the other and runs the same batches: each data-parallel rank feeds its
rows of the batch. The loss (the whole batch's), the logits (gathered over tp and cp; padding positions
excluded, where HF's own output is arbitrary) and every parameter's gradient must equal the reference's.
Batches: plain, left- and right-padded (labels -100 on the padding), packed documents (position_ids
restarting at each document, HF's packed-sequence convention) and labels -100 inside a row, so that the
data-parallel ranks hold different numbers of target tokens.

CI runs every layout with two (family, tied) pairs; ``TDX_HF_MATRIX=full`` runs every family x layout x tied.
"""

import copy
import itertools
import os

import pytest
import torch
import torch.distributed as dist
import transformers
from torch.distributed.tensor import DTensor

from torchdist_ext.fp8 import (
    CurrentScaling,
    DelayedScaling,
    convert_to_fp8,
    fp8_modules,
    fp8_step,
)
from torchdist_ext.integrations.hf import (
    document_ids_from,
    global_num_items,
    load_hf_checkpoint,
    parallelize_hf_model,
    save_hf_checkpoint,
    shard_hf_batch,
)
from torchdist_ext.parallel import ParallelDims, RMSNorm, balanced_sequence_plan, unshard_sequence
from torchdist_ext.testing import cached_mesh

VOCAB, SEQ = 64, 16
FAMILIES = {  # config class, model class, what the tiny config needs besides the common sizes
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    # Qwen3 adds per-head q/k norms (their gradients are sums over the tp ranks' heads).
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {}),
}


def tiny_config(family: str, tied: bool, fp8: bool = False, layers: int = 2):
    """Heads of 4 features; with ``fp8`` of 16, so that every linear's features stay multiples of 16 at tp 2."""
    config_class, _, extra = FAMILIES[family]
    sizes = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16} if fp8 else \
        {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 8, "num_key_value_heads": 4}
    return config_class(**{**sizes, **extra}, vocab_size=VOCAB, num_hidden_layers=layers, max_position_embeddings=128,
                        tie_word_embeddings=tied, attn_implementation="sdpa")


def build(config) -> torch.nn.Module:
    """The model of ``config`` (the object itself, shared), the same weights on every call and rank."""
    torch.manual_seed(0)
    model = FAMILIES[config.model_type][1](config)
    # Non-trivial norm weights, so that their gradients and the tp reductions over them are exercised.
    with torch.no_grad():
        for module in model.modules():
            if "RMSNorm" in type(module).__name__:
                module.weight.uniform_(0.5, 1.5)
    return model


def tiny_model(family: str, tied: bool) -> torch.nn.Module:
    return build(tiny_config(family, tied))


def batches() -> dict[str, dict]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    left = torch.ones(2, SEQ, dtype=torch.long)
    left[0, :5] = 0
    right = torch.ones(2, SEQ, dtype=torch.long)
    right[1, -4:] = 0
    ignored = ids.clone()
    ignored[0, [2, 3, 7, 8, 9, 12]] = -100
    documents = torch.cat([torch.arange(5), torch.arange(7), torch.arange(4)])
    positions = torch.stack([documents, torch.cat([torch.arange(10), torch.arange(6)])])
    return {
        "plain": {"input_ids": ids, "labels": ids.clone()},
        "left_padded": {"input_ids": ids, "labels": ids.masked_fill(left == 0, -100), "attention_mask": left},
        "right_padded": {"input_ids": ids, "labels": ids.masked_fill(right == 0, -100), "attention_mask": right},
        "packed": {"input_ids": ids, "labels": ids.clone(), "position_ids": positions},
        "ignored_labels": {"input_ids": ids, "labels": ignored},
    }


def meshes(layout: str) -> dict:
    """parallelize_hf_model's mesh arguments for one layout name (hsdp...: one ParallelMeshes, 2 replicas)."""
    n = dist.get_world_size()
    if layout.endswith("_balanced"):
        return {**meshes(layout.removesuffix("_balanced")), "cp_order": "balanced"}
    if layout.startswith("hsdp"):
        cp, tp = (2, 1) if layout.endswith("cp2") else (1, 2)
        built = ParallelDims(world_size=n, dp_replicate=2, cp=cp, tp=tp).build_meshes("cpu")
        return {"meshes": built, "sequence_parallel": tp > 1}
    if layout.startswith("tp"):
        return {"tp_mesh": cached_mesh((n,), ("tp",)), "sequence_parallel": layout.endswith("sp")}
    if layout == "cp2_tp2":
        mesh = cached_mesh((2, n // 2), ("cp", "tp"))
        return {"cp_mesh": mesh["cp"], "tp_mesh": mesh["tp"], "sequence_parallel": True}
    if layout == "cp4_hybrid":
        return {"cp_mesh": cached_mesh((2, n // 2), ("ring", "ulysses")), "cp_method": "hybrid"}
    if layout.startswith("cp"):
        return {"cp_mesh": cached_mesh((n,), ("cp",)), "cp_method": layout.split("_")[1]}
    if layout == "dp2":
        return {"dp_mesh": cached_mesh((n,), ("dp",))}
    if layout == "dp2_cp2":
        mesh = cached_mesh((2, n // 2), ("dp", "cp"))
        return {"dp_mesh": mesh["dp"], "cp_mesh": mesh["cp"]}
    mesh = cached_mesh((2, n // 2), ("dp", "tp"))
    return {"dp_mesh": mesh["dp"], "tp_mesh": mesh["tp"], "sequence_parallel": layout.endswith("sp")}


def axis(kwargs: dict, name: str):
    """The mesh of ``name`` ("dp_mesh", "tp_mesh" or "cp_mesh") in ``meshes(layout)``'s arguments."""
    if "meshes" not in kwargs:
        return kwargs.get(name)
    built = kwargs["meshes"]
    return {"dp_mesh": built.dp, "tp_mesh": built.tp if built.dims.tp > 1 else None, "cp_mesh": built.cp}[name]


def rows(kwargs: dict) -> slice:
    """The batch rows this rank's data-parallel rank feeds (all rows without dp)."""
    dp_mesh = axis(kwargs, "dp_mesh")
    if dp_mesh is None:
        return slice(None)
    per_rank = 2 // dp_mesh.size()
    return slice(dp_mesh.get_local_rank() * per_rank, (dp_mesh.get_local_rank() + 1) * per_rank)


def local_inputs(batch: dict, kwargs: dict) -> dict:
    """What this rank feeds the parallel model: its dp rows, sharded over cp by shard_hf_batch."""
    mine = {key: value[rows(kwargs)] for key, value in batch.items()}
    cp_mesh = axis(kwargs, "cp_mesh")
    return shard_hf_batch(mine, cp_mesh=cp_mesh, order=kwargs.get("cp_order", "zigzag")) if cp_mesh is not None \
        else mine


def balanced_plan(batch: dict, kwargs: dict):
    """The plan shard_hf_batch(order="balanced") makes of this rank's rows (a ring plan over a 1-D cp mesh, a
    hybrid one over a 2-D mesh)."""
    mine = {key: value[rows(kwargs)] for key, value in batch.items()}
    position_ids = mine.get("position_ids", torch.arange(SEQ)[None])
    ids = document_ids_from(position_ids, mine.get("attention_mask"), mine["input_ids"].shape[0])
    cp_mesh = axis(kwargs, "cp_mesh")
    if cp_mesh.ndim == 1:
        return balanced_sequence_plan(ids, cp_mesh.size())
    return balanced_sequence_plan(ids, tuple(cp_mesh.shape), method="hybrid")


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_logits(logits: torch.Tensor, kwargs: dict, batch: dict) -> torch.Tensor:
    """This rank's rows' [rows, seq, vocab] logits from its vocab (tp) and sequence (cp) shard of ``batch``."""
    tp_mesh = axis(kwargs, "tp_mesh")
    if tp_mesh is not None and tp_mesh.size() > 1:
        parts = [torch.empty_like(logits) for _ in range(tp_mesh.size())]
        dist.all_gather(parts, logits.contiguous(), group=tp_mesh.get_group())
        logits = torch.cat(parts, dim=-1)
    if kwargs.get("cp_order") == "balanced":
        logits = balanced_plan(batch, kwargs).unshard(logits, dim=1, cp_mesh=axis(kwargs, "cp_mesh"))
    elif axis(kwargs, "cp_mesh") is not None:
        logits = unshard_sequence(logits, cp_mesh=axis(kwargs, "cp_mesh"), dim=1)
    return logits


def assert_loss_and_logits_match(actual, expected, batch: dict, kwargs: dict, name: str) -> None:
    """The parallel model's loss equals the single-process one's, and its (gathered) logits on this rank's rows
    the reference's at every unpadded position."""
    torch.testing.assert_close(actual.loss, expected.loss, rtol=1e-5, atol=1e-6, msg=f"{name}: loss")
    keep = batch.get("attention_mask", torch.ones(2, SEQ))[rows(kwargs)].bool()
    torch.testing.assert_close(full_logits(actual.logits, kwargs, batch)[keep], expected.logits[rows(kwargs)][keep],
                               rtol=1e-5, atol=1e-5, msg=f"{name}: logits")


def check_matches_single_process(family: str, layout: str, tied: bool, kinds=None, **options):
    kwargs = meshes(layout)
    for name, batch in batches().items():
        if kinds is not None and name not in kinds:
            continue
        config = tiny_config(family, tied)
        reference = build(config)
        model = parallelize_hf_model(build(config), **kwargs, **options)  # (sharing the reference's config)
        expected = reference(**batch, use_cache=False)  # HF applies packed position_ids only without a cache
        expected.loss.backward()
        actual = model(**local_inputs(batch, kwargs))
        actual.loss.backward()
        assert_loss_and_logits_match(actual, expected, batch, kwargs, name)
        parameters = dict(model.named_parameters())
        assert parameters.keys() == dict(reference.named_parameters()).keys()
        for key, want in reference.named_parameters():
            torch.testing.assert_close(full(parameters[key].grad), want.grad, rtol=1e-4, atol=1e-6,
                                       msg=f"{name}: gradient of {key}")
        if tied:
            assert model.lm_head.weight is model.model.embed_tokens.weight
    return True


LAYOUTS = {"tp2": "world2", "tp4": "world4", "tp2_sp": "world2", "cp2_ring": "world2", "cp2_ulysses": "world2",
           "cp4_hybrid": "world4", "dp2": "world2", "dp2_tp2": "world4", "dp2_tp2_sp": "world4",
           "dp2_cp2": "world4", "cp2_tp2": "world4", "hsdp2_tp2_sp": "world4", "hsdp2_cp2": "world4",
           "cp2_ring_balanced": "world2", "cp4_hybrid_balanced": "world4"}


def matrix() -> list[tuple[str, str, bool]]:
    """(family, layout, tied): all with TDX_HF_MATRIX=full; else each layout twice, untied and tied, the
    families taken in turn."""
    families = list(FAMILIES)
    if os.environ.get("TDX_HF_MATRIX") == "full":
        return list(itertools.product(families, LAYOUTS, (False, True)))
    return [(families[(i + shift) % len(families)], layout, tied)
            for i, layout in enumerate(LAYOUTS) for shift, tied in ((0, False), (1, True))]


@pytest.mark.parametrize("family, layout, tied", matrix(),
                         ids=[f"{f}-{layout}-{'tied' if t else 'untied'}" for f, layout, t in matrix()])
def test_matches_single_process(family, layout, tied, request):
    world = request.getfixturevalue(LAYOUTS[layout])
    assert all(world.run(check_matches_single_process, family, layout, tied))


def train_both(reference, model, kwargs: dict, kinds: tuple[str, ...]) -> None:
    """One AdamW step per batch kind: the reference on the whole batch, the parallel model on this rank's part.
    Adam's first step is lr * g / (|g| + eps): an eps well above the gradients' rounding keeps it a
    well-conditioned function of them."""
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-4) for m in (reference, model)]
    for kind in kinds:
        batch = batches()[kind]
        for trained, inputs, optimizer in ((reference, batch, optimizers[0]),
                                           (model, local_inputs(batch, kwargs), optimizers[1])):
            trained(**inputs, use_cache=False).loss.backward()
            optimizer.step()
            optimizer.zero_grad()


def check_optimizer_steps(family: str, layout: str):
    """Three AdamW steps, each on another batch kind whose dp halves hold different numbers of target tokens:
    the reference's parameters."""
    kwargs = meshes(layout)
    config = tiny_config(family, tied=False)
    reference, model = build(config), parallelize_hf_model(build(config), **kwargs)
    train_both(reference, model, kwargs, ("left_padded", "ignored_labels", "right_padded"))
    parameters = dict(model.named_parameters())
    for key, want in reference.named_parameters():
        torch.testing.assert_close(full(parameters[key]).detach(), want.detach(), rtol=1e-4, atol=1e-5, msg=key)
    return True


@pytest.mark.parametrize("family, layout", [("llama", "dp2_tp2_sp"), ("qwen2", "dp2_cp2")])
def test_optimizer_steps_with_unequal_token_counts(world4, family, layout):
    assert all(world4.run(check_optimizer_steps, family, layout))


def check_gradient_accumulation():
    """dp2 x cp2, two micro-batches per step with num_items_in_batch=global_num_items(...): the accumulated
    gradients and the summed losses are the single-process model's over both micro-batches with HF's own
    num_items_in_batch (the window's target tokens)."""
    kwargs = meshes("dp2_cp2")
    config = tiny_config("llama", tied=True)
    reference, model = build(config), parallelize_hf_model(build(config), **kwargs)
    window = [batches()["left_padded"], batches()["ignored_labels"]]
    count = sum(int((b["labels"][:, 1:] != -100).sum()) for b in window)
    expected = sum(reference(**b, num_items_in_batch=count, use_cache=False).loss for b in window)
    expected.backward()
    local = [local_inputs(b, kwargs) for b in window]
    items = global_num_items(model, local)
    assert int(items) == count
    actual = sum(model(**b, num_items_in_batch=items).loss for b in local)
    actual.backward()
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    parameters = dict(model.named_parameters())
    for key, want in reference.named_parameters():
        torch.testing.assert_close(full(parameters[key].grad), want.grad, rtol=1e-4, atol=1e-6, msg=key)
    return True


def test_gradient_accumulation_with_global_num_items(world4):
    assert all(world4.run(check_gradient_accumulation))


def check_leaves_other_models_alone():
    """Models built from one config object share it; parallelising one must not change the other's attention
    (it would run ours, without the inputs hook, and ignore its padding mask)."""
    config = tiny_config("llama", tied=False)
    bystander = build(config)
    batch = batches()["left_padded"]
    before = bystander(**batch).loss
    parallelize_hf_model(build(config), dp_mesh=cached_mesh((dist.get_world_size(),), ("dp",)))
    assert config._attn_implementation == "sdpa"
    torch.testing.assert_close(bystander(**batch).loss, before, rtol=0, atol=0)
    return True


def test_parallelising_leaves_models_sharing_the_config_alone(world2):
    assert all(world2.run(check_leaves_other_models_alone))


def check_generate_data_parallel():
    """A dp-only (FSDP2) model generates what the single-process model does, each rank its own prompt, all
    ranks in step (HF's synced_gpus) although one prompt asks for fewer tokens."""
    config = tiny_config("llama", tied=False)
    reference = build(config)
    model = parallelize_hf_model(build(config), dp_mesh=cached_mesh((dist.get_world_size(),), ("dp",)))
    rank = dist.get_rank()
    prompt = batches()["plain"]["input_ids"][rank : rank + 1, :6]
    new_tokens = 3 + rank
    want = reference.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
    got = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
    assert torch.equal(got, want), (got, want)
    return True


def test_generate_data_parallel(world2):
    assert all(world2.run(check_generate_data_parallel))


def check_compiled_layers(layout: str):
    """compile=True (each decoder layer fullgraph, FSDP2's hooks eager) on an FSDP layout: the single-process
    loss, logits and gradients on a padded batch."""
    torch._dynamo.reset()
    return check_matches_single_process("llama", layout, False, compile=True, kinds=("left_padded",))


@pytest.mark.parametrize("layout", ["dp2_tp2_sp"])
def test_compile_layers_on_fsdp_layouts(world4, layout):
    assert all(world4.run(check_compiled_layers, layout))


def check_fp8(family: str, layout: str, recipe_name: str, all_gather: bool, compiled: bool):
    """fp8=recipe against one process converting the same recipe (every linear but the LM head), on batches
    whose dp halves hold different numbers of target tokens: the loss and every gradient of each step (AdamW,
    fp8_step after each) within FP8_TOLERANCE[recipe], and with the delayed recipe the parameters after
    three steps."""
    torch._dynamo.reset()
    recipe = DelayedScaling() if recipe_name == "delayed" else CurrentScaling()
    loss_tolerance, gradient_tolerance = FP8_TOLERANCE[recipe_name]
    kwargs = meshes(layout)
    config = tiny_config(family, tied=False, fp8=True)
    reference = convert_to_fp8(build(config), recipe, filter_fn=lambda name, module: name != "lm_head")
    model = parallelize_hf_model(build(config), **kwargs, fp8=recipe, fp8_all_gather=all_gather, compile=compiled)
    assert len(fp8_modules(model)) == len(fp8_modules(reference)) == 2 * 7
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-4) for m in (reference, model)]
    kinds = ("left_padded", "ignored_labels", "right_padded") if recipe_name == "delayed" else ("left_padded",)
    for kind in kinds:
        batch = batches()[kind]
        want = reference(**batch, use_cache=False).loss
        want.backward()
        got = model(**local_inputs(batch, kwargs)).loss
        got.backward()
        torch.testing.assert_close(got, want, rtol=loss_tolerance, atol=0, msg=kind)
        parameters = dict(model.named_parameters())
        for key, p in reference.named_parameters():
            difference = (full(parameters[key].grad) - p.grad).abs().max() / p.grad.abs().max()
            assert difference <= gradient_tolerance, (kind, key, difference.item())
        for trained, optimizer in zip((reference, model), optimizers):
            optimizer.step()
            optimizer.zero_grad()
            fp8_step(trained)
    if recipe_name == "delayed":
        parameters = dict(model.named_parameters())
        for key, want in reference.named_parameters():
            torch.testing.assert_close(full(parameters[key]).detach(), want.detach(), rtol=0,
                                       atol=FP8_PARAMETER_ATOL, msg=key)
    return True


# (loss relative, largest gradient difference over the largest gradient element) against one process running
# the same recipe. Delayed scaling (amaxes reduced over every rank) gives the same scales, and the gradients
# the same magnitudes (each rank's backward is its part of the single-process one), so the same fp8 values up
# to the fp32 summation order of the GEMMs' partial sums, which can move an element of a later cast across
# an fp8 rounding boundary (measured here: loss 1.3e-7, gradients 2.5e-7; bounded well above, since another
# CPU's GEMM kernels sum in another order and may flip other elements). Current scaling casts each rank's own
# tensors by their own amax (a dp or cp rank's rows, a tp rank's weight shard): not one process's scales,
# so fp8's own noise (e5m2 gradients keep 2 mantissa bits) shows, measured at dp2 x cp2 on the first step:
# loss 6.4e-4, gradients 0.25 (a mean of means instead of the global count gives 0.87).
FP8_TOLERANCE = {"delayed": (1e-4, 1e-2), "current": (5e-3, 0.5)}
# Parameters after AdamW steps (lr 1e-2) in fp8: an element whose gradient a flipped fp8 rounding moves by a
# little can take an Adam step of up to lr of another size; bounded at one lr per step (measured: within 1e-5).
FP8_PARAMETER_ATOL = 3e-2


@pytest.mark.parametrize("family, layout, recipe, all_gather, compiled", [
    ("llama", "dp2_tp2_sp", "delayed", True, False), ("qwen3", "dp2_cp2", "delayed", False, False),
    ("qwen3", "dp2_cp2", "current", False, False), ("mistral", "dp2", "delayed", False, False),
    ("qwen2", "tp2_sp", "delayed", False, True)],
    ids=["llama-dp2_tp2_sp-delayed-fp8_all_gather", "qwen3-dp2_cp2-delayed", "qwen3-dp2_cp2-current",
         "mistral-dp2-delayed", "qwen2-tp2_sp-delayed-compiled"])
def test_fp8_matches_the_same_recipe_in_one_process(family, layout, recipe, all_gather, compiled, request):
    world = request.getfixturevalue(LAYOUTS[layout])
    assert all(world.run(check_fp8, family, layout, recipe, all_gather, compiled))


def check_pipeline(layout: str, schedule: str, num_microbatches: int, fp8: bool = False, compiled: bool = False):
    """pp2 x tp2 (SP), pp2 x dp2 or pp2 x cp2: model.pipeline.step on padded and packed batches (4 rows of unequal target
    counts), two AdamW steps: the loss, every gradient this rank's stages hold and the parameters after the
    steps are the single-process model's."""
    n = dist.get_world_size()
    if layout == "pp2_tp2_sp":
        mesh = cached_mesh((2, n // 2), ("pp", "tp"))
        kwargs = {"tp_mesh": mesh["tp"], "sequence_parallel": True}
    elif layout.startswith("pp2_cp2"):
        mesh = cached_mesh((2, n // 2), ("pp", "cp"))
        kwargs = {"cp_mesh": mesh["cp"], "cp_order": "balanced" if layout.endswith("balanced") else "zigzag"}
    else:
        mesh = cached_mesh((2, n // 2), ("pp", "dp"))
        kwargs = {"dp_mesh": mesh["dp"]}
    torch._dynamo.reset()
    config = tiny_config("llama", tied=False, fp8=fp8, layers=4)
    reference, model = build(config), build(config)
    if fp8:  # (fp8_step reduces the reference's amaxes over the world's identical copies: one process's)
        reference = convert_to_fp8(reference, DelayedScaling(), filter_fn=lambda name, module: name != "lm_head")
    model = parallelize_hf_model(model, **kwargs, pp_mesh=mesh["pp"], pp_schedule=schedule,
                                 num_microbatches=num_microbatches, fp8=DelayedScaling() if fp8 else None,
                                 compile=compiled)
    parameters = dict(model.named_parameters())
    assert parameters and set(parameters) < set(dict(reference.named_parameters()))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-4) for m in (reference, model)]
    every = batches()
    padded = {key: torch.cat([every["left_padded"][key], every["right_padded"][key]]) for key in every["left_padded"]}
    packed = {key: torch.cat([value, value.flip(0)]) for key, value in every["packed"].items()}
    dp_rows = (lambda rows: rows) if "dp_mesh" not in kwargs else \
        (lambda rows: rows.chunk(2)[kwargs["dp_mesh"].get_local_rank()])
    for batch in (padded, packed):
        want = reference(**batch, use_cache=False).loss
        want.backward()
        got = model.pipeline.step({key: dp_rows(value) for key, value in batch.items()})
        torch.testing.assert_close(got, want, rtol=FP8_TOLERANCE["delayed"][0] if fp8 else 1e-5, atol=1e-6)
        for key, parameter in parameters.items():
            want_grad = dict(reference.named_parameters())[key].grad
            difference = (full(parameter.grad) - want_grad).abs().max() / want_grad.abs().max()
            assert difference <= (FP8_TOLERANCE["delayed"][1] if fp8 else 1e-5), (key, difference.item())
        for trained, optimizer in zip((reference, model), optimizers):
            optimizer.step()
            optimizer.zero_grad()
            fp8_step(trained)
    for key, parameter in parameters.items():
        torch.testing.assert_close(full(parameter).detach(), dict(reference.named_parameters())[key].detach(),
                                   rtol=0 if fp8 else 1e-4, atol=FP8_PARAMETER_ATOL if fp8 else 1e-5, msg=key)
    return True


@pytest.mark.parametrize("layout, schedule, num_microbatches", [
    ("pp2_tp2_sp", "1f1b", 2), ("pp2_dp2", "zb-h1", 2), ("pp2_tp2_sp", "interleaved-1f1b", 2),
    ("pp2_cp2", "gpipe", 4), ("pp2_cp2_balanced", "1f1b", 2)])
def test_pipeline_matches_single_process(world4, layout, schedule, num_microbatches):
    assert all(world4.run(check_pipeline, layout, schedule, num_microbatches))


def test_pipeline_compiled_matches_single_process(world4):
    assert all(world4.run(check_pipeline, "pp2_dp2", "zb-h1", 2, False, True))


@pytest.mark.parametrize("layout", ["pp2_tp2_sp", "pp2_dp2"])
def test_pipeline_in_fp8_matches_the_same_recipe_in_one_process(world4, layout):
    assert all(world4.run(check_pipeline, layout, "1f1b", 2, True))


def check_every_axis(directory: str):
    """README's snippet at pp2 (zb-h1) x dp2 x tp2 (SP): built on the meta device, parallelised with fp8 (delayed, fp8
    all-gather), loaded from a save_pretrained directory, two steps of model.pipeline.step on
    padded rows against one process converting the same recipe (loss, every gradient this rank holds), then
    saved: from_pretrained reads the parallel model's weights exactly."""
    mesh = cached_mesh((2, 2, 2), ("pp", "dp", "tp"))
    config = tiny_config("qwen3", tied=False, fp8=True, layers=4)
    reference = build(config)
    source, target = os.path.join(directory, "source"), os.path.join(directory, "target")
    if dist.get_rank() == 0:
        reference.save_pretrained(source)
    dist.barrier()
    reference = convert_to_fp8(reference, DelayedScaling(), filter_fn=lambda name, module: name != "lm_head")
    torch._dynamo.reset()
    with torch.device("meta"):
        model = FAMILIES["qwen3"][1](copy.deepcopy(config))
    parallelize_hf_model(model, pp_mesh=mesh["pp"], pp_schedule="zb-h1", num_microbatches=2, dp_mesh=mesh["dp"],
                         tp_mesh=mesh["tp"], sequence_parallel=True, fp8=DelayedScaling(), fp8_all_gather=True)
    load_hf_checkpoint(model, source)
    parameters = dict(model.named_parameters())
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-4) for m in (reference, model)]
    every = batches()
    batch = {key: torch.cat([every["left_padded"][key], every["right_padded"][key]]) for key in every["left_padded"]}
    mine = {key: value.chunk(2)[mesh["dp"].get_local_rank()] for key, value in batch.items()}
    for _ in range(2):
        want = reference(**batch, use_cache=False).loss
        want.backward()
        got = model.pipeline.step(mine)
        torch.testing.assert_close(got, want, rtol=FP8_TOLERANCE["delayed"][0], atol=0)
        for key, parameter in parameters.items():
            want_grad = dict(reference.named_parameters())[key].grad
            difference = (full(parameter.grad) - want_grad).abs().max() / want_grad.abs().max()
            assert difference <= FP8_TOLERANCE["delayed"][1], (key, difference.item())
        for trained, optimizer in zip((reference, model), optimizers):
            optimizer.step()
            optimizer.zero_grad()
            fp8_step(trained)
    save_hf_checkpoint(model, target)
    dist.barrier()
    reloaded = dict(FAMILIES["qwen3"][1].from_pretrained(target).named_parameters())
    for key, parameter in parameters.items():
        assert torch.equal(full(parameter).detach(), reloaded[key].detach()), key
    return True


def test_every_axis_at_eight_ranks(world_pool, tmp_path):
    assert all(world_pool.get(8).run(check_every_axis, str(tmp_path)))


def check_hf_round_trip(directory: str):
    """A save_pretrained directory -> a model built on the meta device, parallelised at dp2 x tp2 (SP) ->
    load_hf_checkpoint (the reference's weights exactly) -> 2 AdamW steps (the reference's) ->
    save_hf_checkpoint in several files -> from_pretrained in one process: the parallel model's weights
    exactly."""
    kwargs = meshes("dp2_tp2_sp")
    config = tiny_config("qwen3", tied=True)
    reference = build(config)
    source, target = os.path.join(directory, "source"), os.path.join(directory, "target")
    if dist.get_rank() == 0:
        reference.save_pretrained(source)
    dist.barrier()
    with torch.device("meta"):
        model = FAMILIES["qwen3"][1](copy.deepcopy(config))
    parallelize_hf_model(model, **kwargs)
    load_hf_checkpoint(model, source)
    parameters = dict(model.named_parameters())
    for key, want in reference.named_parameters():
        assert torch.equal(full(parameters[key]).detach(), want.detach()), key
    train_both(reference, model, kwargs, ("left_padded", "packed"))
    save_hf_checkpoint(model, target, max_shard_bytes=20_000)
    assert not os.path.exists(os.path.join(target, "sharded"))
    files = [name for name in os.listdir(target) if name.endswith(".safetensors")]
    assert len(files) > 1 and "model.safetensors.index.json" in os.listdir(target), files
    reloaded = FAMILIES["qwen3"][1].from_pretrained(target)
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    for key, want in reloaded.named_parameters():
        assert torch.equal(full(parameters[key]).detach(), want.detach()), key
        torch.testing.assert_close(want, dict(reference.named_parameters())[key], rtol=1e-4, atol=1e-5, msg=key)
    return True


def test_hf_checkpoint_in_one_process(tmp_path):
    """Without torch.distributed: save_hf_checkpoint of a plain model is what from_pretrained reads, and
    load_hf_checkpoint of it into a model built on the meta device gives the same weights."""
    model = tiny_model("llama", tied=True)
    save_hf_checkpoint(model, tmp_path)
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    with torch.device("meta"):
        loaded = transformers.LlamaForCausalLM(model.config)
    load_hf_checkpoint(loaded, tmp_path)
    for key, want in model.named_parameters():
        assert torch.equal(dict(reloaded.named_parameters())[key], want), key
        assert torch.equal(dict(loaded.named_parameters())[key], want), key
    torch.testing.assert_close(loaded(**batches()["plain"]).loss, model(**batches()["plain"]).loss, rtol=0, atol=0)


def test_hf_checkpoint_round_trip(world4, tmp_path):
    assert all(world4.run(check_hf_round_trip, str(tmp_path)))


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


@pytest.mark.parametrize("sequence_parallel, kind", [(False, "left_padded"), (True, "packed")],
                         ids=["tp-left_padded", "tp_sp-packed"])
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
    elif case == "save_pretrained":
        parallelize_hf_model(model, dp_mesh=cached_mesh((n,), ("dp",)))
        model.save_pretrained("unused")
    elif case == "generate_with_cache":
        parallelize_hf_model(model, dp_mesh=cached_mesh((n,), ("dp",)))
        model.generate(batches()["plain"]["input_ids"][:, :4], max_new_tokens=2, use_cache=True)
    elif case == "fp8_sizes":
        parallelize_hf_model(model, tp_mesh=cached_mesh((n,), ("tp",)), fp8=DelayedScaling())
    elif case == "fp8_all_gather_without_fsdp":
        parallelize_hf_model(model, tp_mesh=cached_mesh((n,), ("tp",)), fp8=DelayedScaling(), fp8_all_gather=True)
    elif case == "fp8_recipe":
        parallelize_hf_model(model, tp_mesh=cached_mesh((n,), ("tp",)), fp8="e4m3")
    elif case in ("pp_tied", "pp_fp8", "pp_fp8_compiled", "pp_forward"):
        pp_mesh = cached_mesh((n,), ("pp",))
        if case == "pp_tied":
            model = tiny_model("llama", tied=True)
        options = {"fp8": DelayedScaling()} if case.startswith("pp_fp8") else {}
        options["compile"] = case == "pp_fp8_compiled"
        parallelize_hf_model(model, pp_mesh=pp_mesh, num_microbatches=2, **options)
        model(**batches()["plain"])
    elif case == "fp8_converted_before":
        convert_to_fp8(model, DelayedScaling())
        parallelize_hf_model(model, tp_mesh=cached_mesh((n,), ("tp",)))
    elif case == "pp_arguments_without_pp_mesh":
        parallelize_hf_model(model, dp_mesh=cached_mesh((n,), ("dp",)), num_microbatches=4)
    elif case == "separate_meshes":
        parallelize_hf_model(model, tp_mesh=cached_mesh((n,), ("tp",)), pp_mesh=cached_mesh((n,), ("pp",)),
                             num_microbatches=2)
    elif case == "pipeline_batches_differ":
        model = tiny_model("llama", tied=False)
        parallelize_hf_model(model, pp_mesh=cached_mesh((n,), ("pp",)), num_microbatches=2)
        ids = batches()["plain"]["input_ids"][: 2 if dist.get_rank() == 0 else 1].repeat(2, 1)
        model.pipeline.step({"input_ids": ids, "labels": ids})
    elif case == "global_num_items_on_one_rank":
        parallelize_hf_model(model, dp_mesh=cached_mesh((n,), ("dp",)))
        plain = batches()["plain"]
        global_num_items(model, [plain] if dist.get_rank() == 0 else [{"input_ids": plain["input_ids"]}])
    elif case == "load_missing_weight":
        from safetensors.torch import load_file, save_file
        directory = f"/tmp/tdx-test-missing-{os.getppid()}"
        if dist.get_rank() == 0:
            tiny_model("llama", tied=False).save_pretrained(directory)
            weights = load_file(f"{directory}/model.safetensors")
            del weights["model.layers.1.mlp.up_proj.weight"]
            save_file(weights, f"{directory}/model.safetensors", metadata={"format": "pt"})
        dist.barrier()
        parallelize_hf_model(model, dp_mesh=cached_mesh((n,), ("dp",)))
        load_hf_checkpoint(model, directory)
    elif case == "global_num_items":
        global_num_items(torch.nn.Linear(2, 2), [batches()["plain"]])
    elif case == "meshes_and_a_mesh":
        parallelize_hf_model(model, meshes=ParallelDims(world_size=n, tp=n).build_meshes("cpu"),
                             tp_mesh=cached_mesh((n,), ("tp",)))
    elif case == "meshes_with_experts":
        parallelize_hf_model(model, meshes=ParallelDims(world_size=n, ep=n).build_meshes("cpu"))
    elif case == "meshes_cp_method":
        parallelize_hf_model(model, meshes=ParallelDims(world_size=n, cp=n).build_meshes("cpu"), cp_method="ulysses")
    elif case == "meshes_type":
        parallelize_hf_model(model, meshes=cached_mesh((n,), ("tp",)))
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
    ("save_pretrained", ValueError, r"save_pretrained would .* call torchdist_ext.integrations.hf.save_hf_checkpoint"),
    ("generate_with_cache", ValueError, r"runs without a KV cache, but got past_key_values; pass use_cache=False"),
    ("fp8_sizes", ValueError, r"fp8: model.layers.0.self_attn.k_proj would run an fp8 GEMM of \[out, in\] = \[8, 32\] "
     r"features on each rank \(its \[16, 32\] split over tp = 2\); fp8 GEMMs need multiples of 16"),
    ("fp8_all_gather_without_fsdp", ValueError, "fp8_all_gather=True needs an fp8 recipe and FSDP2"),
    ("fp8_recipe", TypeError, "fp8 must be a DelayedScaling or CurrentScaling recipe or None, got str"),
    ("pp_tied", ValueError, "tie_word_embeddings=True is not supported with a pp_mesh"),
    ("pp_fp8", ValueError, r"reduces its amaxes over the ranks that hold the same stage, and pp_mesh is its mesh's "
     r"only dim: pass DelayedScaling\(reduce_amax=False\)"),
    ("pp_fp8_compiled", ValueError, r"compile=True with fp8=DelayedScaling\(...\) and a pp_mesh is not supported"),
    ("pp_forward", ValueError, r"a pipelined parallelize_hf_model model trains through model.pipeline.step\(batch\)"),
    ("fp8_converted_before", ValueError, r"the model already has fp8 modules \(layers.0.self_attn.q_proj, ...\), "
     r"which tensor parallelism would replace"),
    ("pp_arguments_without_pp_mesh", ValueError, r"num_microbatches=4, pp_schedule='1f1b' and virtual_stages=1 "
     r"configure pipeline parallelism, which needs a pp_mesh"),
    ("separate_meshes", ValueError, r"tp_mesh \('tp',\), pp_mesh \('pp',\) must be distinct named dims of one "
     r"init_device_mesh mesh"),
    ("pipeline_batches_differ", ValueError, r"HFPipeline.step: the ranks of the group must agree on input_ids"),
    ("global_num_items_on_one_rank", ValueError, "every batch given to global_num_items needs labels"),
    ("load_missing_weight", ValueError, r"load_hf_checkpoint\('/tmp/tdx-test-missing-\d+'\) failed on rank \d: "
     r"RuntimeError: Missing key in checkpoint state_dict: model.layers.1.mlp.up_proj.weight"),
    ("global_num_items", TypeError, "global_num_items takes a model returned by parallelize_hf_model, got Linear"),
    ("batch_key", ValueError, r"batch has keys \['pixel_values'\] that shard_hf_batch does not know how to shard"),
    ("meshes_and_a_mesh", ValueError, r"meshes= gives every mesh; \['tp_mesh'\] must be left None with it"),
    ("meshes_with_experts", ValueError,
     r"meshes has ep=2, but config.model_type=.* has dense FFNs: expert parallelism needs an MoE model"),
    ("meshes_cp_method", ValueError, r"cp_method='ulysses', but meshes' cp=2 with cp_ulysses=1 is 'ring'"),
    ("meshes_type", TypeError, r"meshes must be a ParallelMeshes \(ParallelDims.build_meshes\) or None, got DeviceMesh"),
]


@pytest.mark.parametrize("case, error, message", REFUSALS, ids=[case for case, _, _ in REFUSALS])
def test_refuses_what_it_cannot_honour(world2, case, error, message):
    with pytest.raises(error, match=message):
        world2.run(refuses, case)
    assert world2.alive
