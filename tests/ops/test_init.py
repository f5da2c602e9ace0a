"""tdx::counter_trunc_normal_ and torchdist_ext.parallel.trunc_normal_: every block of a tensor equals the
whole tensor's values there, bit for bit (any dtype, any offsets, any DTensor layout: tensor parallelism under
FSDP2, uneven shards, 2-D meshes); the values are the truncated normal (closed-form CDF and moments); opcheck;
bad input refused by the op and its fake alike."""

import math

import pytest
import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from torchdist_ext.ops import counter_trunc_normal_
from torchdist_ext.parallel import ColumnParallelLinear, RowParallelLinear, trunc_normal_
from torchdist_ext.testing import cached_mesh


def whole(shape, dtype=torch.float32, **kwargs):
    return trunc_normal_(torch.empty(shape, dtype=dtype), key="w", seed=7, **kwargs)


def normal_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_every_block_holds_the_whole_tensors_values(dtype):
    full = whole((6, 10, 7), dtype)
    for offsets, sizes in [((0, 0, 0), (6, 10, 7)), ((2, 3, 1), (3, 4, 5)), ((5, 9, 6), (1, 1, 1)),
                           ((0, 4, 0), (6, 0, 7))]:
        block = torch.empty(sizes, dtype=dtype)
        counter_trunc_normal_(block, [6, 10, 7], list(offsets), 7, _key("w"), 0.0, 1.0, -2.0, 2.0)
        want = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        assert torch.equal(block, want), (offsets, sizes)


def _key(name: str) -> int:
    from torchdist_ext.parallel.init import _key_id

    return _key_id(name)


def test_16_bit_values_are_the_fp32_values_rounded():
    assert torch.equal(whole((64, 33), torch.bfloat16), whole((64, 33)).bfloat16())
    assert torch.equal(whole((64, 33), torch.float16), whole((64, 33)).half())


