"""HF's causal-LM loss on vocab-sharded logits and tokens spread over data- and context-parallel ranks."""

import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from torchdist_ext import _collectives as collectives
from torchdist_ext.integrations.hf.batch import IGNORE_INDEX
from torchdist_ext.parallel import vocab_parallel_cross_entropy
from torchdist_ext.parallel.mesh_group import MeshGroup
from torchdist_ext.parallel.regions import reduce_from_region

__all__ = ["ParallelCausalLMLoss"]


class ParallelCausalLMLoss:
    """HF's ``loss_function(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100,
    shift_labels=None, **kwargs)`` on vocab-sharded logits (over ``tp``) and tokens spread over the ranks of
    ``data_group`` (the data- and context-parallel ranks FSDP2 averages over): the sum of every rank's token
    losses over the global number of target tokens, the single-process model's loss, identical on every rank.

    ``num_items_in_batch``: the target tokens over ``data_group`` (and over a gradient-accumulation window:
    ``global_num_items``); None counts this batch's (one scalar all-reduce). Each rank's backward gives its
    part of the single-process gradient (the sum's backward is the identity), at the single-process
    magnitude (what fp8's gradient casts see); FSDP2 sums the parts (``parallelize_hf_model`` sets its divide
    factor to 1).
    """

    def __init__(self, tp: MeshGroup | None, tp_mesh: DeviceMesh | None, data_group: MeshGroup | None,
                 context_parallel: bool):
        self.tp, self.tp_mesh, self.data_group, self.context_parallel = tp, tp_mesh, data_group, context_parallel

    def __call__(self, logits: Tensor, labels: Tensor, vocab_size: int | None = None,
                 num_items_in_batch: Tensor | int | None = None, ignore_index: int = IGNORE_INDEX,
                 shift_labels: Tensor | None = None, **kwargs) -> Tensor:
        if shift_labels is None:
            if self.context_parallel:
                raise ValueError("under context parallelism the labels are shifted before sharding: pass the batch "
                                 "through shard_hf_batch")
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        shift_labels = shift_labels.to(logits.device)
        logits = logits.float()
        if self.tp is not None:
            total = vocab_parallel_cross_entropy(logits, shift_labels, tp_mesh=self.tp_mesh,
                                                 ignore_index=ignore_index, reduction="sum")
        else:
            total = F.cross_entropy(logits.flatten(0, -2), shift_labels.flatten(), ignore_index=ignore_index,
                                    reduction="sum")
        count = num_items_in_batch
        if count is None:
            count = (shift_labels != ignore_index).sum()
            if self.data_group is not None:
                count = collectives.all_reduce(count, self.data_group.name)
        if self.data_group is not None:
            total = reduce_from_region(total, self.data_group)
        if isinstance(count, Tensor):
            count = count.to(total.device)
        return total / count
