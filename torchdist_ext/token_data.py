"""Token files: a tokenised corpus as one flat array of token ids on disk (NumPy's ``.npy``, uint16 or uint32,
memory-mapped), documents separated by an end-of-document id, with its vocabulary beside it (``FILE.json``);
read as windows of ``seq_len + 1`` tokens (a sequence and its next-token targets).

    write_token_file("corpus.npy", documents, vocab_size=32000, eos_id=2)   # documents: lists of ids
    windows = TokenWindows("corpus.npy", seq_len=2048)
    rows = windows[[0, 5, 9]]               # [3, 2049] int64, read from disk
    documents = windows.document_ids(rows)  # [3, 2049]: 0, 1, 2, ... counting the separators before each token

``examples/prepare_data.py`` writes one from text files with a local Hugging Face tokenizer (or bytes).
"""

import json
import os
from collections.abc import Iterable, Sequence

import numpy as np
import torch

__all__ = ["TokenWindows", "write_token_file"]


def _meta_path(path: str | os.PathLike) -> str:
    return os.path.splitext(os.fspath(path))[0] + ".json"


def write_token_file(path: str | os.PathLike, documents: Iterable[Sequence[int]], *, vocab_size: int,
                     eos_id: int, tokenizer: str = "") -> int:
    """Writes ``documents`` (each a sequence of token ids in ``[0, vocab_size)``), each followed by ``eos_id``,
    to ``path`` (``.npy``: uint16 when ``vocab_size <= 65536``, else uint32) and ``vocab_size``, ``eos_id`` and
    ``tokenizer`` (a description) to the ``.json`` beside it. Returns the number of tokens written."""
    if not isinstance(vocab_size, int) or not 1 <= vocab_size <= 2**32:
        raise ValueError(f"vocab_size must be an int in [1, 2**32], got {vocab_size!r}")
    if not isinstance(eos_id, int) or not 0 <= eos_id < vocab_size:
        raise ValueError(f"eos_id must be an int in [0, vocab_size={vocab_size}), got {eos_id!r}")
    dtype = np.uint16 if vocab_size <= 2**16 else np.uint32
    parts = []
    for index, document in enumerate(documents):
        ids = np.asarray(document, dtype=np.int64)
        if ids.ndim != 1:
            raise ValueError(f"document {index} must be a flat sequence of token ids, got shape {ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"document {index} holds token ids outside [0, vocab_size={vocab_size}): "
                             f"{int(ids.min())} .. {int(ids.max())}")
        parts.extend((ids.astype(dtype), np.array([eos_id], dtype=dtype)))
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
    np.save(path, tokens, allow_pickle=False)
    with open(_meta_path(path), "w") as meta:
        json.dump({"vocab_size": vocab_size, "eos_id": eos_id, "tokenizer": tokenizer, "tokens": int(tokens.size)},
                  meta)
    return int(tokens.size)


class TokenWindows:
    """The token file ``path`` (``write_token_file``'s) cut into ``len(self)`` consecutive windows of
    ``seq_len + 1`` tokens (the tail shorter than a window is left out), memory-mapped: indexing reads only the
    rows asked for. ``vocab_size`` and ``eos_id`` come from the file's ``.json``."""

    def __init__(self, path: str | os.PathLike, seq_len: int):
        if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
            raise ValueError(f"seq_len must be an int >= 1, got {seq_len!r}")
        try:
            with open(_meta_path(path)) as meta:
                info = json.load(meta)
            self.vocab_size, self.eos_id = int(info["vocab_size"]), int(info["eos_id"])
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ValueError(f"token file {os.fspath(path)}: its {_meta_path(path)} (vocab_size, eos_id) "
                             f"could not be read: {error}") from None
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as error:
            raise ValueError(f"token file {os.fspath(path)} could not be read as .npy: {error}") from None
        if tokens.ndim != 1 or tokens.dtype not in (np.uint16, np.uint32):
            raise ValueError(f"token file {os.fspath(path)} must hold a flat uint16 or uint32 array, got "
                             f"{tokens.dtype} of shape {tokens.shape}")
        self.seq_len = seq_len
        count = tokens.size // (seq_len + 1)
        if count == 0:
            raise ValueError(f"token file {os.fspath(path)} holds {tokens.size} tokens: fewer than one window "
                             f"of seq_len + 1 = {seq_len + 1}")
        self._rows = tokens[: count * (seq_len + 1)].reshape(count, seq_len + 1)

    def __len__(self) -> int:
        return self._rows.shape[0]

    def __getitem__(self, rows) -> torch.Tensor:
        """The windows ``rows`` (an index, a list or a 1-D tensor of indices): ``[len(rows), seq_len + 1]``
        int64 (one window: ``[seq_len + 1]``)."""
        if isinstance(rows, torch.Tensor):
            rows = rows.tolist()
        return torch.from_numpy(self._rows[rows].astype(np.int64))

    def document_ids(self, windows: torch.Tensor) -> torch.Tensor:
        """For windows ``[..., seq_len + 1]`` of token ids: each token's document within its window, the
        number of ``eos_id`` tokens before it (a separator belongs to the document it ends)."""
        ends = (windows == self.eos_id).long()
        return ends.cumsum(-1) - ends
