"""DiLoCo against a single-process simulation of the same islands (each island's own data, its inner
optimizer, the pseudo-gradients averaged and the outer optimizer applied every H steps), fp32, on 4 ranks:
2 islands of 2 FSDP2 ranks and 2 islands of 2 tensor-parallel ranks; streaming fragments; H = 1 with outer
SGD lr 1 equals data parallelism; the bf16 and fp8 exchanges within their rounding bounds of the fp32 one;
the state resumed."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from torchdist_ext.diloco import DiLoCo, nesterov
from torchdist_ext.parallel import ColumnParallelLinear, RowParallelLinear
from torchdist_ext.testing import cached_mesh

DIM, HIDDEN, ROWS = 8, 16, 8


def make_model(hidden: int = HIDDEN) -> nn.Module:
    """The islands' model; an odd ``hidden`` shards unevenly over 2 FSDP2 ranks."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, hidden), nn.Tanh(), nn.Linear(hidden, DIM))


def island_batch(island: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * island + step)
    return torch.randn(ROWS, DIM, generator=gen), torch.randn(ROWS, DIM, generator=gen)


def loss_of(model, x, y) -> torch.Tensor:
    return (model(x) - y).square().mean()


def inner_sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def inner_adamw(params):
    return torch.optim.AdamW(params, lr=0.01)


def outer_sgd_lr1(params):
    return torch.optim.SGD(params, lr=1.0)


