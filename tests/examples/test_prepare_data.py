"""examples/prepare_data.py: text files to a token file (a local Hugging Face tokenizer, or UTF-8 bytes) that
holds each document's ids as the tokenizer gives them and a separator after each; the main job trains on it
(--data) and matches one process, and refuses a model whose vocabulary cannot hold the file's ids."""

import sys

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from tests.examples.test_train_llama import ROOT, assert_refused, largest_relative_difference, run_main_job
from torchdist_ext.token_data import TokenWindows

sys.path.insert(0, str(ROOT / "examples"))
from prepare_data import main as prepare  # noqa: E402

TEXTS = ["the cat sat on the mat\n\nthe dog sat", "a mat for the cat, a log for the dog"]


@pytest.fixture
def texts(tmp_path):
    paths = []
    for index, text in enumerate(TEXTS):
        paths.append(tmp_path / f"doc{index}.txt")
        paths[-1].write_text(text)
    return paths


def word_tokenizer(path, vocab_size: int) -> Tokenizer:
    """A word-level tokenizer of the texts' words, "<unk>" and "</s>", padded with unused words to
    ``vocab_size`` ids, saved as ``path``."""
    words = sorted({word for text in TEXTS for word in text.replace(",", " ").split()})
    vocab = {token: index for index, token in enumerate(["<unk>", "</s>", *words])}
    vocab.update({f"unused{i}": i for i in range(len(vocab), vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return tokenizer


def test_bytes_without_a_tokenizer(texts, tmp_path):
    assert prepare([*map(str, texts), "--out", str(tmp_path / "bytes.npy"), "--split-paragraphs"]) == 0
    windows = TokenWindows(tmp_path / "bytes.npy", seq_len=4)
    flat = windows[list(range(len(windows)))].flatten().tolist()
    documents = ["the cat sat on the mat", "the dog sat", TEXTS[1]]
    want = [byte for text in documents for byte in [*text.encode(), 0]]
    assert (windows.vocab_size, windows.eos_id) == (256, 0) and flat == want[: len(flat)]


def test_a_local_tokenizer(texts, tmp_path):
    tokenizer = word_tokenizer(tmp_path / "tokenizer.json", vocab_size=300)
    assert prepare([*map(str, texts), "--out", str(tmp_path / "words.npy"), "--tokenizer", str(tmp_path)]) == 0
    windows = TokenWindows(tmp_path / "words.npy", seq_len=1)
    flat = windows[list(range(len(windows)))].flatten().tolist()  # 22 tokens: 11 windows of 2
    want = [i for text in TEXTS for i in [*tokenizer.encode(text, add_special_tokens=False).ids, 1]]
    assert (windows.vocab_size, windows.eos_id) == (300, 1) and flat == want


@pytest.mark.parametrize("layout", [("--dp", "2", "--cp", "2", "--cp-method", "ring", "--tp", "1"),
                                    ("--pp", "2", "--cp", "2", "--cp-method", "ulysses", "--tp", "1",
                                     "--microbatches", "2"),
                                    ("--pp", "2", "--cp", "2", "--cp-method", "ring", "--tp", "1",
                                     "--microbatches", "2", "--cp-balance"),
                                    ("--cp", "4", "--cp-method", "hybrid", "--cp-ulysses", "2", "--tp", "1",
                                     "--cp-balance", "--compile")],
                         ids=["dp2-cp2-ring", "pp2-cp2-ulysses", "pp2-cp2-ring-balanced", "cp4-hybrid-balanced-compiled"])
def test_the_main_job_trains_on_a_token_file(layout, texts, tmp_path, monkeypatch, capsys):
    """Windows of 8 tokens hold one to three documents: context-parallel attention (and the pipeline's stages)
    keep them apart as the one process's masked attention does, sharded zigzag or by each step's balanced plan
    (--cp-balance, whose per-row positions reach RoPE and the attention)."""
    word_tokenizer(tmp_path / "tokenizer.json", vocab_size=300)
    prepare([*map(str, texts * 8), "--out", str(tmp_path / "words.npy"), "--tokenizer", str(tmp_path / "tokenizer.json")])
    data = ("--data", str(tmp_path / "words.npy"), "--seq", "8")
    if layout[0] == "--dp":
        assert_refused(data, f"the model's vocabulary (256) must hold the data's: --data {tmp_path / 'words.npy'} "
                       "has 300", monkeypatch, capsys)
    output = run_main_job(*data, *layout, "--vocab", "320", "--steps", "3", "--batch", "4")
    assert largest_relative_difference(output) < 1e-4


def test_refusals(texts, tmp_path):
    with pytest.raises(SystemExit, match="no tokenizer.json there"):
        prepare([str(texts[0]), "--out", str(tmp_path / "x.npy"), "--tokenizer", str(tmp_path)])
    word_tokenizer(tmp_path / "tokenizer.json", vocab_size=300)
    with pytest.raises(SystemExit, match="no end-of-document token among <end>"):
        prepare([str(texts[0]), "--out", str(tmp_path / "x.npy"), "--tokenizer", str(tmp_path), "--eos-token", "<end>"])
