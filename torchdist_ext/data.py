"""Sampling the dataset by data-parallel rank: each dp rank its own samples, the tp/cp/pp ranks of one
data-parallel replica the same ones, a new order every epoch without ``set_epoch``, resumable at another dp size.

    sampler = DataParallelSampler(len(dataset), dp_mesh=mesh["dp"], batch_size=per_rank_batch, seed=0)
    loader = DataLoader(dataset, batch_size=per_rank_batch, sampler=sampler)
    for tokens in loader:
        ...
        sampler.advance()                # one global batch consumed (what state_dict saves)
"""

import hashlib
import numbers
from collections.abc import Iterator, Mapping

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import Sampler

__all__ = ["DataParallelSampler"]


_STATE_KEYS = ("epoch", "position", "seed", "num_samples")


def _check_int(name: str, value, minimum: int, maximum: int | None = None) -> int:
    """``value`` as an int: any integral number (numpy's included; not a bool or a tensor), in range."""
    if isinstance(value, (bool, torch.Tensor)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r}")
    value = int(value)
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be an int {bound}, got {value!r}")
    return value


def _epoch_seed(seed: int, epoch: int) -> int:
    """A generator seed for (seed, epoch): distinct pairs give unrelated orders (a sum would give seed s's epoch
    e + 1 the order of seed s + 1's epoch e)."""
    digest = hashlib.blake2b(f"{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # torch seeds are below 2**63


class DataParallelSampler(Sampler[int]):
    """Indices of this data-parallel rank's samples.

    Epoch ``e``'s order is one permutation of the whole dataset (seeded by ``seed`` and ``e``, the same on every
    rank), read in global batches of ``batch_size x d`` samples: rank ``r`` of ``d`` takes the ``r``-th
    ``batch_size`` of each (as ``global_batch.chunk(d)[r]``), so one process reading global batches reads the
    same rows in the same order. Iterating the sampler again starts the next epoch (``set_epoch`` is optional).
    ``state_dict()`` holds the epoch and the position (samples the whole data-parallel world has consumed this
    epoch, counted by ``advance``), so a run can resume at another dp size with the same global batch exactly
    where it stopped.

    Args:
        num_samples: the dataset's length.
        dp_mesh: the 1-D mesh of the data-parallel ranks (None: one rank).
        batch_size: samples per rank and step (the DataLoader's).
        shuffle: a new permutation per epoch (False: 0, 1, 2, ... every epoch).
        seed: an int >= 0 that, with the epoch, seeds each epoch's permutation.
        drop_last: drop the epoch's last, incomplete global batch (False: complete it with the epoch's first
            samples).
    """

    def __init__(self, num_samples: int, *, dp_mesh: DeviceMesh | None = None, batch_size: int = 1,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False):
        self.num_samples = _check_int("num_samples", num_samples, 1)
        if dp_mesh is not None and (not isinstance(dp_mesh, DeviceMesh) or dp_mesh.ndim != 1):
            raise TypeError(f"dp_mesh must be a 1-D DeviceMesh of the data-parallel ranks, got {dp_mesh!r}")
        self.dp_size = 1 if dp_mesh is None else dp_mesh.size()
        self.dp_rank = 0 if dp_mesh is None else dp_mesh.get_local_rank()
        self.batch_size = _check_int("batch_size", batch_size, 1)
        self.global_batch = self.batch_size * self.dp_size
        if drop_last and num_samples < self.global_batch:
            raise ValueError(f"num_samples {num_samples} must be at least one global batch (batch_size "
                             f"{batch_size} x dp {self.dp_size}) with drop_last=True")
        for name, flag in (("shuffle", shuffle), ("drop_last", drop_last)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        self.shuffle, self.seed, self.drop_last = shuffle, _check_int("seed", seed, 0), drop_last
        self.epoch = 0  # the epoch being read (or, before the first iteration, to be read)
        self.position = 0  # samples of it the whole dp world has consumed (advance)
        self._continue = True  # the next iteration reads self.epoch from self.position, not the next epoch

    def epoch_length(self) -> int:
        """Samples per epoch over all dp ranks: whole global batches (the dataset rounded down with
        drop_last, else up)."""
        b = self.global_batch
        return self.num_samples // b * b if self.drop_last else -(-self.num_samples // b) * b

    def __len__(self) -> int:
        """Samples this rank reads in the next iteration."""
        start = self.position if self._continue else 0
        return (self.epoch_length() - start) // self.dp_size

    def __iter__(self) -> Iterator[int]:
        if not self._continue:
            self.epoch, self.position = self.epoch + 1, 0
        self._continue = False
        if self.shuffle:
            generator = torch.Generator().manual_seed(_epoch_seed(self.seed, self.epoch))
            order = torch.randperm(self.num_samples, generator=generator)
        else:
            order = torch.arange(self.num_samples)
        length = self.epoch_length()
        order = order.repeat(-(-length // self.num_samples))[self.position : length]
        return iter(order.view(-1, self.dp_size, self.batch_size)[:, self.dp_rank].flatten().tolist())

    def advance(self, global_batches: int = 1) -> None:
        """Records that the whole dp world consumed ``global_batches`` more global batches of the epoch being
        read (call it after each step): the position ``state_dict`` saves."""
        _check_int("global_batches", global_batches, 0)
        if self.position + global_batches * self.global_batch > self.epoch_length():
            raise ValueError(f"global_batches {global_batches} goes past the end of epoch {self.epoch} "
                             f"({self.position} of {self.epoch_length()} samples consumed)")
        self.position += global_batches * self.global_batch

    def set_epoch(self, epoch: int) -> None:
        """Reads ``epoch`` next, from its start (optional: each iteration starts the next epoch itself)."""
        self.epoch, self.position, self._continue = _check_int("epoch", epoch, 0), 0, True

    def state_dict(self) -> dict[str, int]:
        """The epoch being read, the samples of it the dp world consumed (``advance``), and the seed and
        dataset length that ``load_state_dict`` checks."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continues where ``state`` was saved, at any dp size whose global batch divides the position: the next
        iteration reads the rest of that epoch, or the next epoch when it was read to its end."""
        if not isinstance(state, Mapping) or any(key not in state for key in _STATE_KEYS):
            raise ValueError(f"state must be a mapping with the keys {', '.join(_STATE_KEYS)} (state_dict()), got "
                             f"{state!r}")
        for key in ("seed", "num_samples"):
            if state[key] != getattr(self, key):
                raise ValueError(f"state {key} {state[key]!r} differs from this sampler's {getattr(self, key)!r}: "
                                 f"it would continue another order")
        epoch = _check_int("state epoch", state["epoch"], 0)
        position = _check_int("state position", state["position"], 0)
        if position % self.global_batch:
            raise ValueError(f"state position {position} must be divisible by the global batch {self.global_batch} "
                             f"(batch_size {self.batch_size} x dp {self.dp_size})")
        if position > self.epoch_length():
            raise ValueError(f"state position {position} is past the epoch's {self.epoch_length()} samples")
        if position == self.epoch_length():
            epoch, position = epoch + 1, 0
        self.epoch, self.position, self._continue = epoch, position, True
