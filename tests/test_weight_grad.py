"""The weight-gradient split (torchdist_ext._weight_grad): B now and W later leave exactly the gradients
of the unsplit backward, for SplitLinear and for our column / row linears with and without sequence
parallelism on 2 ranks (with the vocab-parallel embedding and RMSNorm, and in fp8), over several micro-batches
whose W steps run after all their B steps; compiled with fullgraph=True, the split equals the eager one."""

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchdist_ext.fp8 import DelayedScaling, convert_to_fp8
from torchdist_ext.parallel import ColumnParallelLinear, RMSNorm, RowParallelLinear, VocabParallelEmbedding
from torchdist_ext._weight_grad import SplitLinear, WeightGradStore
from torchdist_ext.testing import cached_mesh


def grads(model) -> list[torch.Tensor]:
    return [(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone() for p in model.parameters()]


def train_microbatches(model, inputs, split: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Backward of every micro-batch (its W queued when split), then every W: (input grads, param grads)."""
    store = WeightGradStore()
    input_grads = []
    for index, x in enumerate(inputs):
        x = x.clone().requires_grad_()
        out = model(x)
        if split:
            with store.collecting(index):
                out.square().sum().backward()
        else:
            out.square().sum().backward()
        input_grads.append(x.grad)
    if split:
        weights = [p for name, p in model.named_parameters() if name.endswith("weight")]
        assert all(p.grad is None for p in weights), "the weight gradients must wait for W"
        assert store.pending() == list(range(len(inputs)))
        for index in range(len(inputs)):
            store.run(index)
        assert store.pending() == []
    return input_grads, grads(model)


def two_linears_and_inputs() -> tuple[nn.Sequential, list[torch.Tensor]]:
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(32, 48), nn.Tanh(), nn.Linear(48, 16, bias=False))
    return reference, [torch.randn(3, 5, 32) for _ in range(3)]


def split_copy(reference: nn.Sequential) -> nn.Sequential:
    """``reference``'s two linears as SplitLinears holding its parameters, gradients cleared."""
    model = nn.Sequential(SplitLinear.from_linear(reference[0]), nn.Tanh(), SplitLinear.from_linear(reference[2]))
    for p in model.parameters():
        p.grad = None
    return model


def test_split_linear_equals_its_unsplit_backward_and_nn_linear():
    reference, inputs = two_linears_and_inputs()
    results = [train_microbatches(split_copy(reference), inputs, split) for split in (False, True)]
    (unsplit_x, unsplit_p), (split_x, split_p) = results
    assert all(torch.equal(a, b) for a, b in zip(unsplit_x + unsplit_p, split_x + split_p))
    for p in reference.parameters():
        p.grad = None
    plain_x, plain_p = train_microbatches(reference, inputs, split=False)
    for a, b in zip(plain_x + plain_p, split_x + split_p):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)


def test_split_linear_under_autocast_computes_in_the_autocast_dtype():
    torch.manual_seed(0)
    linear = nn.Linear(32, 16)
    split = SplitLinear.from_linear(linear)
    x = torch.randn(4, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, out = linear(x), split(x)
    assert out.dtype == expected.dtype == torch.bfloat16
    # nn.Linear adds the bias inside its bf16 GEMM (one rounding), the split layer after it (two): one bf16 ulp
    # apart (2^-7 relative), or a unit roundoff (2^-8) of the output's scale where the sum cancels.
    torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7, atol=2**-8 * expected.abs().max().item())


def test_split_linear_refuses_other_modules():
    with pytest.raises(TypeError, match="linear must be an nn.Linear"):
        SplitLinear.from_linear(nn.Conv1d(2, 2, 1))


def test_compiled_split_linear_defers_and_equals_eager():
    reference, inputs = two_linears_and_inputs()
    results = []
    for compiled in (False, True):
        model = split_copy(reference)
        if compiled:
            torch._dynamo.reset()
            model.compile(fullgraph=True, backend="inductor")
        results.append(train_microbatches(model, inputs, split=True))
    for eager, compiled in zip(*(x + p for x, p in results)):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)


