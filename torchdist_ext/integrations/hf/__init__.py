"""Hugging Face Llama-family causal LMs (Llama, Mistral, Qwen2, Qwen3: one set of module names) on our layers:
tensor, sequence and context parallelism and FSDP2, with the single-process model's loss; and checkpoints in
and out of HF's format.

    parallelize_hf_model(model, tp_mesh=mesh["tp"], dp_mesh=mesh["dp"], cp_mesh=mesh["cp"],
                         sequence_parallel=True)
    loss = model(**shard_hf_batch(batch, cp_mesh=mesh["cp"])).loss   # == the single-process loss

``transformers`` is imported only to register the attention function. Design: docs/architecture.md.
"""

from torchdist_ext.integrations.hf.attention import ATTENTION_NAME, CP_METHODS
from torchdist_ext.integrations.hf.batch import (
           document_ids_from,
           global_num_items,
           shard_hf_batch,
)
from torchdist_ext.integrations.hf.checkpoint import (
           load_hf_checkpoint,
           save_hf_checkpoint,
)
from torchdist_ext.integrations.hf.loss import ParallelCausalLMLoss
from torchdist_ext.integrations.hf.parallelize import MODEL_TYPES, parallelize_hf_model
from torchdist_ext.integrations.hf.pipeline import HFPipeline, HFStage

__all__ = [
           "ATTENTION_NAME",
           "CP_METHODS",
           "MODEL_TYPES",
           "HFPipeline",
           "HFStage",
           "ParallelCausalLMLoss",
           "document_ids_from",
           "global_num_items",
           "load_hf_checkpoint",
           "parallelize_hf_model",
           "save_hf_checkpoint",
           "shard_hf_batch",
]
