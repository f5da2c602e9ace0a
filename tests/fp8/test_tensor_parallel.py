"""Our column / row parallel linears in fp8 on 2 and 4 ranks, with and without sequence parallelism, equal
the single-process fp8 linears: the reduced amaxes give every rank the single process's scales, and with
those scales outputs and every gradient agree to fp32 rounding."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.numerics import assert_close_to_scale
from torchdist_ext.fp8 import CurrentScaling, DelayedScaling, Fp8Linear, convert_to_fp8, fp8_step
from torchdist_ext.parallel import ColumnParallelLinear, RowParallelLinear
from torchdist_ext.testing import cached_mesh, gather_replicated, shard_replicated


class Mlp(nn.Module):
    def __init__(self, up, down):
        super().__init__()
        self.up, self.down = up, down

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def step(model, x, upstream):
    x = x.detach().clone().requires_grad_(True)
    out = model(x)
    out.backward(upstream)
    return out.detach(), x.grad


def tp_fp8_matches_one_process(sequence_parallel):
    n = dist.get_world_size()
    mesh = cached_mesh((n,), ("tp",))
    torch.manual_seed(0)
    up, down = nn.Linear(32, 64), nn.Linear(64, 32)
    recipe = DelayedScaling(amax_history_len=4)
    reference = convert_to_fp8(Mlp(copy.deepcopy(up), copy.deepcopy(down)),
                               DelayedScaling(amax_history_len=4, reduce_amax=False))
    parallel = convert_to_fp8(Mlp(ColumnParallelLinear.from_linear(up, tp_mesh=mesh, sequence_parallel=sequence_parallel),
                                  RowParallelLinear.from_linear(down, tp_mesh=mesh, sequence_parallel=sequence_parallel)),
                              recipe)
    assert isinstance(reference.up, Fp8Linear) and parallel.up.fp8_recipe == recipe
    gen = torch.Generator().manual_seed(1)

    def local(t):
        return shard_replicated(t, mesh=mesh, dim=1) if sequence_parallel else t

    def full(t):
        return gather_replicated(t, mesh=mesh, dim=1) if sequence_parallel else t

    for step_index in range(3):
        x, upstream = torch.randn(2, 4 * n, 32, generator=gen) * 4, torch.randn(2, 4 * n, 32, generator=gen) * 1e-2
        out_ref, grad_ref = step(reference, x, upstream)
        out_par, grad_par = step(parallel, local(x), local(upstream))
        if step_index > 0:  # the scales came from step 0's reduced amaxes
            assert_close_to_scale(full(out_par), out_ref, what=f"step {step_index} output")
            assert_close_to_scale(full(grad_par), grad_ref, what=f"step {step_index} input grad")
            for (name, p_par), p_ref in zip(parallel.named_parameters(), reference.parameters()):
                assert_close_to_scale(p_par.grad.full_tensor(), p_ref.grad, what=f"step {step_index} {name} grad")
        parallel.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        fp8_step(parallel)
        fp8_step(reference)
        for module_par, module_ref in ((parallel.up, reference.up), (parallel.down, reference.down)):
            torch.testing.assert_close(module_par.scale, module_ref.scale, rtol=1e-6, atol=0)
            scales = [torch.empty_like(module_par.scale) for _ in range(n)]
            dist.all_gather(scales, module_par.scale)
            assert all(torch.equal(s, scales[0]) for s in scales), "ranks disagree on a scale"
            module_ref.scale.copy_(module_par.scale)  # the next step's casts then see the same scales


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["no_sp", "sp"])
@pytest.mark.parametrize("world", ["world2", "world4"])
def test_fp8_tensor_parallel_equals_one_process(world, sequence_parallel, request):
    request.getfixturevalue(world).run(tp_fp8_matches_one_process, sequence_parallel)


def current_scaling_sequence_parallel_matches_replicated():
    """Current scaling (each rank's own scales): the sequence-parallel layers gather the activations and
    reduce-scatter the output around the fp8 GEMM; every rank casts the same tensors as without sequence
    parallelism (the gathered input, its own GEMM shard, the gathered output gradient), so the two agree up
    to the order of the sums."""
    n = dist.get_world_size()
    mesh = cached_mesh((n,), ("tp",))
    torch.manual_seed(0)
    up, down = nn.Linear(32, 64), nn.Linear(64, 32)
    models = {sp: convert_to_fp8(Mlp(ColumnParallelLinear.from_linear(up, tp_mesh=mesh, sequence_parallel=sp),
                                     RowParallelLinear.from_linear(down, tp_mesh=mesh, sequence_parallel=sp)),
                                 CurrentScaling()) for sp in (False, True)}
    gen = torch.Generator().manual_seed(1)
    x, upstream = torch.randn(2, 4 * n, 32, generator=gen) * 4, torch.randn(2, 4 * n, 32, generator=gen) * 1e-2
    out, grad = step(models[False], x, upstream)
    out_sp, grad_sp = step(models[True], shard_replicated(x, mesh=mesh, dim=1), shard_replicated(upstream, mesh=mesh,
                                                                                                   dim=1))
    assert_close_to_scale(gather_replicated(out_sp, mesh=mesh, dim=1), out, what="output")
    assert_close_to_scale(gather_replicated(grad_sp, mesh=mesh, dim=1), grad, what="input grad")
    for (name, p_sp), p in zip(models[True].named_parameters(), models[False].parameters()):
        assert_close_to_scale(p_sp.grad.full_tensor(), p.grad.full_tensor(), what=f"{name} grad")


def test_current_scaling_sequence_parallel_matches_replicated(world2):
    world2.run(current_scaling_sequence_parallel_matches_replicated)


def reduction_mesh_without_the_tp_ranks() -> str:
    mesh = cached_mesh((dist.get_world_size(), 1), ("tp", "dp"))
    layer = ColumnParallelLinear(32, 64, tp_mesh=mesh["tp"], sequence_parallel=True)
    with pytest.raises(ValueError) as refused:
        convert_to_fp8(layer, DelayedScaling(), amax_reduction_mesh=mesh["dp"])
    return str(refused.value)


def test_an_amax_reduction_mesh_must_include_the_tp_ranks(world2):
    for message in world2.run(reduction_mesh_without_the_tp_ranks):
        assert "must include the tensor-parallel ranks [0, 1] of ColumnParallelLinear" in message, message


def compiled_fp8_block_equals_eager():
    n = dist.get_world_size()
    mesh = cached_mesh((n,), ("tp",))
    torch.manual_seed(0)
    up, down = nn.Linear(32, 64), nn.Linear(64, 32)

    def build():
        return convert_to_fp8(Mlp(ColumnParallelLinear.from_linear(up, tp_mesh=mesh, sequence_parallel=True),
                                  RowParallelLinear.from_linear(down, tp_mesh=mesh, sequence_parallel=True)),
                              DelayedScaling(amax_history_len=4))

    eager, compiled_model = build(), build()
    torch._dynamo.reset()
    compiled = torch.compile(compiled_model, fullgraph=True)
    torch._dynamo.utils.counters.clear()
    gen = torch.Generator().manual_seed(2)
    for step_index in range(5):
        x = shard_replicated(torch.randn(2, 4 * n, 32, generator=gen) * (step_index + 1), mesh=mesh, dim=1)
        upstream = torch.randn_like(x)
        results = []
        for model, run in ((eager, eager), (compiled_model, compiled)):
            out, grad = step(run, x, upstream)
            results.append([out, grad] + [p.grad.to_local().clone() for p in model.parameters()])
            model.zero_grad(set_to_none=True)
            fp8_step(model)
            results[-1] += [b.clone() for b in model.buffers()]
        for i, (a, b) in enumerate(zip(*results)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=lambda m: f"step {step_index}, tensor {i}: {m}")
    return torch._dynamo.utils.counters["stats"]["unique_graphs"], sum(torch._dynamo.utils.counters["recompiles"].values())


def test_compiled_fp8_tensor_parallel_block_equals_eager_without_recompiles(world2):
    for graphs, recompiles in world2.run(compiled_fp8_block_equals_eager):
        assert graphs == 1 and recompiles == 0