class Simulation:
    """The islands in one process: inner steps on each island's own batches, fragment f of the parameters synced
    at the steps s with s % H == f H / F (the outer optimizer over one copy of the parameters, stepped with the
    islands' mean pseudo-gradient of that fragment)."""

    def __init__(self, islands: int, inner, outer, hidden: int = HIDDEN):
        self.models = [make_model(hidden) for _ in range(islands)]
        self.inners = [inner(m.parameters()) for m in self.models]
        self.synced = make_model(hidden)
        self.outer = outer(self.synced.parameters())

    def step(self, step: int, sync_every: int, fragments: list[list[int]]) -> None:
        for island, (model, optimizer) in enumerate(zip(self.models, self.inners)):
            x, y = island_batch(island, step)
            optimizer.zero_grad()
            loss_of(model, x, y).backward()
            optimizer.step()
        phase = step % sync_every
        due = [f for f in range(len(fragments)) if phase == (f * sync_every) // len(fragments)][:1]
        for f in due:
            params = list(self.synced.parameters())
            for p in params:
                p.grad = None
            for i in fragments[f]:
                deltas = [params[i].detach() - list(m.parameters())[i].detach() for m in self.models]
                params[i].grad = torch.stack(deltas).mean(0)
            self.outer.step()
            for model in self.models:
                for i in fragments[f]:
                    list(model.parameters())[i].data.copy_(params[i].detach())

    def regroup(self, islands: int, inner) -> None:
        """Another island count, every island resuming as island 0 (its parameters and inner state)."""
        self.models = [copy.deepcopy(self.models[0]) for _ in range(islands)]
        state = self.inners[0].state_dict()
        self.inners = [inner(m.parameters()) for m in self.models]
        for optimizer in self.inners:
            optimizer.load_state_dict(copy.deepcopy(state))


def simulate(steps: int, islands: int, sync_every: int, fragments: list[list[int]], inner, outer,
             hidden: int = HIDDEN) -> list[nn.Module]:
    """Each island's model after ``steps`` in one process (``Simulation``)."""
    simulation = Simulation(islands, inner, outer, hidden)
    for step in range(1, steps + 1):
        simulation.step(step, sync_every, fragments)
    return simulation.models


def parallel_island_model(kind: str) -> nn.Module:
    """This rank's part of its island's model: FSDP2 over the island's 2 ranks (evenly, or "fsdp-uneven": a
    hidden width of 7 split 4 + 3), or tensor parallelism."""
    mesh = cached_mesh((2, 2), ("island", "inner"))
    model = make_model(7 if kind == "fsdp-uneven" else HIDDEN)
    if kind.startswith("fsdp"):
        return fully_shard(model, mesh=mesh["inner"])
    model[0] = ColumnParallelLinear.from_linear(model[0], tp_mesh=mesh["inner"])
    model[2] = RowParallelLinear.from_linear(model[2], tp_mesh=mesh["inner"])
    return model


def train_islands(kind: str, steps: int, sync_every: int, fragments: int, inner, outer, outer_dtype=torch.float32,
                  diloco_state=None):
    """Trains this rank's island (island = its index on the outer mesh dim) with DiLoCo; returns its model's
    full parameters and the DiLoCo."""
    mesh = cached_mesh((2, 2), ("island", "inner"))
    island, inner_rank = mesh["island"].get_local_rank(), mesh["inner"].get_local_rank()
    model = parallel_island_model(kind)
    optimizer = inner(model.parameters())
    diloco = DiLoCo(model, optimizer, island_mesh=mesh["island"], sync_every=sync_every, fragments=fragments,
                    outer_optimizer=outer, outer_dtype=outer_dtype)
    for step in range(1, steps + 1):
        x, y = island_batch(island, step)
        if kind.startswith("fsdp"):  # each FSDP rank its half of the island's rows (mean loss: FSDP averages)
            x, y = x.chunk(2)[inner_rank], y.chunk(2)[inner_rank]
        loss_of(model, x, y).backward()
        diloco.step()
        optimizer.zero_grad()
    full = [p.full_tensor() if isinstance(p, DTensor) else p.detach().clone() for p in model.parameters()]
    return full, diloco


def check_against_simulation(kind: str, sync_every: int, fragments: int, inner_name: str):
    inner = {"sgd": inner_sgd, "adamw": inner_adamw}[inner_name]
    steps = 2 * sync_every
    full, diloco = train_islands(kind, steps, sync_every, fragments, inner, None)
    island = cached_mesh((2, 2), ("island", "inner"))["island"].get_local_rank()
    hidden = 7 if kind == "fsdp-uneven" else HIDDEN
    expected = simulate(steps, 2, sync_every, diloco.fragments, inner, nesterov, hidden)[island]
    for got, want in zip(full, expected.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    return [len(f) for f in diloco.fragments]


@pytest.mark.parametrize("kind, sync_every, fragments, inner", [
    ("fsdp", 2, 1, "adamw"), ("tp", 3, 1, "adamw"), ("fsdp", 2, 2, "sgd"), ("tp", 4, 3, "adamw"),
    ("fsdp-uneven", 2, 2, "adamw")],
    ids=["fsdp-h2", "tp-h3", "fsdp-h2-2-fragments", "tp-h4-3-fragments", "fsdp-uneven-shards"])
def test_islands_equal_their_single_process_simulation(world4, kind, sync_every, fragments, inner):
    sizes = world4.run(check_against_simulation, kind, sync_every, fragments, inner)
    assert len(sizes[0]) == fragments and sum(sizes[0]) == 4


def check_equals_data_parallelism():
    """H = 1, outer SGD lr 1 without momentum, inner SGD: every step averages the islands' SGD steps, which is
    one SGD step on the mean gradient over both islands' batches."""
    full, _ = train_islands("fsdp", 3, 1, 1, inner_sgd, outer_sgd_lr1)
    model = make_model()
    optimizer = inner_sgd(model.parameters())
    for step in range(1, 4):
        optimizer.zero_grad()
        sum(loss_of(model, *island_batch(island, step)) for island in range(2)).div(2).backward()
        optimizer.step()
    for got, want in zip(full, model.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


def test_sync_every_step_with_outer_sgd_lr1_is_data_parallelism(world4):
    world4.run(check_equals_data_parallelism)


def check_quantised_exchange(outer_dtype):
    """One sync with outer SGD lr 1: the new parameters are the synced ones minus the mean pseudo-gradient, so
    the quantised run differs from the fp32 one by the exchange's rounding alone, element by element at most
    the mean over the islands of each island's rounding: bf16 half an ulp, 2^-8 of |value|; e4m3 half an ulp,
    2^-4 of |value|, or half its subnormal step, 2^-10 / scale (scale = 448 / the amax over the islands)."""
    exact, _ = train_islands("tp", 2, 2, 1, inner_adamw, outer_sgd_lr1)
    rounded, _ = train_islands("tp", 2, 2, 1, inner_adamw, outer_sgd_lr1, outer_dtype)
    start = list(make_model().parameters())
    islands = simulate(2, 2, 3, [[0, 1, 2, 3]], inner_adamw, outer_sgd_lr1)  # (no sync: each island's 2 steps)
    for index, (got, want) in enumerate(zip(rounded, exact)):
        deltas = torch.stack([start[index].detach() - list(m.parameters())[index].detach() for m in islands])
        if outer_dtype == torch.bfloat16:
            bound = (2.0 ** -8 * deltas.abs()).mean(0)
        else:
            scale = 448.0 / deltas.abs().max().item()
            bound = torch.maximum(2.0 ** -4 * deltas.abs(), torch.full_like(deltas, 2.0 ** -10 / scale)).mean(0)
        assert ((got - want).abs() <= bound + 1e-7).all(), (got - want).abs().max()
        assert not torch.equal(got, want)  # the exchange does round
    return True


@pytest.mark.parametrize("outer_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_quantised_exchange_within_its_rounding_bound(world4, outer_dtype):
    assert all(world4.run(check_quantised_exchange, outer_dtype))


def check_islands_start_alike():
    """An island seeded otherwise starts from island 0's parameters."""
    mesh = cached_mesh((2, 2), ("island", "inner"))
    model = parallel_island_model("tp")
    if mesh["island"].get_local_rank() == 1:
        with torch.no_grad():
            for param in model.parameters():
                param.to_local().add_(1.0)
    DiLoCo(model, inner_sgd(model.parameters()), island_mesh=mesh["island"], sync_every=2)
    for got, want in zip(model.parameters(), make_model().parameters()):
        torch.testing.assert_close(got.full_tensor(), want.detach(), rtol=0, atol=0)


def test_islands_start_from_island_0s_parameters(world4):
    world4.run(check_islands_start_alike)


def check_resume():
    """3 steps, the state saved, 3 more; a fresh DiLoCo loaded from the state at step 3 continues alike."""
    mesh = cached_mesh((2, 2), ("island", "inner"))
    island = mesh["island"].get_local_rank()
    runs = []
    for resumed in (False, True):
        model = parallel_island_model("tp")
        optimizer = inner_adamw(model.parameters())
        diloco = DiLoCo(model, optimizer, island_mesh=mesh["island"], sync_every=2)
        for step in range(1, 7):
            if resumed and step == 4:  # a new process would rebuild all three and load their states
                saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()),
                         copy.deepcopy(diloco.state_dict()))
                model = parallel_island_model("tp")
                optimizer = inner_adamw(model.parameters())
                diloco = DiLoCo(model, optimizer, island_mesh=mesh["island"], sync_every=2)
                model.load_state_dict(saved[0])
                optimizer.load_state_dict(saved[1])
                diloco.load_state_dict(saved[2])
            loss_of(model, *island_batch(island, step)).backward()
            diloco.step()
            optimizer.zero_grad()
        runs.append([p.full_tensor() if isinstance(p, DTensor) else p.detach() for p in model.parameters()])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_resume(world4):
    world4.run(check_resume)


def check_resume_at_another_island_count(islands_after: int, path: str):
    """2 islands of 2 FSDP2 ranks train 3 steps (H = 2: a sync at step 2, its outer momentum saved) and save;
    ``islands_after`` islands of 4 / islands_after FSDP2 ranks load it, every island as island 0, and train 3
    more: each island's parameters equal the simulation's, regrouped alike."""
    from torchdist_ext import checkpoint

    before = cached_mesh((2, 2), ("island", "inner"))
    model = fully_shard(make_model(), mesh=before["inner"])
    optimizer = inner_adamw(model.parameters())
    diloco = DiLoCo(model, optimizer, island_mesh=before["island"], sync_every=2)
    for step in range(1, 4):
        x, y = (t.chunk(2)[before["inner"].get_local_rank()] for t in island_batch(before["island"].get_local_rank(),
                                                                                  step))
        loss_of(model, x, y).backward()
        diloco.step()
        optimizer.zero_grad()
    checkpoint.save(path, [model], [optimizer], diloco=diloco)

    inside = 4 // islands_after
    after = cached_mesh((islands_after, inside), ("island", "inner"))
    island, inner_rank = after["island"].get_local_rank(), after["inner"].get_local_rank()
    model = make_model()
    model = fully_shard(model, mesh=after["inner"]) if inside > 1 else model
    optimizer = inner_adamw(model.parameters())
    diloco = DiLoCo(model, optimizer, island_mesh=after["island"], sync_every=2)
    checkpoint.load(path, [model], [optimizer], diloco=diloco)
    assert diloco.inner_steps == 3
    for step in range(4, 7):
        x, y = (t.chunk(inside)[inner_rank] for t in island_batch(island, step))
        loss_of(model, x, y).backward()
        diloco.step()
        optimizer.zero_grad()

    simulation = Simulation(2, inner_adamw, nesterov)
    for step in range(1, 4):
        simulation.step(step, 2, diloco.fragments)
    simulation.regroup(islands_after, inner_adamw)
    for step in range(4, 7):
        simulation.step(step, 2, diloco.fragments)
    for got, want in zip(model.parameters(), simulation.models[island].parameters()):
        got = got.full_tensor() if isinstance(got, DTensor) else got.detach()
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("islands_after", [4, 1])
def test_resume_at_another_island_count(world4, islands_after, tmp_path):
    world4.run(check_resume_at_another_island_count, islands_after, str(tmp_path / "ckpt"))


def refuse(kwargs: dict, message: str):
    mesh = cached_mesh((2, 2), ("island", "inner"))
    model = make_model()
    if dist.get_rank() == 0 and "rank0" in kwargs:
        kwargs = {**kwargs, **kwargs.pop("rank0")}
    kwargs.pop("rank0", None)
    with pytest.raises((ValueError, TypeError), match=message):
        DiLoCo(model, inner_sgd(model.parameters()), island_mesh=mesh["island"], **{"sync_every": 2, **kwargs})


@pytest.mark.parametrize("kwargs, message", [
    (dict(sync_every=0), r"sync_every must be an int >= 1, got 0"),
    (dict(fragments=5), r"fragments=5 must not exceed the model's 4 parameters"),
    (dict(fragments=3), r"fragments=3 must not exceed sync_every=2"),
    (dict(outer_dtype=torch.float16), r"outer_dtype must be one of"),
    (dict(rank0=dict(sync_every=3)), r"sync_every"),  # ranks that disagree: refused on every rank
])
def test_bad_arguments(world4, kwargs, message):
    world4.run(refuse, kwargs, message)
