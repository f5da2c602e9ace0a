"""The communication ledger (torchdist_ext.ledger): a c10d backend wrapping gloo that forwards every call and counts
calls and bytes per operation. Counts are checked against closed forms: the ring algorithms' traffic of each
Python collective, the rings of one tensor- and sequence-parallel block, and one ring-attention call."""

import pytest
import torch
import torch.distributed as dist

from torchdist_ext import ledger
from torchdist_ext.parallel import ColumnParallelLinear, RowParallelLinear, ring_attention, shard_sequence
from torchdist_ext.testing import cached_mesh, spawn_world

WORLD = 4
FP32 = 4  # bytes


@pytest.fixture(scope="module")
def ledger_world():
    world = spawn_world(WORLD, backend=ledger.backend("gloo"))
    yield world
    world.close()


def sent_and_calls(tallies: dict) -> dict:
    """(calls, sent, received) per op, without the rank-agreement check's all-gathers (entered apart as
    "agreement_check": tests/ops/test_agreement.py), which the planner's formulas leave out."""
    return {op: (t.calls, t.sent_bytes, t.received_bytes) for op, t in tallies.items() if op != "agreement_check"}


def python_collectives() -> dict:
    n, rank = dist.get_world_size(), dist.get_rank()
    ledger.reset()
    x = torch.ones(12)  # 48 bytes
    dist.all_reduce(x)
    gathered = torch.empty(n * 12)
    dist.all_gather_into_tensor(gathered, x)
    dist.reduce_scatter_tensor(torch.empty(3), torch.ones(12))
    # Uneven all-to-all: rank r sends r + 1 rows of 2 floats to every rank.
    rows = torch.ones((rank + 1) * n, 2)
    received = torch.empty(sum(r + 1 for r in range(n)), 2)
    dist.all_to_all_single(received, rows, [r + 1 for r in range(n)], [rank + 1] * n)
    dist.broadcast(x, src=1)
    peer = rank ^ 1
    if rank % 2 == 0:
        dist.send(x, peer)
    else:
        dist.recv(x, peer)
    dist.barrier()
    return sent_and_calls(ledger.read())


def test_python_collectives_closed_forms(ledger_world):
    n = WORLD
    for rank, tallies in enumerate(ledger_world.run(python_collectives)):
        ring_all_reduce = 2 * (n - 1) / n * 48
        all_to_all_sent = (n - 1) * (rank + 1) * 2 * FP32  # rank+1 rows to each other rank
        all_to_all_received = sum(r + 1 for r in range(n) if r != rank) * 2 * FP32
        expected = {
            "all_reduce": (1, ring_all_reduce, ring_all_reduce),
            "all_gather_into_tensor": (1, (n - 1) * 48, (n - 1) * 48),
            "reduce_scatter_tensor": (1, (n - 1) * 12, (n - 1) * 12),
            "all_to_all_single": (1, all_to_all_sent, all_to_all_received),
            "broadcast": (1, (n - 1) * 48 if rank == 1 else 0, 0 if rank == 1 else 48),
            "send" if rank % 2 == 0 else "recv": (1, 48 if rank % 2 == 0 else 0, 0 if rank % 2 == 0 else 48),
            "barrier": (1, 0, 0),
        }
        assert tallies == expected, f"rank {rank}"


