"""The planner's packed documents (csrc/planner/documents.h): the attention's work share and its spread over
the ring ranks for each cp order, against closed forms (one document) and against the ops' own count on rows
drawn independently (ops.context_attention_work, balanced_sequence_plan); and the estimate that uses them."""

import dataclasses
import math

import pytest
import torch

import torchdist_ext  # noqa: F401
from torchdist_ext.ops import context_attention_work
from torchdist_ext.parallel import balanced_sequence_plan
from torchdist_ext.planner import ClusterSpec, Layout, ModelSpec, attention_balance, estimate


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_one_document_in_closed_form(ranks):
    seq = 4096
    length = seq // ranks
    work = [r * length * length + length * (length + 1) / 2 for r in range(ranks)]  # rank r: block r of N
    contiguous = max(work) / (sum(work) / ranks) - 1
    assert attention_balance(seq, ranks, order="contiguous") == pytest.approx((1.0, contiguous), abs=1e-12)
    assert attention_balance(seq, ranks, order="zigzag") == pytest.approx((1.0, 0.0), abs=1e-12)
    assert attention_balance(seq, ranks, order="balanced")[1] < 1e-3


def lognormal_row(gen: torch.Generator, seq: int, median: float, sigma: float) -> torch.Tensor:
    lengths, total = [], 0
    while total < seq:
        length = max(1, round(float(torch.empty(1).log_normal_(math.log(median), sigma, generator=gen))))
        lengths.append(min(length, seq - total))
        total += lengths[-1]
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_mixes_against_the_ops_count(ranks):
    """The expected spread of 200 independently drawn rows, counted by the ops, within the two estimates'
    sampling error (the spread's deviation over rows is ~0.3: 3 standard errors of the difference ~0.1)."""
    seq, median, sigma = 4096, 100.0, 1.2
    gen = torch.Generator().manual_seed(ranks)
    spreads = {"zigzag": [], "contiguous": [], "balanced": []}
    shares = []
    one_document = seq * (seq + 1) / 2
    for _ in range(200):
        ids = lognormal_row(gen, seq, median, sigma)[None]
        for order in ("zigzag", "contiguous"):
            work = context_attention_work(ids, ranks, order, True).sum(1).double()
            spreads[order].append(float(work.max() / work.mean() - 1))
        spreads["balanced"].append(balanced_sequence_plan(ids, ranks).spread)
        shares.append(float(context_attention_work(ids, 1, "contiguous", True).sum()) / one_document)
    for order, measured in spreads.items():
        share, spread = attention_balance(seq, ranks, order=order, document_median=median, document_sigma=sigma)
        expected = sum(measured) / len(measured)
        assert spread == pytest.approx(expected, abs=0.1 if order != "balanced" else 0.01), order
        assert share == pytest.approx(sum(shares) / len(shares), rel=0.15)
    assert spreads["balanced"] and max(spreads["balanced"]) <= 0.05


def test_the_estimate_pays_the_share_and_the_slowest_rank():
    model, cluster = ModelSpec.preset("llama3-8b"), ClusterSpec.preset("h100-80gb", 8)
    one = Layout(dp=2, cp=4, zero_stage=3, seq_len=65536, num_microbatches=2)
    plain = estimate(model, cluster, one)
    for order in ("zigzag", "contiguous", "balanced"):
        packed = dataclasses.replace(one, cp_order=order, document_median=2000.0)
        share, spread = attention_balance(65536, 4, order=order, document_median=2000.0)
        e = estimate(model, cluster, packed)
        assert e.attention_spread == spread
        assert e.compute.attention_seconds == pytest.approx(plain.compute.attention_seconds * share * (1 + spread),
                                                            rel=1e-12)
    zigzag = estimate(model, cluster, dataclasses.replace(one, document_median=2000.0))
    balanced = estimate(model, cluster, dataclasses.replace(one, cp_order="balanced", document_median=2000.0))
    assert balanced.step_seconds < zigzag.step_seconds and balanced.model_flops_per_step == zigzag.model_flops_per_step
    # Ulysses ranks share every query: no spread whatever the order.
    ulysses = dataclasses.replace(one, cp_ulysses=4, cp_order="contiguous", document_median=2000.0)
    assert estimate(model, cluster, ulysses).attention_spread == 0.0


@pytest.mark.parametrize("field, value, message", [
    ("document_median", -1.0, r"Layout.document_median must be >= 0 tokens"),
    ("document_sigma", 0.0, r"Layout.document_sigma must lie in \(0, 10\]"),
    ("cp_order", "striped", "Layout.cp_order must be one of zigzag, contiguous, balanced, got 'striped'"),
])
def test_bad_layouts(field, value, message):
    with pytest.raises(ValueError, match=message):
        Layout(cp=2, **{field: value})


@pytest.mark.parametrize("kwargs, message", [
    (dict(seq_len=4096, ranks=4, document_median=-5.0), "Layout.document_median must be >= 0 tokens"),
    (dict(seq_len=4096, ranks=4, document_median=float("nan")), "Layout.document_median must be >= 0 tokens"),
    (dict(seq_len=4096, ranks=4, document_median=512.0, document_sigma=-1.0), r"document_sigma must lie in \(0, 10\]"),
    (dict(seq_len=4096, ranks=4.0), "ranks must be a positive int, got 4.0"),
    (dict(seq_len=4, ranks=8), "ranks=8 must not exceed seq_len=4"),
    (dict(seq_len=4096, ranks=4, order="striped"), "cp_order must be one of zigzag, contiguous, balanced"),
])
def test_attention_balance_refuses_what_a_layout_refuses(kwargs, message):
    seq_len, ranks = kwargs.pop("seq_len"), kwargs.pop("ranks")
    with pytest.raises(ValueError, match=message):
        attention_balance(seq_len, ranks, **kwargs)
