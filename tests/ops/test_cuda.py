"""CUDA registrations of the tdx ops on one GPU (a one-rank NCCL world). Skipped without CUDA.

The multi-rank rings are tested on CPU with gloo; on one GPU these tests check
the CUDA kernels and the CUDA dispatch of every op against torch on the same device.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import torchdist_ext  # noqa: F401
from torchdist_ext.ops import (
    all_gather_matmul,
    all_gather_weight_grad,
    matmul_reduce_scatter,
    all_to_all_heads_to_seq,
    all_to_all_seq_to_heads,
    moe_combine,
    moe_dispatch,
    moe_permute,
    moe_unpermute,
    vocab_parallel_cross_entropy_fwd,
)
from torchdist_ext.parallel import MoE
from torchdist_ext.testing import cached_mesh, spawn_world

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def cuda_world():
    with spawn_world(1, backend="cpu:gloo,cuda:nccl", timeout=300.0) as world:
        yield world


def group_name():
    return dist.group.WORLD.group_name


def check_cross_entropy(dtype):
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(64, 1000, generator=gen)).to(dtype).cuda().requires_grad_(True)
    target = torch.randint(0, 1000, (64,), generator=gen).cuda()
    target[5] = -100
    loss, lse = vocab_parallel_cross_entropy_fwd(logits, target, 0, 1000, -100, group_name())
    loss.sum().backward()
    reference = logits.detach().double().requires_grad_(True)
    F.cross_entropy(reference, target, reduction="sum").backward()
    tol = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    expected = F.cross_entropy(reference.detach(), target, reduction="none")
    torch.testing.assert_close(loss.double(), expected, atol=10 * tol, rtol=tol)
    torch.testing.assert_close(logits.grad.double(), reference.grad, atol=tol, rtol=tol)
    # the CUDA kernels agree with the CPU kernels
    cpu_loss, cpu_lse = vocab_parallel_cross_entropy_fwd(logits.detach().cpu(), target.cpu(), 0, 1000, -100, group_name())
    torch.testing.assert_close(lse.cpu(), cpu_lse, atol=tol, rtol=tol)
    torch.library.opcheck(torch.ops.tdx.vocab_parallel_cross_entropy_fwd,
                          (logits.detach().requires_grad_(True), target, 0, 1000, -100, group_name()))
    # an ignored row (5) gets gradient exactly 0, also when all its logits are masked
    masked = logits.detach().clone()
    masked[5] = float("-inf")
    masked.requires_grad_(True)
    vocab_parallel_cross_entropy_fwd(masked, target, 0, 1000, -100, group_name())[0].sum().backward()
    assert masked.grad[5].eq(0).all() and masked.grad.isfinite().all()
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_cross_entropy_kernels(cuda_world, dtype):
    assert cuda_world.run(check_cross_entropy, dtype) == [True]


def check_collective_matmuls():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 8, 16, generator=gen).cuda().requires_grad_(True)
    w = torch.randn(24, 16, generator=gen).cuda().requires_grad_(True)
    out, gathered = all_gather_matmul(x, w, group_name(), 1, True)
    torch.testing.assert_close(out, x @ w.t())
    torch.testing.assert_close(gathered, x)
    out.square().sum().backward()
    x_ref, w_ref = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
    (x_ref @ w_ref.t()).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(w.grad, w_ref.grad)
    torch.testing.assert_close(matmul_reduce_scatter(x, w, group_name(), 1), x @ w.t())
    torch.testing.assert_close(all_gather_weight_grad(x, x, group_name(), 1), x.flatten(0, 1).t() @ x.flatten(0, 1))
    return True


def test_collective_matmuls(cuda_world):
    assert cuda_world.run(check_collective_matmuls) == [True]


def check_fp8_collective_matmuls():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 16, 32, generator=gen).to(torch.float8_e4m3fn).cuda()
    mat2 = torch.randn(48, 32, generator=gen).to(torch.float8_e4m3fn).cuda().t()  # column-major, as _scaled_mm takes
    s_x, s_m = torch.tensor([0.5], device="cuda"), torch.tensor([0.25], device="cuda")
    expected = torch._scaled_mm(x.flatten(0, 1), mat2, scale_a=s_x, scale_b=s_m, out_dtype=torch.bfloat16).view(2, 16, 48)
    out, gathered = torchdist_ext.ops.all_gather_scaled_mm(x, mat2, s_x, s_m, torch.bfloat16, group_name(), 1)
    assert torch.equal(out, expected) and torch.equal(gathered.view(torch.uint8), x.view(torch.uint8))
    scattered = torchdist_ext.ops.scaled_mm_reduce_scatter(x, mat2, s_x, s_m, torch.bfloat16, group_name(), 1)
    assert torch.equal(scattered, expected)
    return True


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="fp8 GEMMs need compute capability 8.9 or newer")
def test_fp8_collective_matmuls(cuda_world):
    assert cuda_world.run(check_fp8_collective_matmuls) == [True]


def check_ring_attention_blocks(dtype, causal):
    """With one rank the ring is one block: the CUDA block kernels, merge and backward against SDPA."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 8, 64, 32, generator=gen).to(dtype).cuda().requires_grad_(True)
    k = torch.randn(2, 2, 64, 32, generator=gen).to(dtype).cuda().requires_grad_(True)
    v = torch.randn(2, 2, 64, 32, generator=gen).to(dtype).cuda().requires_grad_(True)
    out, lse = torchdist_ext.ops.ring_attention_fwd(q, k, v, group_name(), causal, 32 ** -0.5, "zigzag")
    out.float().square().sum().backward()
    reference = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*reference, is_causal=causal, enable_gqa=True)
    expected.square().sum().backward()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    for got, want in zip((q, k, v), reference):
        torch.testing.assert_close(got.grad.float(), want.grad, atol=tol * 10, rtol=tol)
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ring_attention_block_kernels(cuda_world, dtype, causal):
    assert cuda_world.run(check_ring_attention_blocks, dtype, causal) == [True]


