"""clip_grad_norm_ over every mesh and pipeline stage equals torch's clip_grad_norm_ in one process training the
whole model: the norm (2-norm and inf-norm) and every clipped gradient, at pp x dp x tp = 2x1x2, 1x2x2 and 2x2x1
on 4 ranks (tensor-parallel DTensors, FSDP2 shards, plain tensors, pipeline stages holding different layers);
and a rank's local-shard norm is smaller, so clipping by it would scale the update by too little."""

import math

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import torchdist_ext
from torchdist_ext.parallel import ColumnParallelLinear, RowParallelLinear
from torchdist_ext.testing import cached_mesh

BATCH, HIDDEN, FFN, STAGES = 4, 8, 16, 2


class Stage(nn.Module):
    """A pipeline stage: x + down(gelu(up(x))), then a plain head (replicated over tp)."""

    def __init__(self, up: nn.Module, down: nn.Module, head: nn.Module):
        super().__init__()
        self.up, self.down, self.head = up, down, head

    def forward(self, x):
        return self.head(x + self.down(nn.functional.gelu(self.up(x))))


def reference_stages() -> list[Stage]:
    torch.manual_seed(0)
    return [Stage(nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)) for _ in range(STAGES)]


def stage_input(stage: int) -> torch.Tensor:
    return torch.randn(BATCH, HIDDEN, generator=torch.Generator().manual_seed(stage + 1))


def stage_loss(stage: nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = stage(x)
    return (y.sin() * y).mean()


def reference_clip(norm_type: float) -> tuple[float, float, list[dict[str, torch.Tensor]]]:
    """(max_norm: half the norm, the norm, each stage's clipped gradients by name) in one process."""
    stages = reference_stages()
    for index, stage in enumerate(stages):
        stage_loss(stage, stage_input(index)).backward()
    params = [p for stage in stages for p in stage.parameters()]
    max_norm = 0.5 * torch.nn.utils.get_total_norm([p.grad for p in params], norm_type).item()
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type).item()
    return max_norm, norm, [{name: p.grad for name, p in stage.named_parameters()} for stage in stages]


def parallel_clip(pp: int, dp: int, tp: int, norm_type: float):
    mesh = cached_mesh((pp, dp, tp), ("pp", "dp", "tp"))
    max_norm, expected_norm, expected_grads = reference_clip(norm_type)
    stages = reference_stages()
    mine = range(mesh["pp"].get_local_rank(), STAGES, pp)  # pp=1: both stages on every rank
    parts = []
    for index in mine:
        reference = stages[index]
        stage = Stage(ColumnParallelLinear.from_linear(reference.up, tp_mesh=mesh["tp"]),
                      RowParallelLinear.from_linear(reference.down, tp_mesh=mesh["tp"]), reference.head)
        if dp > 1:
            fully_shard(stage, mesh=mesh["dp"])
        stage_loss(stage, stage_input(index).chunk(dp)[mesh["dp"].get_local_rank()]).backward()
        parts.append((index, stage))
    local_grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                   for _, stage in parts for p in stage.parameters()]
    local_norm = torch.nn.utils.get_total_norm(local_grads, norm_type).item()
    norm = torchdist_ext.clip_grad_norm_([stage for _, stage in parts], max_norm, norm_type=norm_type,
                                         pp_mesh=mesh["pp"])
    worst = 0.0
    for index, stage in parts:
        for name, param in stage.named_parameters():
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            worst = max(worst, (grad - expected_grads[index][name]).abs().max().item())
    return norm.item(), expected_norm, local_norm, worst


@pytest.mark.parametrize("pp, dp, tp", [(2, 1, 2), (1, 2, 2), (2, 2, 1)], ids=["pp2-tp2", "dp2-tp2", "pp2-dp2"])
@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["l2", "inf"])
def test_clip_grad_norm_equals_one_process(world_pool, pp, dp, tp, norm_type):
    for norm, expected, local_norm, worst in world_pool.get(4).run(parallel_clip, pp, dp, tp, norm_type):
        assert norm == pytest.approx(expected, rel=1e-5)
        assert worst < 1e-6
        if norm_type == 2.0:
            # A rank sees part of the gradient: clipping by its norm would leave the update above max_norm.
            assert local_norm < 0.9 * expected


