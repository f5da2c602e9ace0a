"""Pipeline parallelism of a parallelised HF causal LM: its decoder layers split into stages over a pipeline
mesh (the embedding on the first, the final norm and LM head on the last), trained by ``HFPipeline.step``."""

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from torchdist_ext import _collectives as collectives
from torchdist_ext.agreement import check_agreement
from torchdist_ext.integrations.hf.batch import (
    IGNORE_INDEX,
    prepare_batch,
    shard_hf_batch,
)
from torchdist_ext.integrations.hf.loss import ParallelCausalLMLoss
from torchdist_ext.parallel.mesh_group import MeshGroup
from torchdist_ext.pipeline import (
    Pipeline,
    num_stages,
    partition_layers,
    stages_of_rank,
)

__all__ = ["HFPipeline", "HFStage", "refuse_forward", "split_into_stages"]


class HFStage(nn.Module):
    """One pipeline stage: the decoder layers of ``layers`` (the model's own modules), with the embedding on the
    ``first`` stage and the final norm and LM head on the ``last``.

    forward: ``x`` (token ids ``[batch, seq]`` on the first stage, else hidden states ``[batch, seq, hidden]``,
    sequence-sharded as the layers pass them on), ``position_ids`` ``[batch, seq]`` (global) and optionally
    ``document_ids`` and ``cp_positions`` ``[batch, seq]`` (``shard_hf_batch``'s) -> hidden states, or the
    logits (vocab-sharded under tp) on the last stage."""

    def __init__(self, model: nn.Module, layers: range, *, first: bool, last: bool):
        super().__init__()
        decoder = model.model
        self.embed_tokens = decoder.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): decoder.layers[str(i)] for i in layers})
        self.norm = decoder.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.rotary_emb = decoder.rotary_emb

    def forward(self, x: Tensor, position_ids: Tensor, document_ids: Tensor | None = None,
                cp_positions: Tensor | None = None) -> Tensor:
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
        position_embeddings = self.rotary_emb(x, position_ids)
        for layer in self.layers.values():
            x = layer(x, attention_mask=None, position_ids=position_ids, position_embeddings=position_embeddings,
                      document_ids=document_ids, cp_positions=cp_positions)
        return x if self.lm_head is None else self.lm_head(self.norm(x))


class HFPipeline:
    """The training step of a pipelined ``parallelize_hf_model`` model (``model.pipeline``).

    ``step(batch)``: ``batch`` is what this data-parallel rank would pass the single-process model
    (``input_ids`` ``[batch, seq]``, optional ``labels``, 2-D ``attention_mask``, ``position_ids``; the same on
    every pipeline, tensor- and context-parallel rank of it), split along dim 0 into the micro-batches. Runs
    the forward and backward of every micro-batch by the schedule and returns the whole batch's loss over
    every data- and context-parallel rank (0-d, the same on every rank): the single-process model's, as
    ``model(**batch).loss`` is without pipelining; the gradients are in the parameters (FSDP2 shards).

    Attributes: ``stages`` (``{stage index: HFStage}`` of this rank), ``schedule`` (the ``Pipeline``)."""

    def __init__(self, stages: dict[int, nn.Module], *, pp_mesh: DeviceMesh, schedule: str, num_microbatches: int,
                 virtual_stages: int, tp: MeshGroup | None, tp_mesh: DeviceMesh | None,
                 data_group: MeshGroup | None, cp_mesh: DeviceMesh | None, cp_order: str):
        self.stages, self.data_group, self.cp_mesh, self.cp_order = stages, data_group, cp_mesh, cp_order
        self.pp_group = pp_mesh.get_group()
        self._loss = ParallelCausalLMLoss(tp, tp_mesh, None, context_parallel=False)
        self._num_items: Tensor | None = None
        self.schedule = Pipeline(stages, pp_mesh=pp_mesh, schedule=schedule, num_microbatches=num_microbatches,
                                 loss_fn=self._loss_of_microbatch, virtual_stages=virtual_stages,
                                 loss_reduction="sum")

    def _loss_of_microbatch(self, logits: Tensor, shift_labels: Tensor) -> Tensor:
        return self._loss(logits, None, num_items_in_batch=self._num_items, shift_labels=shift_labels)

    def step(self, batch: dict) -> Tensor:
        local = {}

        def validate():
            local.update(prepare_batch(batch, lambda ids: (lambda x: x, {}), None) if self.cp_mesh is None else
                         shard_hf_batch(batch, cp_mesh=self.cp_mesh, order=self.cp_order))
            if local.get("shift_labels") is None:
                raise ValueError("a pipelined parallelize_hf_model model trains on batches with labels")
            local["count"] = (local["shift_labels"] != IGNORE_INDEX).sum()

        # The ranks of one pipeline take the same batch: its shapes and target count agree, or all raise.
        check_agreement(self.pp_group, "HFPipeline.step", lambda: {
            "input_ids": local["input_ids"], "document_ids": local["document_ids"],
            "target tokens": int(local["count"])}, validate)
        count = local["count"]
        self._num_items = count if self.data_group is None else collectives.all_reduce(count, self.data_group.name)
        stage_inputs = {"position_ids": local["position_ids"]}
        for key in ("document_ids", "cp_positions"):
            if local.get(key) is not None:
                stage_inputs[key] = local[key]
        loss = self.schedule.step(local["input_ids"], local["shift_labels"], stage_inputs=stage_inputs)
        return loss if self.data_group is None else collectives.all_reduce(loss, self.data_group.name)


def split_into_stages(model: nn.Module, pp_mesh: DeviceMesh, schedule: str,
                      virtual_stages: int) -> dict[int, HFStage]:
    """This rank's stages (``stages_of_rank``), the layers ``partition_layers`` gives each; the decoder keeps
    only those layers (a ``ModuleDict`` by their indices: names stay HF's)."""
    decoder = model.model
    count = num_stages(schedule, pp_mesh.size(), virtual_stages)
    parts = partition_layers(len(decoder.layers), count)
    mine = stages_of_rank(schedule, pp_mesh.size(), pp_mesh.get_local_rank(), virtual_stages)
    decoder.layers = nn.ModuleDict({str(i): decoder.layers[i] for s in mine for i in parts[s]})
    if 0 not in mine:
        decoder.embed_tokens = None
    if count - 1 not in mine:
        decoder.norm = model.lm_head = None
    return {s: HFStage(model, parts[s], first=s == 0, last=s == count - 1) for s in mine}


def refuse_forward(*args, **kwargs):
    raise ValueError("a pipelined parallelize_hf_model model trains through model.pipeline.step(batch) (forward "
                     "and backward of every micro-batch); its forward is not callable on its own")

