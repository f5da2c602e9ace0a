"""What a forward leaves alive for its backward, measured by storage, on any device.

    with RetainedMemory() as meter:
        out = block(x)
    meter.retained_bytes()      # bytes of the storages the ops inside created that are still alive

Every storage an op inside the context creates is recorded (each storage once, however many views of it
exist); ``retained_bytes`` sums those still alive when it is called. Right after a forward that is what
autograd, activation recompute's caches and the caller hold: the saved activations plus the outputs the
caller keeps. It sees through tensor subclasses whose data is a plain tensor (DTensor's local shard), and
through ``torch.utils.checkpoint``'s selective caches (their outputs are created inside). Tensors created
before the context (a block's input) are not counted: measure two stacked blocks and one, and take the
difference, to count a block's own input too.
"""

import gc

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["RetainedMemory"]


def _plain(tensor: torch.Tensor) -> torch.Tensor | None:
    """The plain tensor holding ``tensor``'s data (a subclass's one inner tensor), or None."""
    if type(tensor) is torch.Tensor or isinstance(tensor, torch.nn.Parameter):
        return tensor
    if hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        if len(names) == 1:
            return _plain(getattr(tensor, names[0]))
    return None


class RetainedMemory(TorchDispatchMode):
    """Records the storages created by the ops run inside it; ``retained_bytes()`` is the bytes of those still
    alive (what a forward keeps for its backward, its output included). Takes no arguments:
    ``with RetainedMemory() as meter: out = layer(x)``, then ``meter.retained_bytes()``."""

    def __init__(self):
        super().__init__()
        self._storages: dict[tuple[torch.device, int], tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {self._key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            key = self._key(tensor) if isinstance(tensor, torch.Tensor) else None
            # An in-place op or a view returns a storage it was given: not a new one. A recorded address whose
            # storage died may hold a new one.
            if key is None or key in inputs or (key in self._storages and not self._storages[key][0].expired()):
                continue
            storage = _plain(tensor).untyped_storage()
            self._storages[key] = (StorageWeakRef(storage), storage.nbytes())
        return out

    @staticmethod
    def _key(tensor: torch.Tensor) -> tuple[torch.device, int] | None:
        plain = _plain(tensor)
        if plain is None or plain.device.type == "meta":
            return None
        return plain.device, plain.untyped_storage().data_ptr()

    def retained_bytes(self) -> int:
        """Bytes of the recorded storages still alive once unreachable reference cycles are collected."""
        gc.collect()
        return sum(nbytes for ref, nbytes in self._storages.values() if not ref.expired())
