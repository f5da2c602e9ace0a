"""Parallel layers' parameters: DTensors on their axis's mesh, from full tensors."""

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Shard, distribute_tensor

from torchdist_ext.parallel.mesh_group import MeshGroup

__all__ = ["distribute_parameter"]


def distribute_parameter(full: torch.Tensor, group: MeshGroup, placement: Placement,
                         src_data_rank: int | None) -> nn.Parameter:
    """A DTensor parameter on ``group.mesh`` from the full tensor.

    ``src_data_rank=0`` takes rank 0's values (a scatter/broadcast: all ranks
    agree whatever they drew); ``None`` slices each rank's own copy without
    communicating (every rank must hold the same full tensor). Meta tensors
    stay meta, with the right local shape.
    """
    if full.is_meta:
        # (contiguous, as a sharded real tensor's local part is: FSDP2 requires it)
        local = full.chunk(group.size, dim=placement.dim)[group.rank].contiguous() if isinstance(placement, Shard) \
            else full
        dtensor = DTensor.from_local(local, group.mesh, [placement], run_check=False, shape=full.shape,
                                     stride=full.stride())
    else:
        dtensor = distribute_tensor(full, group.mesh, [placement], src_data_rank=src_data_rank)
    return nn.Parameter(dtensor)
