"""Moving a replicated tensor in and out of a sharded computation, with gradients.

Tests compute a reference on full tensors that every rank holds identically
(same seed), shard them, run the parallel code and gather the results back.
For gradients to compare too, both moves keep the *replicated* convention:
a replicated tensor's gradient is the same full tensor on every rank. They
are the tensor-parallel regions' scatter and gather, so gradients of any
order flow through.

    shard_replicated(x, *, mesh, dim)    forward: this rank's torch.chunk block of x
                                         backward: all-gather of the blocks' grads
    gather_replicated(x, *, mesh, dim)   forward: all-gather of the blocks
                                         backward: this rank's block of the grad
"""

from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from torchdist_ext.parallel.mesh_group import MeshGroup
from torchdist_ext.parallel.regions import gather_from_region, scatter_to_region

__all__ = ["shard_replicated", "gather_replicated"]


def shard_replicated(x: Tensor, *, mesh: DeviceMesh, dim: int) -> Tensor:
    """This rank's block of the replicated ``x`` along ``dim`` over the 1-D ``mesh`` (size divisible by it)."""
    return scatter_to_region(x, MeshGroup.of(mesh, "mesh"), dim)


def gather_replicated(x: Tensor, *, mesh: DeviceMesh, dim: int) -> Tensor:
    """The replicated concatenation of every rank's equal-sized block ``x`` along ``dim`` over the 1-D ``mesh``."""
    return gather_from_region(x, MeshGroup.of(mesh, "mesh"), dim)
