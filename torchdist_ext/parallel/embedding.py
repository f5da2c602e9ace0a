"""Vocab-parallel embedding: the table split by rows (tokens) over the tensor-parallel group."""

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from torchdist_ext._index_checks import index_checks_enabled
from torchdist_ext.agreement import check_agreement
from torchdist_ext.parallel.input_checks import check_divisible, check_floating_dtype, sequence_dim
from torchdist_ext.parallel.mesh_group import MeshGroup
from torchdist_ext.parallel.parameters import distribute_parameter
from torchdist_ext.parallel.regions import reduce_from_region, reduce_scatter_to_sequence_region
from torchdist_ext._weight_grad import SplitsWeightGrad, split_embedding

__all__ = ["VocabParallelEmbedding"]


class VocabParallelEmbedding(SplitsWeightGrad, nn.Module):
    """``nn.Embedding`` with rows ``[r * V/tp, (r+1) * V/tp)`` on tensor-parallel rank r.

    Every rank looks up the ids that fall in its rows (zeros elsewhere) and the
    partial results are summed: all-reduced, or with ``sequence_parallel=True``
    reduce-scattered along ``seq_dim`` so that the output enters a
    sequence-parallel region directly.

    Args:
        num_embeddings: vocabulary size V, divisible by tp.
        embedding_dim: D.
        padding_idx: as ``nn.Embedding``: that row starts at zero and gets no gradient
            (on the rank that holds it).
        tp_mesh: 1-D DeviceMesh of the tensor-parallel group.
        sequence_parallel, seq_dim: as for the parallel linears.

    An id outside ``[0, V)`` raises a ``ValueError`` naming its position while index checks are
    on (``torchdist_ext.set_index_checks``, the default; one sync on a GPU), else its row comes
    out NaN, never a plausible vector (as also under ``torch.compile``, where the check is skipped).

    Shapes:
        input  integer ids ``[batch, seq]`` (any shape), replicated, values in ``[0, V)``
        output ``[batch, seq, D]`` replicated, or ``[.., S/tp, .., D]`` with sequence_parallel
    Parameters: ``weight`` DTensor ``[V, D]`` ``Shard(0)``, initialised N(0, 1) like nn.Embedding.
    ``split_weight_grad = True`` (a zero-bubble pipeline sets it) defers the weight gradient (all of the
    backward) to W.
    """


    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_mesh: DeviceMesh,
                 sequence_parallel: bool = False, seq_dim: int = 1, padding_idx: int | None = None,
                 device=None, dtype=None):
        super().__init__()
        check_floating_dtype(dtype)
        self.tp = MeshGroup.of(tp_mesh)
        for arg, value in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{arg} must be a positive int, got {value!r}")
        check_divisible("num_embeddings", num_embeddings, self.tp)
        if padding_idx is not None:
            if not isinstance(padding_idx, int) or not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(
                    f"padding_idx must be an int in [-num_embeddings, num_embeddings) = "
                    f"[{-num_embeddings}, {num_embeddings}), got {padding_idx!r}"
                )
            padding_idx %= num_embeddings
        self.padding_idx = padding_idx
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.sequence_parallel = bool(sequence_parallel)
        self.seq_dim = seq_dim
        rows_per_rank = num_embeddings // self.tp.size
        self.vocab_start = self.tp.rank * rows_per_rank
        # The padding row's index among this rank's rows, if they hold it.
        self._local_padding_idx = None
        if padding_idx is not None and 0 <= padding_idx - self.vocab_start < rows_per_rank:
            self._local_padding_idx = padding_idx - self.vocab_start
        weight = torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype)
        if not weight.is_meta:
            nn.init.normal_(weight)
            if padding_idx is not None:
                weight[padding_idx].zero_()
        self.weight = distribute_parameter(weight, self.tp, Shard(0), src_data_rank=0)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, *, tp_mesh: DeviceMesh, **kwargs) -> "VocabParallelEmbedding":
        """The parallel layer holding ``embedding``'s table (every rank passes the same module)."""
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(f"embedding must be an nn.Embedding, got {type(embedding).__name__}")
        for option, value, default in (("max_norm", embedding.max_norm, None),
                                       ("scale_grad_by_freq", embedding.scale_grad_by_freq, False),
                                       ("sparse", embedding.sparse, False)):
            if value != default:
                raise ValueError(f"embedding.{option}={value!r} is not supported by VocabParallelEmbedding "
                                 f"(only {default!r})")
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, tp_mesh=tp_mesh,
                    padding_idx=embedding.padding_idx, device="meta", dtype=embedding.weight.dtype, **kwargs)
        layer.weight = distribute_parameter(embedding.weight.detach(), layer.tp, Shard(0), src_data_rank=None)
        return layer

    def forward(self, ids: Tensor) -> Tensor:
        checked = not torch.compiler.is_compiling() and index_checks_enabled()
        # every tp rank learns of one rank's bad input
        check_agreement(self.tp.name, "VocabParallelEmbedding", lambda: {"input": ids},
                        lambda: self._check_input(ids, index_checks=checked))
        weight = self.weight.to_local()
        local_ids = ids - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= weight.shape[0])
        if self.split_weight_grad:
            rows = split_embedding(local_ids.masked_fill(outside, 0), weight, self, self._local_padding_idx)
        else:
            rows = F.embedding(local_ids.masked_fill(outside, 0), weight, padding_idx=self._local_padding_idx)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0)
        if not checked and self.tp.rank == 0:
            # An id outside the vocabulary is outside every rank's rows: NaN on one rank makes the sum NaN.
            invalid = (ids < 0) | (ids >= self.num_embeddings)
            rows = rows.masked_fill(invalid.unsqueeze(-1), float("nan"))
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_region(rows, self.tp, sequence_dim(rows, self.seq_dim))
        return reduce_from_region(rows, self.tp)

    def _check_input(self, ids: Tensor, *, index_checks: bool) -> None:
        """Raises TypeError for ids that are not an integer tensor, ValueError for an id out of the vocabulary
        (with ``index_checks``) or, with sequence parallelism, a sequence the tp ranks cannot split."""
        if not isinstance(ids, Tensor) or ids.dtype not in (torch.int64, torch.int32):
            got = getattr(ids, "dtype", type(ids))
            raise TypeError(f"input must be an int64 or int32 tensor of token ids, got {got}")
        invalid = (ids < 0) | (ids >= self.num_embeddings)
        if index_checks and invalid.any():
            position = invalid.flatten().nonzero()[0].item()
            raise ValueError(
                f"input ids must lie in [0, num_embeddings={self.num_embeddings}); input (flattened)[{position}] "
                f"= {ids.flatten()[position].item()} (torchdist_ext.set_index_checks(False) skips this check: "
                "such rows then come out NaN)"
            )
        if self.sequence_parallel:
            dim = sequence_dim(ids.unsqueeze(-1), self.seq_dim)
            check_divisible(f"input.size({dim})", ids.shape[dim], self.tp)

    def extra_repr(self) -> str:
        padding = "" if self.padding_idx is None else f", padding_idx={self.padding_idx}"
        return (f"{self.num_embeddings}, {self.embedding_dim}{padding}, tp={self.tp.size}, "
                f"sequence_parallel={self.sequence_parallel}, seq_dim={self.seq_dim}")