def test_compiled_split_without_a_store_adds_into_grad():
    torch.manual_seed(0)
    reference = nn.Linear(32, 16)
    model = SplitLinear.from_linear(nn.Linear(32, 16))
    model.load_state_dict(reference.state_dict())
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(4, 32)
    for _ in range(2):  # the second backward accumulates
        compiled(x).square().sum().backward()
        reference(x).square().sum().backward()
    torch.testing.assert_close(model.weight.grad, reference.weight.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(model.bias.grad, reference.bias.grad, rtol=1e-6, atol=1e-6)


def test_compiled_split_needs_a_slot_and_refuses_fp8_and_the_embedding():
    layer = nn.Linear(16, 16)
    layer.__class__ = SplitLinear  # as a pipeline would, but without giving the slot
    with pytest.raises(Exception, match="needs its weight-gradient slot"):
        torch.compile(layer, fullgraph=True, backend="eager")(torch.randn(2, 16))
    model = convert_to_fp8(nn.Sequential(nn.Linear(16, 16)), DelayedScaling(amax_history_len=4))
    model[0].split_weight_grad = True
    with pytest.raises(Exception, match="fp8 linears in split mode"):
        torch.compile(model, fullgraph=True, backend="eager")(torch.randn(2, 16))
    with pytest.raises(TypeError, match="split_weight_grad must be a bool"):
        model[0].split_weight_grad = 1


def test_split_weight_grad_slot_is_per_layer_and_not_in_the_state_dict():
    a, b = SplitLinear(4, 4), SplitLinear(4, 4)
    assert int(a._weight_grad_slot) != int(b._weight_grad_slot)
    assert "_weight_grad_slot" not in a.state_dict()


class Embedded(nn.Module):
    """ids -> embedding -> (the rest), with the input gradient of the rest checked on a float input."""

    def __init__(self, embedding, rest):
        super().__init__()
        self.embedding, self.rest = embedding, rest

    def forward(self, x):
        return self.rest(x + self.embedding(self.ids))


def tp_split_matches(sequence_parallel: bool, fp8: bool = False, compiled: bool = False):
    tp = cached_mesh((2,), ("tp",))
    torch.manual_seed(0)
    embedding, norm = nn.Embedding(10, 16), nn.RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    up, down = nn.Linear(16, 32), nn.Linear(32, 16)
    ids = torch.randint(0, 10, (2, 8))
    inputs = [torch.randn(2, 8, 16) for _ in range(3)]
    if sequence_parallel:
        inputs = [x.chunk(2, dim=1)[tp.get_local_rank()] for x in inputs]
    results = []
    for split in (False, True):
        kw = dict(tp_mesh=tp, sequence_parallel=sequence_parallel)
        layers = [RMSNorm.from_rms_norm(norm, **kw), ColumnParallelLinear.from_linear(up, **kw), nn.GELU(),
                  RowParallelLinear.from_linear(down, **kw)]
        model = Embedded(VocabParallelEmbedding.from_embedding(embedding, **kw), nn.Sequential(*layers))
        model.ids = ids
        if fp8:
            convert_to_fp8(model, DelayedScaling(amax_history_len=4))
        for layer in (model.embedding, *layers):
            if hasattr(layer, "split_weight_grad"):
                layer.split_weight_grad = split
        if compiled and split:  # the embedding stays eager, as in a pipeline's first stage
            torch._dynamo.reset()
            model.rest.compile(fullgraph=True)
        results.append(train_microbatches(model, inputs, split))
    (unsplit_x, unsplit_p), (split_x, split_p) = results
    if compiled:
        for a, b in zip(unsplit_x + unsplit_p, split_x + split_p):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        return True
    return all(torch.equal(a, b) for a, b in zip(unsplit_x + unsplit_p, split_x + split_p))


@pytest.mark.parametrize("sequence_parallel, fp8", [(False, False), (True, False), (True, True)],
                         ids=["tp2", "tp2-sp", "tp2-sp-fp8"])
def test_tensor_parallel_split_equals_unsplit_bit_for_bit(world2, sequence_parallel, fp8):
    assert all(world2.run(tp_split_matches, sequence_parallel, fp8))


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_compiled_tensor_parallel_split_equals_unsplit(world2, sequence_parallel):
    assert all(world2.run(tp_split_matches, sequence_parallel, compiled=True))


def test_fp8_linear_split_equals_unsplit_bit_for_bit():
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(32, 48), nn.Tanh(), nn.Linear(48, 16))
    inputs = [torch.randn(3, 5, 32) for _ in range(3)]
    results = []
    for split in (False, True):
        model = nn.Sequential(nn.Linear(32, 48), nn.Tanh(), nn.Linear(48, 16))
        model.load_state_dict(reference.state_dict())
        convert_to_fp8(model, DelayedScaling(amax_history_len=4))
        model[0].split_weight_grad = model[2].split_weight_grad = split
        results.append(train_microbatches(model, inputs, split) + ([m.amax_history.clone() for m in (model[0], model[2])],))
    (ux, up, uh), (sx, sp, sh) = results
    assert all(torch.equal(a, b) for a, b in zip(ux + up + uh, sx + sp + sh))
