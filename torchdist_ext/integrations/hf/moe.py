"""The sparse MoE blocks of Hugging Face's Mixtral, Qwen2-MoE and Qwen3-MoE as our expert-parallel ``MoE``."""

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from torchdist_ext.parallel import MoE
from torchdist_ext.parallel.mesh_group import MeshGroup
from torchdist_ext.parallel.regions import gather_from_region, scatter_to_region

__all__ = ["MOE_MODEL_TYPES", "HFMoEBlock", "is_moe_block", "moe_from_hf_block"]

MOE_MODEL_TYPES = frozenset({"mixtral", "qwen2_moe", "qwen3_moe"})


def is_moe_block(module: nn.Module) -> bool:
    """Whether ``module`` (a decoder layer's ``mlp``) is an HF sparse MoE block: a router ``gate`` and stacked
    ``experts`` (``gate_up_proj [E, 2 ffn, hidden]``, ``down_proj [E, hidden, ffn]``)."""
    return hasattr(module, "gate") and hasattr(getattr(module, "experts", None), "gate_up_proj")


def _shared_expert(block: nn.Module):
    mlp = getattr(block, "shared_expert", None)
    return None if mlp is None else (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)


def moe_from_hf_block(block: nn.Module, config, *, ep_mesh: DeviceMesh) -> MoE:
    """Our ``MoE`` over ``ep_mesh`` holding ``block``'s weights (the fused ``gate_up_proj`` split into w1, the
    gate inside silu, and w3), routing as the config says: Mixtral normalises the top-k weights, Qwen-MoE as
    ``config.norm_topk_prob``; Qwen2-MoE's shared expert with its sigmoid gate."""
    gate_up = block.experts.gate_up_proj.detach()
    ffn = gate_up.shape[1] // 2
    shared = _shared_expert(block)
    if shared is not None and shared[0].shape[0] % ffn:
        raise ValueError(f"config.shared_expert_intermediate_size={shared[0].shape[0]} must be a multiple of "
                         f"config.moe_intermediate_size={ffn} (our shared experts are S experts' width)")
    norm = True if config.model_type == "mixtral" else bool(config.norm_topk_prob)
    shared_gate = getattr(block, "shared_expert_gate", None)
    return MoE.from_experts(block.gate.weight.detach(), gate_up[:, :ffn].contiguous(), gate_up[:, ffn:].contiguous(),
                            block.experts.down_proj.detach(), ep_mesh=ep_mesh, top_k=config.num_experts_per_tok,
                            norm_topk_prob=norm, shared=None if shared is None else tuple(w.detach() for w in shared),
                            shared_gate=None if shared_gate is None else shared_gate.weight.detach())


class HFMoEBlock(nn.Module):
    """A decoder layer's ``mlp``: ``moe`` on the layer's tokens ``[batch, seq, hidden]``. Under tensor
    parallelism every tp rank runs the same MoE on the same tokens: with sequence parallelism they arrive
    sharded over tp, are gathered first and this rank's shard of the output kept, so that the MoE's gradients
    need no reduction over tp."""

    def __init__(self, moe: MoE, tp_mesh: DeviceMesh | None, sequence_parallel: bool):
        super().__init__()
        self.moe = moe
        self.tp = MeshGroup.of(tp_mesh) if tp_mesh is not None and sequence_parallel else None

    def forward(self, hidden_states: Tensor) -> Tensor:
        if self.tp is None:
            return self.moe(hidden_states)
        return scatter_to_region(self.moe(gather_from_region(hidden_states, self.tp, 1)), self.tp, 1)