def inf_norm_with_an_empty_shard() -> tuple[float, float, float]:
    """A [1, 4] weight sharded by FSDP2 over 2 ranks: rank 1's shard is empty."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 1), nn.Linear(1, 3))
    model = nn.Sequential(nn.Linear(4, 1), nn.Linear(1, 3))
    model.load_state_dict(reference.state_dict())
    fully_shard(model, mesh=cached_mesh((2,), ("dp",)))
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    for module in (reference, model):
        module(x).square().mean().backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e-3, math.inf).item()
    norm = torchdist_ext.clip_grad_norm_(model, 1e-3, norm_type=math.inf).item()
    worst = max((p.grad.full_tensor() - r.grad).abs().max().item()
                for p, r in zip(model.parameters(), reference.parameters()))
    return norm, expected, worst


def test_inf_norm_counts_an_empty_shard_as_zero(world_pool):
    for norm, expected, worst in world_pool.get(2).run(inf_norm_with_an_empty_shard):
        assert norm == pytest.approx(expected, rel=1e-6) and worst < 1e-9


def test_clip_grad_norm_refuses_bad_arguments():
    layer = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="max_norm must be a positive finite number, got -1"):
        torchdist_ext.clip_grad_norm_(layer, -1)
    with pytest.raises(ValueError, match="max_norm must be a positive finite number, got 1000000"):
        torchdist_ext.clip_grad_norm_(layer, 10**400)
    with pytest.raises(TypeError, match="max_norm must be a positive number, got '1.0'"):
        torchdist_ext.clip_grad_norm_(layer, "1.0")
    with pytest.raises(ValueError, match="norm_type must be a positive number"):
        torchdist_ext.clip_grad_norm_(layer, 1.0, norm_type=0)
    with pytest.raises(TypeError, match="model_parts must be an nn.Module or an iterable"):
        torchdist_ext.clip_grad_norm_(None, 1.0)
    with pytest.raises(TypeError, match="error_if_nonfinite must be a bool, got 'yes'"):
        torchdist_ext.clip_grad_norm_(layer, 1.0, error_if_nonfinite="yes")
    with pytest.raises(TypeError, match="model_parts must hold nn.Modules or parameters, got a str"):
        torchdist_ext.clip_grad_norm_([layer, "head"], 1.0)
    with pytest.raises(TypeError, match="pp_mesh must be a 1-D DeviceMesh"):
        torchdist_ext.clip_grad_norm_(layer, 1.0, pp_mesh=object())


def test_clip_grad_norm_refuses_a_nonfinite_norm_when_asked():
    layer = nn.Linear(2, 2)
    layer(torch.tensor([[math.inf, 1.0]])).sum().backward()
    with pytest.raises(RuntimeError, match="error_if_nonfinite=True"):
        torchdist_ext.clip_grad_norm_(layer, 1.0, error_if_nonfinite=True)


def inf_norm_with_a_nan_on_rank_1(parallelism: str) -> tuple[float, float, str]:
    """Rank 1's gradient holds a NaN: under tensor parallelism in its shard of a ColumnParallelLinear's weight,
    under pipeline parallelism in its own stage's layer. Returns (the norm, the single-process reference's norm,
    what clip_grad_norm_(error_if_nonfinite=True) raised on this rank)."""
    torch.manual_seed(0)
    reference = nn.Linear(4, 8)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    if parallelism == "tp":
        mesh, pp_mesh = cached_mesh((2,), ("tp",)), None
        layer = ColumnParallelLinear.from_linear(reference, tp_mesh=mesh)
    else:
        pp_mesh = mesh = cached_mesh((2,), ("pp",))
        layer = nn.Linear(4, 8)
        layer.load_state_dict(reference.state_dict())
    layer(x).square().mean().backward()
    if mesh.get_local_rank() == 1:
        with torch.no_grad():
            weight_grad = layer.weight.grad
            (weight_grad.to_local() if isinstance(weight_grad, DTensor) else weight_grad)[0, 1] = math.nan
    # The reference: one process holding every gradient (the full tensors, or both stages' layers).
    grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in layer.parameters()]
    if pp_mesh is not None:
        gathered = [[torch.empty_like(g) for _ in range(2)] for g in grads]
        for g, into in zip(grads, gathered):
            torch.distributed.all_gather(into, g, group=pp_mesh.get_group())
        grads = [g for into in gathered for g in into]
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for param, grad in zip(params, grads):
        param.grad = grad.clone()
    expected = torch.nn.utils.clip_grad_norm_(params, 1.0, math.inf).item()
    try:
        torchdist_ext.clip_grad_norm_(layer, 1.0, norm_type=math.inf, pp_mesh=pp_mesh, error_if_nonfinite=True)
        refused = "nothing raised"
    except RuntimeError as error:
        refused = str(error)
    norm = torchdist_ext.clip_grad_norm_(layer, 1.0, norm_type=math.inf, pp_mesh=pp_mesh).item()
    return norm, expected, refused


@pytest.mark.parametrize("parallelism", ["tp", "pp"])
def test_inf_norm_keeps_a_nan_held_by_one_rank(world2, parallelism):
    """A NaN in one rank's gradient makes the inf-norm NaN on every rank, as torch's in one process (gloo's MAX
    alone drops a NaN: both ranks saw the other elements' max), and error_if_nonfinite raises on every rank."""
    for norm, expected, refused in world2.run(inf_norm_with_a_nan_on_rank_1, parallelism):
        assert not math.isfinite(expected)
        assert norm == pytest.approx(expected, nan_ok=True), (norm, expected)
        assert "error_if_nonfinite=True" in refused and "is nan" in refused, refused
