"""torch.compile(fullgraph=True) of tensor-parallel blocks on CPU with gloo: no graph breaks, same numbers as eager."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import torchdist_ext  # noqa: F401
from tests.numerics import assert_close_to_scale
from torchdist_ext.parallel import (
    ColumnParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from torchdist_ext.testing import cached_mesh

HIDDEN, FFN, VOCAB, BATCH, SEQ = 16, 32, 64, 2, 8


class LanguageModelBlock(nn.Module):
    """embedding -> norm -> column -> gelu -> row (residual) -> norm -> LM head -> loss."""

    def __init__(self, tp_mesh, sequence_parallel):
        super().__init__()
        kw = dict(tp_mesh=tp_mesh, sequence_parallel=sequence_parallel)
        self.tp_mesh = tp_mesh
        self.embed = VocabParallelEmbedding(VOCAB, HIDDEN, **kw)
        self.norm = RMSNorm(HIDDEN, **kw)
        self.up = ColumnParallelLinear(HIDDEN, FFN, **kw)
        self.down = RowParallelLinear(FFN, HIDDEN, **kw)
        self.final_norm = RMSNorm(HIDDEN, **kw)
        self.head = ColumnParallelLinear(HIDDEN, VOCAB, bias=False, **kw)

    def forward(self, ids, target):
        h = self.embed(ids)
        h = h + self.down(nn.functional.gelu(self.up(self.norm(h))))
        logits = self.head(self.final_norm(h))
        return vocab_parallel_cross_entropy(logits, target, tp_mesh=self.tp_mesh)


def check_compiled_matches_eager(sequence_parallel, dynamic):
    """Compiled equals eager, loss at every sequence length and the gradients summed over them; with
    dynamic shapes three lengths run on one graph (no recompile)."""
    torch.manual_seed(0)
    mesh = cached_mesh((dist.get_world_size(),), ("tp",))
    eager = LanguageModelBlock(mesh, sequence_parallel)
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(eager), fullgraph=True, dynamic=dynamic)
    for step, seq in enumerate((SEQ, 2 * SEQ, 3 * SEQ) if dynamic else (SEQ,)):
        gen = torch.Generator().manual_seed(seq)
        ids = torch.randint(0, VOCAB, (BATCH, seq), generator=gen)
        target = torch.randint(0, VOCAB, (BATCH, seq), generator=gen)
        with torch.compiler.set_stance("fail_on_recompile" if step else "default"):
            compiled_loss = compiled(ids, target)
            compiled_loss.backward()
        eager_loss = eager(ids, target)
        eager_loss.backward()
        assert_close_to_scale(compiled_loss, eager_loss, what=f"loss at sequence length {seq}")
    for (name, p_c), p_e in zip(compiled.named_parameters(), eager.parameters()):
        assert_close_to_scale(p_c.grad.full_tensor(), p_e.grad.full_tensor(), what=f"{name} grad")
    return True


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_compiled_block_matches_eager(world2, sequence_parallel, dynamic):
    assert all(world2.run(check_compiled_matches_eager, sequence_parallel, dynamic))
