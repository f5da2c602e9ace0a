"""The MoE layer with FSDP2 and distributed checkpoints.

FSDP2: 4 ranks, dp=4 with ep=2 carved out of them (ep groups {0, 1} and {2, 3}): experts
sharded over ep and fully_shard-ed over the 2 ranks holding the same experts, everything else
over all 4; the loss, every gradient and one optimizer step equal one process on the whole batch.
Also ep=4, where each expert lives on one rank and FSDP has no one to reduce its gradient with.
DCP: saved at ep=2, loaded at ep=4 and at ep=1; the outputs equal the saved model's.
"""

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import fully_shard

import torchdist_ext  # noqa: F401
from tests.numerics import assert_close_to_scale
from tests.parallel.test_moe import DIM, FFN, TOKENS, full_weights, reference_moe
from torchdist_ext.parallel import MoE, fully_shard_moe
from torchdist_ext.testing import cached_mesh

EXPERTS = 4


class Net(nn.Module):
    """A dense projection, then a residual MoE block."""

    def __init__(self, moe: nn.Module, proj: nn.Linear):
        super().__init__()
        self.proj, self.moe = proj, moe

    def forward(self, x):
        h = self.proj(x)
        return h + self.moe(h)


def projection():
    torch.manual_seed(0)
    return nn.Linear(DIM, DIM)


def loss_of(y):
    return (y.sin() * y).mean()


def check_fsdp_dp4(ep):
    mesh = cached_mesh((4 // ep, ep), ("expert_dp", "ep"))
    dp = mesh["expert_dp", "ep"]._flatten("dp")
    gate, w1, w3, w2, shared = full_weights(EXPERTS, 1)
    batch = torch.randn(4, TOKENS, DIM, generator=torch.Generator().manual_seed(2))

    # One process on the whole batch (dropless routing does not depend on how tokens are split).
    proj = projection()
    params = [t.clone().requires_grad_(True) for t in (gate, w1, w3, w2)]
    shared_params = [t.clone().requires_grad_(True) for t in shared]
    h = proj(batch.view(-1, DIM))
    out, _, _, _ = reference_moe(h, *params, shared_params, 2, "softmax", None, "probs")
    expected_loss = loss_of(h + out.float())
    expected_loss.backward()

    model = Net(MoE.from_experts(gate, w1, w3, w2, ep_mesh=mesh["ep"], shared=shared), projection())
    fully_shard_moe(model.moe, dp_mesh=dp, expert_dp_mesh=mesh["expert_dp"])
    fully_shard(model.proj, mesh=dp)
    fully_shard(model, mesh=dp)
    loss = loss_of(model(batch[dist.get_rank()]))
    loss.backward()
    global_loss = loss.detach().clone()
    dist.all_reduce(global_loss)
    assert_close_to_scale(global_loss / 4, expected_loss, what="loss")
    reference = {"proj.weight": proj.weight, "proj.bias": proj.bias, "moe.gate": params[0],
                 "moe.experts.w1": params[1], "moe.experts.w3": params[2], "moe.experts.w2": params[3],
                 "moe.shared_w1": shared_params[0], "moe.shared_w3": shared_params[1], "moe.shared_w2": shared_params[2]}
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    assert set(grads) == set(reference)
    for name, ref in reference.items():
        assert_close_to_scale(grads[name], ref.grad, what=f"{name} grad")

    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    optimizer.step()
    with torch.no_grad():
        for name, ref in reference.items():
            ref -= 0.5 * ref.grad
    for name, p in model.named_parameters():
        assert_close_to_scale(p.full_tensor(), reference[name], what=f"{name} after a step")
    return True


@pytest.mark.parametrize("ep", [2, 4])
def test_fsdp_dp4_matches_one_process(world4, ep):
    assert all(world4.run(check_fsdp_dp4, ep))


def moe_on(mesh_shape, seed_weights=True):
    mesh = cached_mesh(mesh_shape, ("dp", "ep"))
    if seed_weights:
        gate, w1, w3, w2, shared = full_weights(EXPERTS, 1)
        return MoE.from_experts(gate, w1, w3, w2, ep_mesh=mesh["ep"], shared=shared)
    torch.manual_seed(123)  # other weights: the load must replace them all
    return MoE(DIM, FFN, EXPERTS, ep_mesh=mesh["ep"], num_shared_experts=1)


def tokens():
    return torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(7))


def save_at_ep2(path):
    moe = moe_on((1, 2))
    dcp.save(get_model_state_dict(moe), checkpoint_id=path)
    return moe(tokens()).detach()


def load_and_run(path, mesh_shape):
    moe = moe_on(mesh_shape, seed_weights=False)
    state = get_model_state_dict(moe)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(moe, state)
    return moe(tokens()).detach()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_save_at_ep2_load_at_ep4_and_ep1(world2, world4, tmp_path):
    path = str(tmp_path / "moe")
    saved = world2.run(save_at_ep2, path)[0]
    for mesh_shape in ((1, 4), (4, 1)):
        for out in world4.run(load_and_run, path, mesh_shape):
            assert_close_to_scale(out, saved, what=f"output after loading on a {mesh_shape} (dp, ep) mesh")
