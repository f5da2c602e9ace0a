"""examples/llama.py's single-process model: documents packed in a row attend only within themselves, so
that each document's logits and gradients are those it has alone at the same positions."""

import sys

import torch

from tests.examples.test_train_llama import ROOT

sys.path.insert(0, str(ROOT / "examples"))
from llama import Llama, LlamaConfig  # noqa: E402


def test_packed_documents_equal_each_document_alone():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=48, max_seq_len=16))
    model.double()
    model.loss_fn = lambda logits, target: logits  # the logits themselves
    lengths = [5, 1, 7, 3]
    tokens = torch.randint(0, 256, (1, sum(lengths)))
    documents = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).unsqueeze(0)
    weights = torch.randn(1, sum(lengths), 256, dtype=torch.float64)  # a loss that reads every logit

    packed = model(tokens, None, document_ids=documents)
    (packed * weights).sum().backward()
    packed_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    alone = []
    positions = torch.arange(sum(lengths)).split(lengths)
    for part, w, at in zip(tokens.split(lengths, dim=1), weights.split(lengths, dim=1), positions):
        alone.append(model(part, None, at))
        (alone[-1] * w).sum().backward()
    torch.testing.assert_close(packed, torch.cat(alone, dim=1), rtol=1e-10, atol=1e-10)
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], p.grad, rtol=1e-10, atol=1e-10, msg=name)
    # Without the documents the row is one causal sequence: the later documents see the earlier ones.
    assert not torch.allclose(model(tokens, None), packed)


def test_rows_in_any_order_with_their_positions_equal_the_row():
    """Per-row positions [batch, seq] (a balanced plan's order) give RoPE and the causal mask: a row whose
    tokens are permuted, with their positions, yields the same logits, permuted, and the same gradients."""
    torch.manual_seed(1)
    model = Llama(LlamaConfig(dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=48, max_seq_len=16))
    model.double()
    model.loss_fn = lambda logits, target: logits
    tokens = torch.randint(0, 256, (2, 12))
    documents = torch.tensor([[0] * 5 + [1] * 7, [2] * 12])
    weights = torch.randn(2, 12, 256, dtype=torch.float64)
    in_order = model(tokens, None, document_ids=documents)
    (in_order * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    order = torch.stack([torch.randperm(12), torch.randperm(12)])
    take = lambda t: t.gather(1, order if t.dim() == 2 else order[..., None].expand(-1, -1, t.shape[-1]))  # noqa: E731
    permuted = model(take(tokens), None, order, take(documents))
    (permuted * take(weights)).sum().backward()
    torch.testing.assert_close(permuted, take(in_order), rtol=1e-10, atol=1e-10)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-10, atol=1e-10, msg=name)
