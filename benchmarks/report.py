"""How a benchmark reports: its command-line arguments, one JSON line per case, and a readable table.

    parser = arguments(__doc__, worlds=[2, 4], repeats=10)
    rows = []
    emit({"world": 2, "ms": 1.5}, rows)              # {"world": 2, "ms": 1.5}
    print_table(rows, [("world", 5, "world"), ("ms", 9, "ms", ".2f")])
"""

import argparse
import json
from typing import Any, Callable, NamedTuple

import torch

__all__ = ["Column", "arguments", "emit", "print_table", "sizes_and_repeats"]


def arguments(description: str, *, worlds: list[int] | None = None, repeats: int | None = None,
              warmup: int | None = None, sizes: list | None = None, quick: bool = False,
              device: bool = False) -> argparse.ArgumentParser:
    """A parser described by the first paragraph of ``description`` (a module docstring), with only the
    arguments asked for: ``--device cuda|cpu`` (default cuda when there is one), ``--worlds`` (default
    ``worlds``), ``--repeats`` and ``--warmup`` (those defaults), ``--sizes`` (indices into ``sizes``,
    default all) and ``--quick``."""
    parser = argparse.ArgumentParser(description=description.split("\n\n")[0])
    if device:
        parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                            choices=["cuda", "cpu"])
    if worlds is not None:
        parser.add_argument("--worlds", type=int, nargs="+", default=worlds)
    if repeats is not None:
        parser.add_argument("--repeats", type=int, default=repeats)
    if warmup is not None:
        parser.add_argument("--warmup", type=int, default=warmup)
    if sizes is not None:
        parser.add_argument("--sizes", type=int, nargs="+", default=list(range(len(sizes))),
                            help=f"indices into SIZES {sizes}")
    if quick:
        parser.add_argument("--quick", action="store_true", help="only the smallest size, 3 repeats")
    return parser


def sizes_and_repeats(args: argparse.Namespace, sizes: list) -> tuple[list, int]:
    """The entries of ``sizes`` that ``--sizes`` names and ``--repeats``; with ``--quick`` the first entry and
    at most 3 repeats."""
    if args.quick:
        return sizes[:1], min(3, args.repeats)
    return [sizes[i] for i in args.sizes], args.repeats


def emit(row: dict, rows: list) -> None:
    """Prints ``row`` as one JSON line (flushed at once) and appends it to ``rows``."""
    print(json.dumps(row), flush=True)
    rows.append(row)


class Column(NamedTuple):
    """A table column: its header, its width, what gives its cell (the row's key, or a function of the row) and
    the cell's format spec (``".3f"``); a missing key or a None prints ``-``."""

    header: str
    width: int
    value: str | Callable[[dict], Any]
    fmt: str = ""


def print_table(rows: list[dict], columns: list[Column | tuple]) -> None:
    """Prints the header, a line of dashes and one line per row, every cell right-aligned to its column's width
    and columns separated by one space."""
    columns = [Column(*column) for column in columns]
    header = " ".join(f"{c.header:>{c.width}}" for c in columns)
    print(header)
    print("-" * len(header))
    for row in rows:
        cells = []
        for c in columns:
            value = c.value(row) if callable(c.value) else row.get(c.value)
            cells.append(f"{'-' if value is None else format(value, c.fmt):>{c.width}}")
        print(" ".join(cells))
