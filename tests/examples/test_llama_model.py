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
