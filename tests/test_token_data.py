"""Token files: write_token_file and TokenWindows read back the documents with their separators, windows by
index from the memory map, document ids within a window, and refuse what they cannot read."""

import json

import numpy as np
import pytest
import torch

from torchdist_ext.token_data import TokenWindows, write_token_file


def test_windows_hold_the_documents_and_their_separators(tmp_path):
    path = tmp_path / "corpus.npy"
    documents = [[5, 6, 7], [8], [], [9, 10]]
    assert write_token_file(path, documents, vocab_size=11, eos_id=0, tokenizer="test") == 10
    flat = [5, 6, 7, 0, 8, 0, 0, 9, 10, 0]
    assert np.load(path).dtype == np.uint16 and np.load(path).tolist() == flat
    assert json.loads((tmp_path / "corpus.json").read_text()) == {"vocab_size": 11, "eos_id": 0, "tokenizer": "test",
                                                                   "tokens": 10}
    windows = TokenWindows(path, seq_len=2)
    assert (len(windows), windows.vocab_size, windows.eos_id) == (3, 11, 0)  # the 10th token is left out
    assert torch.equal(windows[torch.tensor([2, 0])], torch.tensor([[0, 9, 10], [5, 6, 7]]))
    assert windows[1].dtype == torch.int64 and windows[1].tolist() == [0, 8, 0]
    assert windows.document_ids(windows[[1, 2]]).tolist() == [[0, 1, 1], [0, 1, 1]]


def test_a_vocabulary_past_16_bits_is_stored_in_32(tmp_path):
    write_token_file(tmp_path / "big.npy", [[70_000, 1]], vocab_size=100_000, eos_id=99_999)
    assert np.load(tmp_path / "big.npy").dtype == np.uint32
    assert TokenWindows(tmp_path / "big.npy", seq_len=2)[0].tolist() == [70_000, 1, 99_999]


@pytest.mark.parametrize("documents, kwargs, message", [
    ([[1, 11]], dict(vocab_size=11, eos_id=0), r"document 0 holds token ids outside \[0, vocab_size=11\): 1 .. 11"),
    ([[-1]], dict(vocab_size=11, eos_id=0), "outside"),
    ([[[1]]], dict(vocab_size=11, eos_id=0), "document 0 must be a flat sequence"),
    ([[1]], dict(vocab_size=11, eos_id=11), r"eos_id must be an int in \[0, vocab_size=11\)"),
    ([[1]], dict(vocab_size=0, eos_id=0), "vocab_size must be an int"),
])
def test_bad_documents_are_refused(tmp_path, documents, kwargs, message):
    with pytest.raises(ValueError, match=message):
        write_token_file(tmp_path / "x.npy", documents, **kwargs)


def test_unreadable_files_are_refused(tmp_path):
    with pytest.raises(ValueError, match="could not be read"):
        TokenWindows(tmp_path / "missing.npy", seq_len=4)
    np.save(tmp_path / "floats.npy", np.zeros(10, dtype=np.float32))
    (tmp_path / "floats.json").write_text(json.dumps({"vocab_size": 4, "eos_id": 0}))
    with pytest.raises(ValueError, match="must hold a flat uint16 or uint32 array, got float32"):
        TokenWindows(tmp_path / "floats.npy", seq_len=4)
    write_token_file(tmp_path / "short.npy", [[1, 2]], vocab_size=4, eos_id=0)
    with pytest.raises(ValueError, match="holds 3 tokens: fewer than one window of seq_len \\+ 1 = 5"):
        TokenWindows(tmp_path / "short.npy", seq_len=4)
    with pytest.raises(ValueError, match="seq_len must be an int >= 1"):
        TokenWindows(tmp_path / "short.npy", seq_len=0)