def check_document_attention_on_cuda(dtype, ring):
    """Packed documents with padding through the CUDA block kernels (the ring of one rank, or the local
    document op): the same values and gradients as the CPU ops on the same inputs."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.tensor([[-1] * 5 + [0] * 20 + [1] * 30 + [2] * 9, [3] * 40 + [4] * 17 + [-1] * 7])
    full = [torch.randn(2, heads, 64, 32, generator=gen).to(dtype) for heads in (8, 2, 2)]
    results = []
    for device in ("cpu", "cuda"):
        q, k, v = (t.detach().to(device).requires_grad_(True) for t in full)  # leaves on either device
        if ring:
            out, _ = torchdist_ext.ops.ring_attention_fwd(q, k, v, group_name(), True, 32 ** -0.5, "zigzag",
                                                          ids.to(device))
        else:
            out, _ = torchdist_ext.ops.document_attention_fwd(q, k, v, ids.to(device), True, 32 ** -0.5)
        out.float().square().sum().backward()
        results.append([t.detach().float().cpu() for t in (out, q.grad, k.grad, v.grad)])
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for name, cuda, cpu in zip(("out", "dq", "dk", "dv"), results[1], results[0]):
        torch.testing.assert_close(cuda, cpu, atol=tol * 10, rtol=tol, msg=name)
    assert (results[1][0][0, :, :5] == 0).all() and (results[1][1][1, :, 57:] == 0).all()  # padding
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("ring", [True, False], ids=["ring", "local"])
def test_document_attention_on_cuda(cuda_world, dtype, ring):
    assert cuda_world.run(check_document_attention_on_cuda, dtype, ring) == [True]


def check_ulysses_all_to_all(order):
    """One rank: the NCCL all-to-all and the fused re-layout are the identity (in either order: one rank's
    zigzag chunks 0 and 1 are the sequence in order), each the other's gradient."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 8, 16, 32, generator=gen).cuda().requires_grad_(True)
    heads = all_to_all_seq_to_heads(x, group_name(), order)
    torch.testing.assert_close(heads, x, atol=0, rtol=0)
    back = all_to_all_heads_to_seq(heads, group_name(), order)
    torch.testing.assert_close(back, x, atol=0, rtol=0)
    grad = torch.randn_like(x)
    back.backward(grad)
    torch.testing.assert_close(x.grad, grad, atol=0, rtol=0)
    for op in (torch.ops.tdx.all_to_all_seq_to_heads, torch.ops.tdx.all_to_all_heads_to_seq):
        torch.library.opcheck(op, (x.detach().requires_grad_(True), group_name(), order))
    return True


@pytest.mark.parametrize("order", ["contiguous", "zigzag"])
def test_ulysses_all_to_all(cuda_world, order):
    assert cuda_world.run(check_ulysses_all_to_all, order) == [True]


