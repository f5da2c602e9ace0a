"""FSDP2 all-gathering fp8 weights (``convert_to_fp8(..., fp8_all_gather=True)``): training is bit-for-bit the
training with full-precision gathers (the gathered bytes equal the cast of the gathered weight), on
dp=2 x tp=2 with sequence parallelism and on uneven and empty shards; the gathers carry one byte per weight
element (half of bf16's); a distributed checkpoint restores the model; bad arguments are refused."""

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from tests.fp8.test_fsdp_checkpoint import fp8_fsdp_model, local_inputs
from tests.parallel.test_fsdp import loss_fn
from torchdist_ext.fp8 import CurrentScaling, DelayedScaling, convert_to_fp8, fp8_modules, fp8_step
from torchdist_ext.fp8.fsdp import Fp8AllGatherWeight, GatheredFp8Weight


def train(model, x, steps: int) -> list[torch.Tensor]:
    """Losses of ``steps`` SGD steps, fp8_step after each (the scales move, so later steps use them)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        loss = loss_fn(model(x * (1.0 + step)))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        fp8_step(model)
        losses.append(loss.detach())
    return losses


def local_state(model) -> list[torch.Tensor]:
    """Every parameter's local shard and every fp8 history and scale, as plain tensors."""
    def plain(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return (t._tensor if isinstance(t, Fp8AllGatherWeight) else t).detach().clone()
    fp8_state = [t.clone() for m in fp8_modules(model) for t in (m.amax_history, m.scale)]
    return [plain(p) for p in model.parameters()] + fp8_state


def tp_training_matches(path):
    results = {}
    for gather in (False, True):
        model, mesh = fp8_fsdp_model(gather)
        losses = train(model, local_inputs(mesh), steps=3)
        results[gather] = (losses, local_state(model))
    (losses, state), (gathered_losses, gathered_state) = results[False], results[True]
    same = all(torch.equal(a, b) for a, b in zip(losses + state, gathered_losses + gathered_state))

    trained = [(m.amax_history.clone(), m.scale.clone()) for m in fp8_modules(model)]
    x = local_inputs(mesh)
    dcp.save(get_model_state_dict(model), checkpoint_id=path)
    with torch.no_grad():
        expected = model(x)
    fresh, _ = fp8_fsdp_model(True)
    loaded = get_model_state_dict(fresh)
    dcp.load(loaded, checkpoint_id=path)
    set_model_state_dict(fresh, loaded)
    restored = all(torch.equal(m.amax_history, h) and torch.equal(m.scale, s)
                   for (h, s), m in zip(trained, fp8_modules(fresh)))
    with torch.no_grad():
        restored = restored and torch.equal(fresh(x), expected)
    return same, restored, [loss.item() for loss in gathered_losses]


def test_fp8_all_gather_trains_as_full_precision_gathers_under_tp_and_restores(world4, tmp_path):
    outcomes = world4.run(tp_training_matches, str(tmp_path / "ckpt"))
    for same, restored, losses in outcomes:
        assert same, "fp8 all-gather changed the losses, the parameters or the fp8 state"
        assert restored, "a checkpoint of the fp8 all-gather model restored differently"
        assert all(torch.isfinite(torch.tensor(losses)))


# Weights [16, 32], [48, 16], [32, 48] on 5 FSDP ranks: torch.chunk gives 4 rows to ranks 0-3 and none to
# rank 4 (an empty shard), 10/10/10/10/8 (uneven) and 7/7/7/7/4.
UNEVEN_FEATURES = [(32, 16), (16, 48), (48, 32)]


def uneven_model(fp8_all_gather: bool, mp_policy: MixedPrecisionPolicy):
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(i, o, bias=False) for i, o in UNEVEN_FEATURES))
    convert_to_fp8(model, DelayedScaling(amax_history_len=4), fp8_all_gather=fp8_all_gather)
    for layer in model:
        fully_shard(layer, mp_policy=mp_policy)
    return fully_shard(model, mp_policy=mp_policy)


def all_gather_bytes(fn) -> int:
    """Bytes of the all-gather inputs FSDP2 passes to torch.distributed while fn() runs on this rank."""
    seen, original = [], dist.all_gather_single

    def counted(output, input, *args, **kwargs):
        seen.append(input.numel() * input.element_size())
        return original(output, input, *args, **kwargs)

    dist.all_gather_single = counted
    try:
        fn()
    finally:
        dist.all_gather_single = original
    return sum(seen)


