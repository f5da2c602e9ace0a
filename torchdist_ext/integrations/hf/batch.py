"""The batches a parallelised HF model takes: sequence shards, document ids, the global count of target tokens."""

from collections.abc import Callable, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from torchdist_ext import _collectives as collectives
from torchdist_ext.agreement import check_agreement
from torchdist_ext.parallel import balanced_sequence_plan, shard_sequence
from torchdist_ext.parallel.sequence_sharding import ORDERS, context_parallel_groups

__all__ = ["HF_ORDERS", "IGNORE_INDEX", "check_hf_order", "document_ids_from", "global_num_items", "shard_hf_batch"]

# The cp orders of a parallelised HF model: shard_sequence's, or "balanced": each batch's balanced_sequence_plan.
HF_ORDERS = (*ORDERS, "balanced")

IGNORE_INDEX = -100
_BATCH_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")


def document_ids_from(position_ids: Tensor, attention_mask: Tensor | None, batch: int) -> Tensor:
    """``[batch, seq]`` int64 document ids: a position that is not its predecessor + 1 starts a new
    document (HF's packed-sequence rule); tokens where ``attention_mask`` is 0 get -1 (padding)."""
    position_ids = position_ids.expand(batch, -1)
    starts = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1) != 1
    ids = starts.long().cumsum(-1)
    return ids if attention_mask is None else ids.masked_fill(attention_mask == 0, -1)


