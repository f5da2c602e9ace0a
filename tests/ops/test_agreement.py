"""The rank-agreement check: ranks that disagree on a call, or a rank that refuses its input, make every rank
raise the same clear error before any payload travels (no crash, no silent garbage, no one-rank hang)."""

import re

import pytest
import torch
import torch.distributed as dist

import torchdist_ext
from torchdist_ext import ledger
from torchdist_ext.agreement import check_agreement


def raised_on_every_rank(call) -> str:
    """Runs ``call`` on this rank; returns "TypeName: message" of what it raised (fails if nothing)."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the type is part of what is checked
        return f"{type(error).__name__}: {error}"
    raise AssertionError("nothing was raised")


def ring(rank_arguments: dict) -> str:
    """ring_attention_fwd with q = k = v [1, 2, 4, 8] float32, causal, scale 0.5, contiguous, unless
    ``rank_arguments`` (per rank) says otherwise."""
    args = dict(shape=(1, 2, 4, 8), dtype=torch.float32, causal=True, scale=0.5, order="contiguous", ids=False)
    args.update(rank_arguments.get(dist.get_rank(), {}))
    q = torch.randn(*args["shape"]).to(args["dtype"])
    ids = torch.zeros(args["shape"][0], args["shape"][2], dtype=torch.long) if args["ids"] else None
    name = dist.group.WORLD.group_name
    return raised_on_every_rank(lambda: torch.ops.tdx.ring_attention_fwd(q, q, q, name, args["causal"],
                                                                         args["scale"], args["order"], ids))


@pytest.mark.parametrize(
    "rank_arguments, message",
    [
        ({1: dict(shape=(1, 2, 2, 8))}, r"must agree on q: rank \d has Float \[1, 2, [42], 8\], rank \d has Float"),
        ({0: dict(dtype=torch.float16), 1: dict(dtype=torch.bfloat16)},
         r"must agree on q: rank \d has (Half|BFloat16) \[1, 2, 4, 8\], rank \d has (BFloat16|Half)"),
        ({1: dict(causal=False)}, r"must agree on causal: rank \d has (true|false), rank \d has (false|true)"),
        ({1: dict(scale=0.25)}, r"must agree on scale: rank \d has 0.(5|25), rank \d has 0.(25|5)"),
        ({1: dict(order="zigzag")}, r"must agree on order: rank \d has (contiguous|zigzag), rank \d has"),
        ({0: dict(ids=True)}, r"must agree on document_ids: rank \d has (Long \[1, 4\]|none), rank \d has"),
    ],
    ids=["local-sequence", "dtype", "causal", "scale", "order", "document-ids-on-one-rank"],
)
def test_ring_attention_refuses_ranks_that_disagree(world2, rank_arguments, message):
    for text in world2.run(ring, rank_arguments):
        assert text.startswith("ValueError: ring_attention_fwd: the ranks of the group must agree on")
        assert re.search(message, text), text


def test_a_rank_that_refuses_its_input_stops_every_rank(world2):
    # rank 1 alone: an odd local sequence, which the zigzag order cannot split (its shape differs too: the
    # refusal is what every rank reports)
    texts = world2.run(ring, {0: dict(order="zigzag"), 1: dict(order="zigzag", shape=(1, 2, 3, 8))})
    assert texts[1] == ("RuntimeError: ring_attention_fwd: the zigzag order needs an even local sequence (two "
                        "chunks per rank), got 3")
    assert texts[0] == ("RuntimeError: ring_attention_fwd: rank 1 of the group refused its input, so every rank "
                        "stops: ring_attention_fwd: the zigzag order needs an even local sequence (two chunks per "
                        "rank), got 3")
    texts = world2.run(ring, {1: dict(order="spiral")})
    assert texts[1].startswith("ValueError: ring_attention_fwd: order must be 'contiguous' or 'zigzag'")
    assert texts[0].startswith("ValueError: ring_attention_fwd: rank 1 of the group refused its input")


def other_ops(op: str) -> str:
    """Rank 0 passes float16, rank 1 bfloat16 (same size: the bytes would be reinterpreted), or another shape,
    row count or expert count, to ``op``."""
    name = dist.group.WORLD.group_name
    rank = dist.get_rank()
    dtype = torch.float16 if rank == 0 else torch.bfloat16
    x = torch.randn(1, 2, 4, 8, dtype=dtype)
    if op == "ulysses":
        return raised_on_every_rank(lambda: torch.ops.tdx.all_to_all_seq_to_heads(x, name, "contiguous"))
    if op == "ulysses-shape":
        y = torch.randn(1, 2, 4 if rank == 0 else 2, 8)
        return raised_on_every_rank(lambda: torch.ops.tdx.all_to_all_seq_to_heads(y, name, "contiguous"))
    if op == "cross_entropy":
        rows = 3 if rank == 0 else 5
        return raised_on_every_rank(lambda: torch.ops.tdx.vocab_parallel_cross_entropy_fwd(
            torch.randn(rows, 8), torch.zeros(rows, dtype=torch.long), 8 * rank, 16, -100, name))
    if op == "all_gather_matmul":
        return raised_on_every_rank(
            lambda: torch.ops.tdx.all_gather_matmul(x[0, 0], torch.randn(4, 8, dtype=dtype), name, 0, False))
    if op == "matmul_reduce_scatter":
        weight = torch.randn(4 if rank == 0 else 6, 8)
        return raised_on_every_rank(
            lambda: torch.ops.tdx.matmul_reduce_scatter(torch.randn(4, 8), weight, name, 0))
    experts = 4 if rank == 0 else 8
    tokens = torch.randn(3, 8)
    ids = torch.zeros(3, 1, dtype=torch.long)
    return raised_on_every_rank(
        lambda: torch.ops.tdx.moe_dispatch(tokens, ids, torch.ones(3, 1), experts, -1, name))


@pytest.mark.parametrize(
    "op, message",
    [
        ("ulysses", r"all_to_all_seq_to_heads: the ranks of the group must agree on x: rank \d has "
                    r"(Half|BFloat16) \[1, 2, 4, 8\], rank \d has (BFloat16|Half)"),
        ("ulysses-shape", r"all_to_all_seq_to_heads: the ranks of the group must agree on x: rank \d has "
                          r"Float \[1, 2, [42], 8\], rank \d has Float \[1, 2, [24], 8\]"),
        ("cross_entropy", r"vocab_parallel_cross_entropy_fwd: the ranks of the group must agree on target: "
                          r"rank \d has Long \[[35]\], rank \d has Long \[[53]\]"),
        ("all_gather_matmul", r"all_gather_matmul: the ranks of the group must agree on x"),
        ("matmul_reduce_scatter", r"matmul_reduce_scatter: the ranks of the group must agree on weight: "
                                  r"rank \d has Float \[(4|6), 8\]"),
        ("moe_dispatch", r"moe_dispatch: the ranks of the group must agree on num_experts: rank \d has (4|8)"),
    ],
)
def test_communicating_ops_refuse_ranks_that_disagree(world2, op, message):
    for text in world2.run(other_ops, op):
        assert re.search(message, text), text
    assert world2.alive


def python_layer_check(bad_rank: int | None, value_of_rank1) -> str:
    """check_agreement from Python: rank 1's field may differ; ``bad_rank``'s validate raises."""
    def validate():
        if dist.get_rank() == bad_rank:
            raise TypeError("width must be an int, got 'x'")

    fields = {"width": 4 if dist.get_rank() == 0 else value_of_rank1, "name": "mlp"}
    return raised_on_every_rank(lambda: check_agreement(dist.group.WORLD, "Layer", fields, validate))


def test_python_layers_check_their_fields_and_share_a_refusal(world2):
    texts = world2.run(python_layer_check, None, 8)
    assert all(t == f"ValueError: Layer: the ranks of the group must agree on width: rank {r} has "
                    f"{4 if r == 0 else 8}, rank {1 - r} has {8 if r == 0 else 4} (the rank-agreement check: "
                    "torchdist_ext.set_agreement_checks)" for r, t in enumerate(texts)), texts
    texts = world2.run(python_layer_check, 0, 4)
    assert texts[0] == "TypeError: width must be an int, got 'x'"
    assert texts[1] == ("TypeError: Layer: rank 0 of the group refused its input, so every rank stops: "
                        "width must be an int, got 'x'")


class ProbeError(Exception):
    """An exception type the check does not know."""


def refusals_of_any_kind(kind: str) -> str:
    """Rank 1 alone refuses: its validate (or its fields function) raises ``kind``."""
    def fail():
        if dist.get_rank() == 1:
            errors = {"key": KeyError("width"), "custom": ProbeError("bad width"), "fields": ValueError("no fields")}
            raise errors[kind]

    if kind == "fields":
        return raised_on_every_rank(lambda: check_agreement(None, "Layer", lambda: (fail(), {"a": 1})[1]))
    return raised_on_every_rank(lambda: check_agreement(None, "Layer", {"a": 1}, fail))


def test_any_exception_on_one_rank_reaches_every_rank(world2):
    assert world2.run(refusals_of_any_kind, "key")[0] == ("RuntimeError: Layer: rank 1 of the group refused its "
                                                          "input, so every rank stops: KeyError: 'width'")
    assert world2.run(refusals_of_any_kind, "custom")[0].endswith("every rank stops: ProbeError: bad width")


def test_an_exception_of_the_fields_function_is_a_refusal(world2):
    assert world2.run(refusals_of_any_kind, "fields") == [
        "ValueError: Layer: rank 1 of the group refused its input, so every rank stops: no fields",
        "ValueError: no fields"]


def tensor_fields(differ: bool) -> str:
    t = torch.arange(2000)
    if differ and dist.get_rank() == 1:
        t = torch.arange(2001)
    try:
        check_agreement(None, "Layer", {"w": t})
    except ValueError as error:
        return str(error)
    return "agreed"


def test_tensors_are_compared_by_dtype_and_shape(world2):
    assert world2.run(tensor_fields, False) == ["agreed", "agreed"]
    assert world2.run(tensor_fields, True)[0].startswith(
        "Layer: the ranks of the group must agree on w: rank 0 has torch.int64 (2000,), rank 1 has torch.int64 (2001,)")


def test_field_names_must_not_hold_separators():
    with pytest.raises(ValueError, match=r"field names must be strings without '=' or newlines, got 'a=b'"):
        check_agreement(None, "Layer", {"a=b": 1})


def test_agreement_checks_switch():
    assert torchdist_ext.agreement_checks() == "auto"
    assert torchdist_ext.set_agreement_checks("off") == "auto"
    assert torchdist_ext.set_agreement_checks("auto") == "off"
    with pytest.raises(ValueError, match=r"mode must be one of \('auto', 'on', 'off'\), got 'always'"):
        torchdist_ext.set_agreement_checks("always")


def checked_calls_in_the_ledger(mode: str):
    """One ring attention call on a ledger group; returns its tallies' op names."""
    group = dist.new_group(backend=ledger.backend("gloo"))
    previous = torchdist_ext.set_agreement_checks(mode)
    try:
        q = torch.randn(1, 2, 4, 8)
        ledger.reset(group)
        torch.ops.tdx.ring_attention_fwd(q, q, q, group.group_name, True, 0.5, "contiguous")
        return sorted(ledger.read(group))
    finally:
        torchdist_ext.set_agreement_checks(previous)
        dist.destroy_process_group(group)


def test_the_ledger_enters_the_check_apart_from_the_ops_traffic(world2):
    assert world2.run(checked_calls_in_the_ledger, "on")[0] == ["agreement_check", "recv", "send"]
    assert world2.run(checked_calls_in_the_ledger, "off")[0] == ["recv", "send"]