def check_moe_exchange_and_permutation():
    """The CUDA kernels of moe_dispatch / moe_combine / moe_permute / moe_unpermute give the CPU kernels'
    results: bit for bit where they only move rows, within fp32 rounding where they sum (a sum of at most
    top_k = 2 weighted rows: one rounding each)."""
    gen = torch.Generator().manual_seed(6)
    tokens, dim, experts, top_k = 300, 72, 4, 2  # past one sort block of 256 threads
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    ids[torch.rand(tokens, top_k, generator=gen) < 0.2] = -1
    weights, x = torch.rand(tokens, top_k, generator=gen), torch.randn(tokens, dim, generator=gen)
    for rows_per_rank in (-1, tokens):
        cpu = moe_dispatch(x, ids, weights, experts, rows_per_rank, group_name())
        gpu = moe_dispatch(x.cuda(), ids.cuda(), weights.cuda(), experts, rows_per_rank, group_name())
        for a, b in zip(cpu, gpu):
            torch.testing.assert_close(b.cpu(), a, atol=0, rtol=0)
        back_cpu = moe_combine(cpu[0] * 2, cpu[2], ids, cpu[3], experts, rows_per_rank, group_name())
        back_gpu = moe_combine(gpu[0] * 2, gpu[2], ids.cuda(), gpu[3], experts, rows_per_rank, group_name())
        for a, b in zip(back_cpu, back_gpu):
            torch.testing.assert_close(b.cpu(), a, atol=0, rtol=0)
        local_ids = cpu[1]
        per_expert = torch.stack([(local_ids == e).sum() for e in range(experts)])
        capacity = -1 if rows_per_rank < 0 else int(per_expert.max()) - 3  # with a capacity, some slots drop
        sorted_cpu, positions_cpu, offsets_cpu = moe_permute(cpu[0], local_ids, per_expert, experts, capacity)
        sorted_gpu, positions_gpu, offsets_gpu = moe_permute(gpu[0], gpu[1], per_expert, experts, capacity)
        torch.testing.assert_close(sorted_gpu.cpu(), sorted_cpu, atol=0, rtol=0)
        assert torch.equal(positions_gpu.cpu(), positions_cpu) and torch.equal(offsets_gpu.cpu(), offsets_cpu)
        y_cpu = moe_unpermute(sorted_cpu, positions_cpu, cpu[2])
        y_gpu = moe_unpermute(sorted_gpu, positions_gpu, gpu[2])
        torch.testing.assert_close(y_gpu.cpu(), y_cpu, atol=1e-6, rtol=2 * 2**-24)
        for op, args in (
            (torch.ops.tdx.moe_dispatch, (x.cuda().requires_grad_(True), ids.cuda(), weights.cuda(), experts,
                                          rows_per_rank, group_name(), None)),
            (torch.ops.tdx.moe_permute, (gpu[0].requires_grad_(True), gpu[1], per_expert, experts, capacity)),
            (torch.ops.tdx.moe_unpermute, (sorted_gpu.requires_grad_(True), positions_gpu, gpu[2])),
        ):
            torch.library.opcheck(op, args)
    return True


def test_moe_exchange_and_permutation_kernels(cuda_world):
    assert cuda_world.run(check_moe_exchange_and_permutation) == [True]


def check_moe_layer_bf16():
    """The MoE layer on the GPU in bf16 (its expert GEMMs through torch._grouped_mm) against the same layer
    in fp32 on the CPU: output and every gradient within bf16's rounding of a few chained GEMMs (2e-2
    relative to each tensor's largest entry)."""
    gen = torch.Generator().manual_seed(0)
    full = [(torch.randn(*shape, generator=gen) * scale).bfloat16()  # values both layers hold exactly
            for shape, scale in (((8, 64), 0.1), ((8, 128, 64), 0.125), ((8, 128, 64), 0.125), ((8, 64, 128), 0.09))]
    cpu_layer = MoE.from_experts(*(w.float() for w in full), top_k=2, ep_mesh=cached_mesh((1,), ("ep",)))
    gpu_layer = MoE.from_experts(*(w.cuda() for w in full), top_k=2,
                                 ep_mesh=cached_mesh((1,), ("ep_cuda",), "cuda"))
    x = torch.randn(4, 96, 64, generator=torch.Generator().manual_seed(1)).bfloat16().float()
    x_cpu, x_gpu = x.clone().requires_grad_(True), x.to("cuda", torch.bfloat16).requires_grad_(True)
    out_cpu, out_gpu = cpu_layer(x_cpu), gpu_layer(x_gpu)
    upstream = torch.randn_like(out_cpu)
    out_cpu.backward(upstream)
    out_gpu.backward(upstream.to("cuda", torch.bfloat16))

    def close(gpu, cpu, what):
        gpu, cpu = (t.full_tensor() if isinstance(t, DTensor) else t for t in (gpu, cpu))
        scale = cpu.abs().max().item()
        torch.testing.assert_close(gpu.float().cpu(), cpu, atol=2e-2 * scale, rtol=0,
                                   msg=lambda detail: f"{what}: {detail}")

    close(out_gpu, out_cpu.detach(), "output")
    close(x_gpu.grad, x_cpu.grad, "input gradient")
    for (name, p_cpu), p_gpu in zip(cpu_layer.named_parameters(), gpu_layer.parameters()):
        close(p_gpu.grad, p_cpu.grad, name)
    return True