def tp_sequence_parallel_block(batch: int, seq: int, hidden: int, ffn: int) -> tuple[dict, dict]:
    """One Megatron block (column- then row-parallel linear) with sequence parallelism: forward and backward
    tallies on the tp group."""
    mesh = cached_mesh((dist.get_world_size(),), ("tp",))
    column = ColumnParallelLinear(hidden, ffn, bias=False, tp_mesh=mesh, sequence_parallel=True)
    row = RowParallelLinear(ffn, hidden, bias=False, tp_mesh=mesh, sequence_parallel=True)
    x = torch.randn(batch, seq // mesh.size(), hidden, requires_grad=True)
    ledger.reset(mesh)
    y = row(column(x))
    forward = sent_and_calls(ledger.read(mesh))
    ledger.reset(mesh)
    y.sum().backward()
    return forward, sent_and_calls(ledger.read(mesh))


def test_tp_sequence_parallel_block(ledger_world):
    """Forward: the column's all-gather and the row's reduce-scatter, each a ring of t - 1 steps sending one
    [b, s/t, h] block. Backward: the row's all-gather of the output gradient, the column's reduce-scatter of the
    input gradient, and the column's input gathered again for its weight gradient (not kept from the forward,
    as Megatron-LM does with sequence parallelism): three rings."""
    t, batch, seq, hidden = WORLD, 2, 16, 8
    block = batch * (seq // t) * hidden * FP32
    for forward, backward in ledger_world.run(tp_sequence_parallel_block, batch, seq, hidden, 12):
        assert forward == {"send": (2 * (t - 1), 2 * (t - 1) * block, 0), "recv": (2 * (t - 1), 0, 2 * (t - 1) * block)}
        assert backward == {"send": (3 * (t - 1), 3 * (t - 1) * block, 0), "recv": (3 * (t - 1), 0, 3 * (t - 1) * block)}


def fp8_sequence_parallel_block(recipe: str, batch: int, seq: int, hidden: int, ffn: int) -> tuple[dict, dict]:
    """The block above in fp8 (``convert_to_fp8`` with delayed scales reduced over the ranks, or current
    scaling): forward and backward tallies on the tp group."""
    from torchdist_ext.fp8 import CurrentScaling, DelayedScaling, convert_to_fp8

    mesh = cached_mesh((dist.get_world_size(),), ("tp",))
    block = torch.nn.Sequential(ColumnParallelLinear(hidden, ffn, bias=False, tp_mesh=mesh, sequence_parallel=True),
                                RowParallelLinear(ffn, hidden, bias=False, tp_mesh=mesh, sequence_parallel=True))
    convert_to_fp8(block, DelayedScaling() if recipe == "delayed" else CurrentScaling())
    assert all(layer.fp8_recipe is not None for layer in block)  # local dims divisible by 16
    x = torch.randn(batch, seq // mesh.size(), hidden, requires_grad=True)
    ledger.reset(mesh)
    y = block(x)
    forward = sent_and_calls(ledger.read(mesh))
    ledger.reset(mesh)
    y.sum().backward()
    return forward, sent_and_calls(ledger.read(mesh))


def test_fp8_sequence_parallel_block(ledger_world):
    """Delayed scales (the same on every rank): the rings carry fp8 where they carry an fp8 operand, the
    column's input blocks forward and the row's output-gradient blocks backward (1 byte per element, a quarter
    of fp32's), and the partial sums in fp32; the gathered fp8 input is kept for the column's weight gradient,
    so the backward has two rings, not three. Current scaling (a scale per rank): bulk fp32 collectives."""
    t, batch, seq, hidden = WORLD, 2, 16, 16
    elements = batch * (seq // t) * hidden
    fp8_and_fp32 = (t - 1) * elements * (1 + FP32)
    for forward, backward in ledger_world.run(fp8_sequence_parallel_block, "delayed", batch, seq, hidden, 64):
        for tallies in (forward, backward):
            assert tallies == {"send": (2 * (t - 1), fp8_and_fp32, 0), "recv": (2 * (t - 1), 0, fp8_and_fp32)}
    bulk = (1, (t - 1) * elements * FP32, (t - 1) * elements * FP32)
    for forward, backward in ledger_world.run(fp8_sequence_parallel_block, "current", batch, seq, hidden, 64):
        for tallies in (forward, backward):
            assert tallies == {"all_gather_into_tensor_coalesced": bulk, "reduce_scatter_tensor_coalesced": bulk}


def ring_attention_call(batch: int, heads: int, kv_heads: int, seq: int, head_dim: int) -> tuple[dict, dict]:
    mesh = cached_mesh((dist.get_world_size(),), ("cp",))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (shard_sequence(torch.randn(batch, h, seq, head_dim, generator=gen), cp_mesh=mesh, dim=2)
               .requires_grad_(True) for h in (heads, kv_heads, kv_heads))
    ledger.reset(mesh)
    out = ring_attention(q, k, v, cp_mesh=mesh, causal=True)
    forward = sent_and_calls(ledger.read(mesh))
    ledger.reset(mesh)
    out.sum().backward()
    return forward, sent_and_calls(ledger.read(mesh))


def test_ring_attention_call(ledger_world):
    """Bytes per ring step x steps: the forward passes each rank's K and V block ([b, h_kv, s/c, d] each, one
    message) around c - 1 times; the backward passes them again (c - 1) and the dK / dV accumulators (fp32, the
    same size) c times, home included: 3 (c - 1) + 1 blocks in all, the planner's cp formula."""
    c, batch, kv_heads, seq, head_dim = WORLD, 2, 2, 16, 8
    kv_block = 2 * batch * kv_heads * (seq // c) * head_dim * FP32
    for forward, backward in ledger_world.run(ring_attention_call, batch, 4, kv_heads, seq, head_dim):
        assert forward == {"send": (c - 1, (c - 1) * kv_block, 0), "recv": (c - 1, 0, (c - 1) * kv_block)}
        assert backward == {"send": (2 * c - 1, (2 * c - 1) * kv_block, 0),
                            "recv": (2 * c - 1, 0, (2 * c - 1) * kv_block)}


def seconds_and_labels() -> tuple[float, list[str]]:
    mesh = cached_mesh((2, 2), ("dp", "tp"))
    ledger.reset()
    x = torch.ones(1000)
    dist.all_reduce(x, group=mesh["tp"].get_group())
    dist.all_reduce(x, group=mesh["dp"].get_group())
    work = dist.all_reduce(x, group=mesh["dp"].get_group(), async_op=True)
    work.wait()
    labelled = ledger.by_label({"tp": mesh["tp"], "dp": mesh["dp"], "also_dp": [mesh["dp"], mesh["dp"]]})
    return ledger.read(mesh["dp"])["all_reduce"].seconds, {k: v["all_reduce"].calls for k, v in labelled.items()}


def test_seconds_and_labels(ledger_world):
    for seconds, labelled in ledger_world.run(seconds_and_labels):
        assert seconds > 0
        assert labelled == {"tp": 1, "dp+also_dp": 2}


def test_bad_input(world2):
    with pytest.raises(ValueError, match="a ledger wraps gloo or nccl, not 'mpi'"):
        ledger.backend("mpi")
    with pytest.raises(ValueError, match="nccl serves cuda, not 'cpu'"):
        ledger.backend("cpu:nccl")
    with pytest.raises(TypeError, match="spec must be a backend string"):
        ledger.backend(None)
    assert ledger.backend("cpu:gloo,cuda:nccl") == "cpu:ledger_gloo,cuda:ledger_nccl"


def test_one_ledger_per_group_before_torch_2_14(monkeypatch):
    """Older torch files every registered backend as CUSTOM, one per group: the cuda backend is the counted one."""
    monkeypatch.setattr(ledger, "_typed_registration", lambda: False)
    monkeypatch.setattr(dist.Backend, "_plugins", dict(dist.Backend._plugins))  # registrations stay in this test
    monkeypatch.setattr(dist.Backend, "backend_list", list(dist.Backend.backend_list))
    monkeypatch.setattr(dist.Backend, "backend_type_map", dict(dist.Backend.backend_type_map))
    monkeypatch.setattr(dist.Backend, "backend_capability", dict(dist.Backend.backend_capability))
    for name in ("ledger_gloo", "ledger_nccl"):  # registered unchanged by other tests: register afresh here
        dist.Backend._plugins.pop(name.upper(), None)
        if name in dist.Backend.backend_list:
            dist.Backend.backend_list.remove(name)
    with pytest.warns(UserWarning, match="counts the cuda backend and not the cpu one"):
        assert ledger.backend("cpu:gloo,cuda:nccl") == "cpu:gloo,cuda:ledger_nccl"
    assert ledger.backend("gloo") == "ledger_gloo"


def read_plain_gloo() -> str:
    try:
        ledger.read()
    except ValueError as error:
        return str(error)
    return "no error"


def test_plain_group_is_not_counted(world2):
    for message in world2.run(read_plain_gloo):
        assert "is not counted: create it with torchdist_ext.ledger.backend" in message


@pytest.mark.parametrize("call", [ledger.read, ledger.reset, lambda: ledger.by_label({}, rest="other")],
                         ids=["read", "reset", "by_label"])
def test_without_a_process_group_says_to_initialise_one(call):
    """This pytest process has no process group (the worlds run in their own processes)."""
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"no process group is initialised in this process; call "
                                           r"torch.distributed.init_process_group\(ledger.backend\(...\)\) first"):
        call()


def test_group_argument_checked(ledger_world):
    with pytest.raises(TypeError, match="group must be a ProcessGroup, a 1-D DeviceMesh or None"):
        ledger.read("tp")