def uneven_training_matches():
    torch.manual_seed(1 + dist.get_rank())
    x = torch.randn(4, 32)
    results = {}
    for gather in (False, True):
        model = uneven_model(gather, MixedPrecisionPolicy())
        results[gather] = train(model, x, steps=3) + local_state(model)
    same = all(torch.equal(a, b) for a, b in zip(results[False], results[True]))
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    gathered = {}
    for gather in (False, True):
        model = uneven_model(gather, bf16)
        gathered[gather] = all_gather_bytes(lambda: model(x.bfloat16()).float().sum().backward())
    return same, model[0].weight.to_local().shape[0], gathered


def test_fp8_all_gather_of_uneven_and_empty_shards_and_its_bytes(world_pool):
    outcomes = world_pool.get(5).run(uneven_training_matches)
    assert [rows for _, rows, _ in outcomes] == [4, 4, 4, 4, 0], "the first weight must leave rank 4 empty"
    for same, _, gathered in outcomes:
        assert same, "fp8 all-gather changed the training on uneven / empty shards"
        # Forward and backward (FSDP2 reshards after forward) each gather every padded shard: 1 byte per
        # element in fp8 against 2 in bf16.
        padded = sum(-(-o // 5) * i for i, o in UNEVEN_FEATURES)
        assert gathered == {False: 2 * 2 * padded, True: 2 * 1 * padded}


def test_fp8_all_gather_refuses_recipes_without_a_shared_delayed_scale():
    with pytest.raises(ValueError, match="fp8_all_gather=True needs DelayedScaling"):
        convert_to_fp8(nn.Linear(16, 16), CurrentScaling(), fp8_all_gather=True)
    with pytest.raises(ValueError, match="reduce_amax"):
        convert_to_fp8(nn.Linear(16, 16), DelayedScaling(reduce_amax=False), fp8_all_gather=True)
    with pytest.raises(TypeError, match="fp8_all_gather must be a bool"):
        convert_to_fp8(nn.Linear(16, 16), DelayedScaling(), fp8_all_gather="yes")


def test_fp8_all_gather_weight_without_fsdp_is_the_plain_fp8_linear():
    torch.manual_seed(0)
    linear = nn.Linear(32, 16)
    copy = nn.Linear(32, 16)
    copy.load_state_dict(linear.state_dict())
    plain = convert_to_fp8(linear, DelayedScaling())
    wrapped = convert_to_fp8(copy, DelayedScaling(), fp8_all_gather=True)
    assert isinstance(wrapped.weight, Fp8AllGatherWeight) and wrapped.weight.requires_grad
    x = torch.randn(8, 32)
    for layer in (plain, wrapped):
        layer(x).square().sum().backward()
    assert torch.equal(plain(x), wrapped(x))
    assert torch.equal(plain.weight.grad, wrapped.weight.grad) and torch.equal(plain.bias.grad, wrapped.bias.grad)
    assert torch.equal(plain.amax_history, wrapped.amax_history)


def test_a_gathered_fp8_weight_refuses_every_use_but_its_linears():
    gathered = GatheredFp8Weight(torch.zeros(16, 32, dtype=torch.float8_e4m3fn), torch.ones(1), torch.bfloat16)
    assert gathered.shape == (16, 32) and gathered.dtype == torch.bfloat16
    assert torch.equal(gathered.detach()._data.view(torch.uint8), gathered._data.view(torch.uint8))
    with pytest.raises(NotImplementedError, match="only the fp8 linear that owns it reads it"):
        gathered + 1
    with pytest.raises(NotImplementedError, match="aten.view"):
        gathered.view(32, 16)


def test_the_amax_reduction_must_cover_the_fsdp_ranks():
    from types import SimpleNamespace

    from torchdist_ext.fp8.fsdp import _check_scale_is_shared

    def mesh(*ranks):
        return SimpleNamespace(mesh=torch.tensor(ranks))

    _check_scale_is_shared(mesh(0, 2), SimpleNamespace(amax_reduction_mesh=None))  # the whole world
    _check_scale_is_shared(mesh(0, 2), SimpleNamespace(amax_reduction_mesh=mesh(0, 1, 2, 3)))
    with pytest.raises(ValueError, match=r"amax_reduction_mesh \(ranks \[0, 1\]\) must include the FSDP ranks \[0, 2\]"):
        _check_scale_is_shared(mesh(0, 2), SimpleNamespace(amax_reduction_mesh=mesh(0, 1)))