def test_moe_layer_bf16_with_grouped_mm(cuda_world):
    assert cuda_world.run(check_moe_layer_bf16) == [True]


def test_lse_merge_kernel_matches_cpu():
    gen = torch.Generator().manual_seed(3)
    out, lse = torch.randn(2, 4, 33, 64, generator=gen), torch.randn(2, 4, 33, generator=gen)
    block_out, block_lse = torch.randn(2, 4, 33, 64, generator=gen).bfloat16(), torch.randn(2, 4, 33, generator=gen)
    cuda_out, cuda_lse = out.cuda(), lse.cuda()
    torchdist_ext.ops.lse_merge_(cuda_out, cuda_lse, block_out.cuda(), block_lse.cuda())
    torchdist_ext.ops.lse_merge_(out, lse, block_out, block_lse)
    torch.testing.assert_close(cuda_out.cpu(), out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cuda_lse.cpu(), lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_cast_kernels_match_cpu(dtype):
    x = (torch.randn(67, 130, generator=torch.Generator().manual_seed(5)) * 300).to(dtype)
    x[3, 7] = float("inf")
    scale = torch.tensor([0.5])
    for fp8_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        cpu, cpu_amax = torchdist_ext.ops.fp8_cast_amax(x, scale, fp8_dtype)
        gpu, gpu_amax = torchdist_ext.ops.fp8_cast_amax(x.cuda(), scale.cuda(), fp8_dtype)
        assert torch.equal(gpu.cpu().view(torch.uint8), cpu.view(torch.uint8)) and torch.equal(gpu_amax.cpu(), cpu_amax)
        cpu_both = torchdist_ext.ops.fp8_cast_transpose_amax(x, scale, fp8_dtype, 16)
        gpu_both = torchdist_ext.ops.fp8_cast_transpose_amax(x.cuda(), scale.cuda(), fp8_dtype, 16)
        for ours, theirs in zip(gpu_both[:2], cpu_both[:2]):
            assert torch.equal(ours.cpu().view(torch.uint8), theirs.view(torch.uint8))
        assert torch.equal(gpu_both[2].cpu(), cpu_both[2])


def check_pipeline_on_cuda(schedule):
    """A one-rank pipeline of two stages (zb-v's V on one GPU, handed over in memory) on CUDA: the first step's
    collective on the NCCL group, the split W, the event clock and the caching allocator's live bytes; loss
    and gradients equal the whole model's on the same GPU."""
    from torch import nn

    from torchdist_ext.pipeline import Pipeline, stages_of_rank

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4))).cuda()
    inputs, targets = torch.randn(8, 16, device="cuda"), torch.randn(8, 16, device="cuda")
    F.mse_loss(model(inputs), targets).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    expected_loss = F.mse_loss(model(inputs), targets).detach()
    model.zero_grad(set_to_none=True)
    mesh = cached_mesh((1,), ("pp",), device_type="cuda")
    stages = {s: model[2 * s:2 * s + 2] for s in stages_of_rank(schedule, 1, 0)}
    pipe = Pipeline(stages, pp_mesh=mesh["pp"], schedule=schedule, num_microbatches=4, loss_fn=F.mse_loss)
    loss = pipe.step(inputs, targets)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=0)
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)
    assert {a.kind for a in pipe.timeline} == {"F", "B", "W"}
    assert all(a.start <= a.end and a.live_bytes > 0 for a in pipe.timeline)
    return True


def test_pipeline_on_cuda(cuda_world):
    assert cuda_world.run(check_pipeline_on_cuda, "zb-v") == [True]