def shifted_labels(labels: Tensor) -> Tensor:
    """HF's causal-LM targets: ``labels`` moved one position left, ``IGNORE_INDEX`` at the end of each row."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def check_hf_order(order: str, arg: str = "order") -> None:
    if order not in HF_ORDERS:
        raise ValueError(f"{arg} must be one of {HF_ORDERS}, got {order!r}")


def shard_hf_batch(batch: dict, *, cp_mesh: DeviceMesh, order: str = "zigzag") -> dict:
    """This rank's part of the batch a user would pass to the single-process model.

    ``batch``: ``input_ids`` ``[batch, seq]``, optional ``labels`` (unshifted, HF's convention, -100
    ignored), ``attention_mask`` (2-D padding mask) and ``position_ids``. Returns ``input_ids``,
    ``position_ids`` (global), ``document_ids`` (padding and packed documents; None when every row is
    one document without padding), and with labels ``labels`` / ``shift_labels`` (shifted over the
    whole sequence before sharding): all sharded along the sequence like
    ``shard_sequence(x, cp_mesh=cp_mesh, dim=1, order=order)``; and ``cp_order``, which the model checks
    against its own. The loss counts the target tokens over every data- and context-parallel rank itself.

    ``order="balanced"`` shards by the ``balanced_sequence_plan`` of the rows' documents (a ring plan over a
    1-D ``cp_mesh``, which serves Ulysses too; a hybrid plan over a 2-D ``[ring, ulysses]`` one), so packed
    documents of any lengths give every cp rank the same attention work, and adds ``cp_positions``
    ``[batch, seq_local]``: the tokens' places in their rows, which the attention's causal mask compares.
    """
    check_hf_order(order)
    if order != "balanced":
        def sharder(document_ids: Tensor):
            return lambda x: shard_sequence(x.contiguous(), cp_mesh=cp_mesh, dim=1, order=order), {}
    else:
        def sharder(document_ids: Tensor):
            ring, ulysses = context_parallel_groups(cp_mesh)
            cp_size, method = (ring.size, "ring") if ulysses is None else ((ring.size, ulysses.size), "hybrid")
            plan = balanced_sequence_plan(document_ids.cpu(), cp_size, method=method)
            positions = plan.positions(cp_mesh=cp_mesh).to(document_ids.device)
            return lambda x: plan.shard(x.contiguous(), dim=1, cp_mesh=cp_mesh), {"cp_positions": positions}
    return prepare_batch(batch, sharder, order)


def prepare_batch(batch: dict, sharder: Callable[[Tensor], tuple[Callable[[Tensor], Tensor], dict]],
                  order: str | None) -> dict:
    """``shard_hf_batch``'s work with ``sharder(document_ids)``: a shard of any ``[batch, seq]`` tensor (the
    identity without context parallelism) and the entries it adds to the result; ``cp_order`` is ``order``."""
    if not isinstance(batch, Mapping):
        raise TypeError(f"batch must be a mapping of tensors (a dict, a tokenizer's BatchEncoding), got "
                        f"{type(batch).__name__}")
    unknown = sorted(set(batch) - set(_BATCH_KEYS))
    if unknown:
        raise ValueError(f"batch has keys {unknown} that shard_hf_batch does not know how to shard; it takes "
                         f"{list(_BATCH_KEYS)}")
    input_ids = batch.get("input_ids")
    if not isinstance(input_ids, Tensor):
        raise TypeError(f"batch['input_ids'] must be a tensor, got {type(input_ids).__name__}")
    if input_ids.dim() != 2:
        raise ValueError(f"batch['input_ids'] must be [batch, seq], got shape {tuple(input_ids.shape)}")
    size, seq = input_ids.shape
    for key in ("labels", "attention_mask", "position_ids"):
        value = batch.get(key)
        if value is None:
            continue
        if not isinstance(value, Tensor):
            raise TypeError(f"batch[{key!r}] must be a tensor, got {type(value).__name__}")
        allowed = ((size, seq), (1, seq)) if key == "position_ids" else ((size, seq),)
        if tuple(value.shape) not in allowed:
            raise ValueError(f"batch[{key!r}] has shape {tuple(value.shape)}; it must be [batch, seq] = "
                             f"{[size, seq]} like input_ids")
    position_ids = batch.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(seq, device=input_ids.device)[None]
    position_ids = position_ids.expand(size, -1)
    document_ids = document_ids_from(position_ids, batch.get("attention_mask"), size)
    shard, extra = sharder(document_ids)
    local = {
        "input_ids": shard(input_ids),
        "position_ids": shard(position_ids),
        # One document per row and no padding: plain causal attention, one block call over the batch.
        "document_ids": None if bool((document_ids == 0).all()) else shard(document_ids),
        "cp_order": order,
        **extra,
    }
    labels = batch.get("labels")
    if labels is not None:
        local["labels"] = local["shift_labels"] = shard(shifted_labels(labels))
    return local


def global_num_items(model: nn.Module, batches: Iterable[Mapping]) -> Tensor:
    """HF's ``num_items_in_batch`` for a gradient-accumulation window of a ``parallelize_hf_model`` model: the
    target tokens (labels other than -100, after the shift) of ``batches`` (this rank's micro-batches as it
    feeds them to the model: ``shard_hf_batch``'s output under context parallelism) summed over the model's
    data- and context-parallel ranks. One scalar all-reduce; an int64 0-d tensor, the same on every rank.

    Pass it to each micro-batch's forward (``model(**batch, num_items_in_batch=n)``): each ``.loss`` is then
    that micro-batch's share of the window's loss, and the accumulated gradients are the single-process
    gradients of the whole window's loss. Without it each forward counts its own batch (one all-reduce)."""
    loss = getattr(model, "loss_function", None)
    data_group = getattr(loss, "data_group", False)
    if data_group is False:
        raise TypeError(f"global_num_items takes a model returned by parallelize_hf_model, got "
                        f"{type(model).__name__} without its loss")
    batches = list(batches)
    counts = []

    def validate():
        if not batches:
            raise ValueError("global_num_items needs at least one batch")
        for batch in batches:
            labels = batch.get("shift_labels")
            if labels is None:
                if batch.get("labels") is None:
                    raise ValueError("every batch given to global_num_items needs labels (or shard_hf_batch's "
                                     "shift_labels)")
                labels = shifted_labels(batch["labels"])
            counts.append((labels != IGNORE_INDEX).sum())

    # A rank that refuses its batches stops every rank of the group, before the all-reduce.
    check_agreement(None if data_group is None else data_group.name, "global_num_items", {}, validate)
    count = torch.stack(counts).sum()
    return count if data_group is None else collectives.all_reduce(count, data_group.name)
