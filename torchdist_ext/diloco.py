"""DiLoCo (Douillard et al. 2023): islands of ranks that train on their own and, every ``sync_every`` steps,
average their pseudo-gradients (the parameters' change since the last sync) over an island axis and apply
an outer optimizer, so that the island axis carries 1/H of data parallelism's traffic.

    diloco = DiLoCo(model, torch.optim.AdamW(model.parameters()), island_mesh=mesh["island"], sync_every=50)
    loss.backward(); diloco.step(); inner_optimizer.zero_grad()

Inside an island the model is parallelised as usual (FSDP2, tp, ...): every island holds the same layout, so
a rank's local shards match those of the same rank in every other island, and the pseudo-gradients are
all-reduced shard by shard over ``island_mesh``. With ``fragments > 1`` (streaming DiLoCo, Douillard et
al. 2025) the parameters are cut into that many fragments, synchronised at staggered steps.
"""

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torchdist_ext.agreement import check_agreement, collective_device
from torchdist_ext.parallel.mesh_group import MeshGroup

__all__ = ["DiLoCo", "OUTER_DTYPES"]

OUTER_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn)


def nesterov(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """The paper's outer optimizer: SGD with Nesterov momentum, lr 0.7, momentum 0.9."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class DiLoCo:
    """Wraps an island's model and inner optimizer; ``step()`` replaces ``inner_optimizer.step()``.

    Args:
        model: the island's model (its parameters, in ``model.parameters()`` order, are the ones synchronised);
            the same layout in every island.
        inner_optimizer: the optimizer of the island's training (over ``model``'s parameters).
        island_mesh: 1-D DeviceMesh across the islands (rank r of every island: the outermost mesh dim).
        sync_every: H, inner steps between two syncs of a fragment, an int >= 1.
        outer_optimizer: a function of the parameters returning the outer optimizer (default: ``nesterov``,
            SGD lr 0.7, momentum 0.9, Nesterov).
        fragments: F >= 1 fragments of consecutive parameters of about equal size; fragment f syncs at the steps
            s with ``s % H == (f * H) // F`` (F = 1: every H steps), at most one fragment per step.
        outer_dtype: what the pseudo-gradients travel as: float32 (all-reduced), bfloat16 (rounded to
            nearest), or float8_e4m3fn with one fp32 scale per tensor (the largest |value| over the islands mapped
            to 448); the last two gathered as their bytes (half and a quarter of fp32's) and averaged in fp32.

    Construction is collective over the default group (the schedule must agree on every rank) and over
    ``island_mesh`` (the parameters' shards must agree). State (``state_dict`` / ``load_state_dict``): the
    inner step count, the outer optimizer's state and the parameters at each fragment's last sync (this rank's
    shards). ``torchdist_ext.checkpoint.save(..., diloco=...)`` writes island 0's model, inner and outer
    state; ``load(..., diloco=...)`` reads them at any island count and any layout inside the islands (every
    island resumes as island 0).
    """

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer, *, island_mesh: DeviceMesh,
                 sync_every: int, outer_optimizer: Callable[[list], torch.optim.Optimizer] | None = None,
                 fragments: int = 1, outer_dtype: torch.dtype = torch.float32):
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad] if isinstance(model, nn.Module) else []

        def validate():
            if not isinstance(model, nn.Module):
                raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
            if not isinstance(inner_optimizer, torch.optim.Optimizer):
                raise TypeError(f"inner_optimizer must be a torch.optim.Optimizer, got "
                                f"{type(inner_optimizer).__name__}")
            if not isinstance(island_mesh, DeviceMesh) or island_mesh.ndim != 1:
                raise TypeError(f"island_mesh must be a 1-D DeviceMesh, got {island_mesh!r}")
            for name, value in (("sync_every", sync_every), ("fragments", fragments)):
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"{name} must be an int >= 1, got {value!r}")
            if fragments > len(self.params):
                raise ValueError(f"fragments={fragments} must not exceed the model's {len(self.params)} parameters")
            if fragments > sync_every:
                raise ValueError(f"fragments={fragments} must not exceed sync_every={sync_every}: the fragments "
                                 f"sync at distinct steps of each period")
            if outer_dtype not in OUTER_DTYPES:
                raise ValueError(f"outer_dtype must be one of {[str(d) for d in OUTER_DTYPES]}, got {outer_dtype!r}")

        # The schedule is every rank's (collective over the default group: every rank of every island builds
        # its DiLoCo); the parameters' shards are those of the same rank in each island, and a mismatch found
        # in one island group is raised on every rank (the others would wait for it in their first collective).
        check_agreement(None, "DiLoCo", lambda: {"sync_every": sync_every, "fragments": fragments,
                                                 "outer_dtype": outer_dtype}, validate)
        self.islands = MeshGroup.of(island_mesh, "island_mesh")
        mismatch = None
        try:
            check_agreement(self.islands.mesh.get_group(), "DiLoCo",
                            lambda: {"parameters": [tuple(_local(p).shape) for p in self.params]})
        except ValueError as error:
            mismatch = error

        def shards_agree():
            if mismatch is not None:
                raise mismatch

        check_agreement(None, "DiLoCo", {}, shards_agree)
        self.inner, self.sync_every, self.outer_dtype = inner_optimizer, sync_every, outer_dtype
        self.fragments = self._cut(fragments)
        self.outer = (outer_optimizer or nesterov)(self.params)
        # Every island starts from island 0's parameters (as the paper's replicas do; a model seeded per rank
        # would otherwise keep its difference through every sync).
        with torch.no_grad():
            for param in self.params:
                dist.broadcast(_local(param), group=self.islands.mesh.get_group(), group_src=0)
        self.synced = [_local(p).detach().clone() for p in self.params]
        self.inner_steps = 0
        # The ranks of island 0, which alone write checkpoints (new_group is collective over every rank).
        islands = [None] * dist.get_world_size()
        dist.all_gather_object(islands, self.islands.rank)
        self.first_island = dist.new_group([rank for rank, island in enumerate(islands) if island == 0])
        self.in_first_island = self.islands.rank == 0

    def synced_tensors(self) -> dict[str, Tensor]:
        """The parameters at their fragments' last sync, by the model's parameter names, laid out like the
        parameters (DTensors of this rank's shards where they are DTensors): what a checkpoint holds."""
        names = {id(p): name for name, p in self.model.named_parameters()}
        return {names[id(param)]: (DTensor.from_local(synced, param.device_mesh, param.placements, run_check=False,
                                                      shape=param.shape, stride=param.stride())
                                   if isinstance(param, DTensor) else synced)
                for param, synced in zip(self.params, self.synced)}

    def _cut(self, count: int) -> list[list[int]]:
        """Parameter indices of ``count`` fragments of consecutive parameters, of about equal element counts
        (each at least one parameter)."""
        sizes = [p.numel() for p in self.params]
        total, bounds, running = sum(sizes), [0], 0
        for index, size in enumerate(sizes[:-1]):
            running += size
            cuts_left, params_left = count - len(bounds), len(sizes) - index - 1
            if cuts_left > 0 and (running >= total * len(bounds) / count or params_left == cuts_left):
                bounds.append(index + 1)
        bounds.append(len(sizes))
        return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]

    def step(self) -> int | None:
        """The inner optimizer's step, then the sync of the fragment due at this step (if any): returns its index."""
        self.inner.step()
        self.inner_steps += 1
        phase = self.inner_steps % self.sync_every
        for index in range(len(self.fragments)):
            if phase == (index * self.sync_every) // len(self.fragments):
                self._sync(index)
                return index
        return None

    @torch.no_grad()
    def _sync(self, index: int) -> None:
        members = self.fragments[index]
        averages = [self._average(self.synced[i] - _local(self.params[i])) for i in members]
        previous_grads = [param.grad for param in self.params]
        for param in self.params:
            param.grad = None  # the outer optimizer steps this fragment only
        for i, average in zip(members, averages):
            param = self.params[i]
            _local(param).copy_(self.synced[i])
            param.grad = (DTensor.from_local(average, param.device_mesh, param.placements, run_check=False,
                                             shape=param.shape, stride=param.stride())
                          if isinstance(param, DTensor) else average)
        self.outer.step()
        for param, grad in zip(self.params, previous_grads):
            param.grad = grad
        for i in members:
            self.synced[i].copy_(_local(self.params[i]))

    def _average(self, pseudo: Tensor) -> Tensor:
        """The mean of ``pseudo`` (this island's pseudo-gradient shard) over the islands, as ``outer_dtype`` carries
        it; fp32."""
        group, n = self.islands.mesh.get_group(), self.islands.size
        device = collective_device(group)
        if self.outer_dtype == torch.float32:
            carried = pseudo.float().to(device, copy=True)
            dist.all_reduce(carried, group=group)
            return (carried / n).to(pseudo.device)
        scale = 1.0
        if self.outer_dtype == torch.float8_e4m3fn:
            amax = pseudo.abs().amax().float().reshape(1) if pseudo.numel() else torch.zeros(1)
            amax = amax.to(device)
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
            scale = 448.0 / amax.item() if amax.item() > 0 else 1.0
        encoded = (pseudo.float() * scale).to(self.outer_dtype).flatten().view(torch.uint8).to(device)
        gathered = torch.empty(n * encoded.numel(), dtype=torch.uint8, device=device)
        dist.all_gather_into_tensor(gathered, encoded, group=group)
        decoded = gathered.view(self.outer_dtype).float().view(n, *pseudo.shape) / scale
        return decoded.mean(0).to(pseudo.device)

    def state_dict(self) -> dict:
        return {"inner_steps": self.inner_steps, "outer": self.outer.state_dict(),
                "synced": [t.clone() for t in self.synced]}

    def load_state_dict(self, state: dict) -> None:
        if len(state["synced"]) != len(self.synced):
            raise ValueError(f"the state holds {len(state['synced'])} synced parameters, this model "
                             f"{len(self.synced)}")
        self.inner_steps = int(state["inner_steps"])
        self.outer.load_state_dict(state["outer"])
        for mine, saved in zip(self.synced, state["synced"]):
            mine.copy_(saved)

    def __repr__(self) -> str:
        return (f"DiLoCo(islands={self.islands.size}, sync_every={self.sync_every}, "
                f"fragments={len(self.fragments)}, outer_dtype={self.outer_dtype}, outer={type(self.outer).__name__})")