def test_the_values_are_the_truncated_normal():
    """mean 0.5, std 2, truncated to [-1, 4]: the empirical CDF at five points within 5 standard errors of
    Phi's, the mean and variance those of the truncated normal (closed forms)."""
    mean, std, a, b = 0.5, 2.0, -1.0, 4.0
    x = trunc_normal_(torch.empty(400_000, dtype=torch.float64), key="stats", mean=mean, std=std, a=a, b=b)
    assert a <= x.min() and x.max() <= b
    alpha, beta = (a - mean) / std, (b - mean) / std
    mass = normal_cdf(beta) - normal_cdf(alpha)
    for point in (-0.5, 0.0, 1.0, 2.0, 3.5):
        want = (normal_cdf((point - mean) / std) - normal_cdf(alpha)) / mass
        got = (x <= point).double().mean().item()
        assert abs(got - want) < 5 * math.sqrt(want * (1 - want) / x.numel()), (point, got, want)
    pdf = lambda z: math.exp(-z * z / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    want_mean = mean + std * (pdf(alpha) - pdf(beta)) / mass
    want_var = std**2 * (1 + (alpha * pdf(alpha) - beta * pdf(beta)) / mass - ((pdf(alpha) - pdf(beta)) / mass) ** 2)
    assert abs(x.mean().item() - want_mean) < 5 * math.sqrt(want_var / x.numel())
    assert abs(x.var().item() / want_var - 1) < 0.01


def test_seed_and_key_choose_the_values():
    base = whole((128,))
    assert torch.equal(trunc_normal_(torch.empty(128), key="w", seed=7), base)
    assert not torch.equal(trunc_normal_(torch.empty(128), key="w", seed=8), base)
    assert not torch.equal(trunc_normal_(torch.empty(128), key="v", seed=7), base)


def test_a_non_contiguous_tensor_and_a_meta_tensor():
    full = whole((5, 8))
    target = torch.zeros(8, 5).t()  # [5, 8], not contiguous
    trunc_normal_(target, key="w", seed=7)
    assert torch.equal(target, full)
    assert trunc_normal_(torch.empty(5, 8, device="meta"), key="w").is_meta


def test_opcheck_and_compile():
    torch.library.opcheck(torch.ops.tdx.counter_trunc_normal_, (torch.empty(4, 6), [8, 6], [2, 0], 1, 2, 0.0, 1.0,
                                                                 -2.0, 2.0))
    torch.library.opcheck(torch.ops.tdx.counter_trunc_normal_, (torch.empty(3, dtype=torch.bfloat16), [3], [0],
                                                                 1, 2, 0.0, 0.5, -1.0, 1.0))

    def fill(t):
        counter_trunc_normal_(t, [4, 6], [0, 0], 1, 2, 0.0, 1.0, -2.0, 2.0)
        return t * 2

    eager, compiled = torch.empty(4, 6), torch.empty(4, 6)
    expected = fill(eager)
    assert torch.equal(torch.compile(fill, fullgraph=True)(compiled), expected)
    assert torch.equal(compiled, eager)


@pytest.mark.parametrize("args, error, message", [
    ((torch.empty(2, 3), [2], [0]), ValueError, "whole_shape and offsets must have self's 2 dimensions"),
    ((torch.empty(2, 3), [2, 3], [1, 0]), ValueError, r"must lie inside whole_shape \[2, 3\] \(dimension 0\)"),
    ((torch.empty(2, 3), [2, 3], [0, -1]), ValueError, "must lie inside"),
    ((torch.empty(3, 2).t(), [2, 3], [0, 0]), ValueError, "self must be contiguous"),
    ((torch.empty(2, 3, dtype=torch.int32), [2, 3], [0, 0]), TypeError, "expected float32"),
], ids=["dims", "past-the-end", "negative-offset", "non-contiguous", "integer"])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_bad_blocks_are_refused(args, error, message, device):
    tensor, shape, offsets = args
    with pytest.raises(error, match=message):
        counter_trunc_normal_(tensor.to(device), shape, offsets, 0, 0, 0.0, 1.0, -2.0, 2.0)


@pytest.mark.parametrize("stats, message", [
    ((0.0, 0.0, -2.0, 2.0), "std positive"),
    ((math.nan, 1.0, -2.0, 2.0), "mean must be finite"),
    ((0.0, 1.0, 2.0, 2.0), "must have a < b"),
], ids=["std", "mean", "bounds"])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_bad_distributions_are_refused(stats, message, device):
    with pytest.raises(ValueError, match=message):
        counter_trunc_normal_(torch.empty(4, device=device), [4], [0], 0, 0, *stats)


def test_a_distribution_without_mass_is_refused():
    with pytest.raises(ValueError, match="holds no mass"):
        trunc_normal_(torch.empty(4), key="w", std=1e-3, a=5.0, b=6.0)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(key=""), TypeError, "key must be a non-empty str"),
    (dict(key=3), TypeError, "key must be a non-empty str"),
    (dict(key="w", seed=1.5), TypeError, "seed must be an int64"),
    (dict(key="w", seed=2**64), TypeError, "seed must be an int64"),
])
def test_bad_keys_and_seeds_are_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        trunc_normal_(torch.empty(4), **kwargs)


def sharded_layouts_equal_the_whole() -> bool:
    """On 4 ranks: DTensors on a 2 x 2 mesh in every placement pair (uneven shards included), and column and
    row tensor-parallel linears (tp 2) under FSDP2 (dp 2), each initialised shard-wise: their full tensors
    equal the plain tensor initialised whole."""
    mesh = cached_mesh((2, 2), ("dp", "tp"))
    for placements in [(Shard(0), Shard(1)), (Shard(0), Shard(0)), (Replicate(), Shard(1)), (Shard(1), Replicate())]:
        for shape in [(8, 6), (5, 3)]:  # (5, 3): uneven, one rank's shard empty
            tensor = distribute_tensor(torch.zeros(shape), mesh, placements)
            trunc_normal_(tensor, key="w", seed=7)
            assert torch.equal(tensor.full_tensor(), whole(shape)), (placements, shape)
    for cls, shape in ((ColumnParallelLinear, (10, 6)), (RowParallelLinear, (6, 10))):
        with torch.device("meta"):
            linear = torch.nn.Linear(shape[1], shape[0], bias=False)
        layer = cls.from_linear(linear, tp_mesh=mesh["tp"])
        fully_shard(layer, mesh=mesh["dp"])
        layer.to_empty(device="cpu")
        trunc_normal_(layer.weight, key="w", seed=7)
        assert isinstance(layer.weight, DTensor) and torch.equal(layer.weight.full_tensor(), whole(shape)), cls
    partial = DTensor.from_local(torch.zeros(2, 2), mesh["tp"], [Partial()])
    with pytest.raises(ValueError, match="Partial placements"):
        trunc_normal_(partial, key="w")
    return True


def test_sharded_layouts_equal_the_whole(world4):
    assert all(world4.run(sharded_layouts_equal_the_whole))
