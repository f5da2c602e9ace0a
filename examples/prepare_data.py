"""Tokenise text files into a token file for ``train_llama.py --data``: one document per file (or per
non-empty paragraph with ``--split-paragraphs``), each followed by the end-of-document id.

    python examples/prepare_data.py books/*.txt --tokenizer ~/models/Llama-3.2-1B --out corpus.npy
    python examples/prepare_data.py notes.txt --out bytes.npy        # no tokenizer: UTF-8 bytes, 0 ends a document

``--tokenizer`` is a local Hugging Face tokenizer (a ``tokenizer.json``, or a folder holding one; nothing is
downloaded), read with the ``tokenizers`` library; its end-of-document token is ``--eos-token`` or the first
of the usual names it knows. Without one the tokens are the text's UTF-8 bytes (vocabulary 256) and the byte 0,
which text does not hold, ends each document. Writes ``OUT`` (``torchdist_ext.token_data``: uint16 or uint32)
and ``OUT``'s ``.json`` (vocabulary, end-of-document id, tokenizer).
"""

import argparse
import sys
from pathlib import Path

from torchdist_ext.token_data import write_token_file

# End-of-document tokens of common tokenizers: Llama 3's, GPT-2's / Qwen's, Llama 2's and Mistral's, Gemma's.
EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")


def read_documents(paths: list[Path], split_paragraphs: bool) -> list[str]:
    documents = []
    for path in paths:
        text = path.read_text(encoding="utf-8")
        documents.extend(p for p in text.split("\n\n") if p.strip()) if split_paragraphs else documents.append(text)
    return documents


def load_tokenizer(path: Path):
    """The ``tokenizers.Tokenizer`` of ``path`` (a tokenizer.json or a folder holding one)."""
    from tokenizers import Tokenizer

    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise SystemExit(f"--tokenizer {path}: no tokenizer.json there (a Hugging Face tokenizer folder or file)")
    return Tokenizer.from_file(str(file))


def eos_id(tokenizer, name: str | None) -> int:
    names = (name,) if name else EOS_NAMES
    for candidate in names:
        found = tokenizer.token_to_id(candidate)
        if found is not None:
            return found
    raise SystemExit(f"the tokenizer has no end-of-document token among {', '.join(names)}: give --eos-token")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", type=Path, nargs="+", help="UTF-8 text files")
    parser.add_argument("--out", type=Path, required=True, help="the token file to write (.npy)")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="a local Hugging Face tokenizer (tokenizer.json or its folder); default: UTF-8 bytes")
    parser.add_argument("--eos-token", default=None, help="the tokenizer's end-of-document token")
    parser.add_argument("--split-paragraphs", action="store_true", help="each non-empty paragraph a document")
    args = parser.parse_args(argv)
    if args.out.suffix != ".npy":
        parser.error(f"--out {args.out}: a token file ends in .npy")
    documents = read_documents(args.inputs, args.split_paragraphs)
    if args.tokenizer is None:
        ids = [list(text.encode("utf-8")) for text in documents]
        if any(0 in document for document in ids):
            parser.error("a document holds the byte 0, which ends documents in a byte-level token file")
        written = write_token_file(args.out, ids, vocab_size=256, eos_id=0, tokenizer="utf-8 bytes")
        vocab = 256
    else:
        tokenizer = load_tokenizer(args.tokenizer)
        end = eos_id(tokenizer, args.eos_token)
        ids = [encoding.ids for encoding in tokenizer.encode_batch(documents, add_special_tokens=False)]
        vocab = tokenizer.get_vocab_size()
        written = write_token_file(args.out, ids, vocab_size=vocab, eos_id=end, tokenizer=str(args.tokenizer))
    print(f"{args.out}: {written:,} tokens in {len(documents)} documents (vocabulary {vocab:,})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
