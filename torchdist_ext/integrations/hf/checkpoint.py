"""A parallelised HF model's weights to and from a ``save_pretrained`` directory (safetensors shards and their
index), each rank reading and writing only its own shards, through torch DCP's Hugging Face storage."""

import contextlib
import os
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import (
    HuggingFaceStorageReader,
    HuggingFaceStorageWriter,
)
from torch.distributed.checkpoint._consolidate_hf_safetensors import (
    consolidate_safetensors_files,
    consolidate_safetensors_files_on_every_rank,
)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from torchdist_ext.agreement import check_agreement
from torchdist_ext.fp8.state import Fp8State
from torchdist_ext.integrations.hf.moe import HFMoEBlock

__all__ = ["load_hf_checkpoint", "save_hf_checkpoint"]

_SHARDED = "sharded"  # the ranks' own files, under the target directory while they are consolidated
DEFAULT_SHARD_BYTES = 5 * 2**30


def _weights(model: nn.Module) -> dict[str, Tensor]:
    """The model's parameters as HF names them (DTensors where the model is sharded), without the LM head's
    weight when it is tied to the embedding (``save_pretrained`` writes it once). Buffers (fp8 histories and
    scales) stay out: HF's format holds the weights only (DCP checkpoints keep them)."""
    _check_model(model)
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    head, embedding = getattr(model, "lm_head", None), getattr(model.model, "embed_tokens", None)
    if head is not None and embedding is not None and head.weight is embedding.weight:
        names.discard("lm_head.weight")
    return {name: tensor for name, tensor in get_model_state_dict(model).items() if name in names}


def _check_model(model: nn.Module) -> None:
    if not isinstance(model, nn.Module) or getattr(model, "config", None) is None or \
            not isinstance(getattr(model, "model", None), nn.Module):
        raise TypeError(f"model must be a Hugging Face causal LM (with .config and .model), got {type(model).__name__}")
    if any(isinstance(module, HFMoEBlock) for module in model.modules()):
        raise ValueError(f"HF checkpoints of a parallelised MoE model ({model.config.model_type}) are not supported "
                         "yet: its experts are our MoE's w1/w3/w2, not HF's gate_up_proj; use "
                         "torchdist_ext.checkpoint.save / load (any layout, DCP)")


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()  # (a DTensor's numel is the full tensor's)


def _every_rank_weights(state: dict[str, Tensor], group) -> dict[str, int]:
    """Weight name -> bytes over every rank's ``state`` (pipeline ranks hold different weights), in rank order and
    then state-dict order: the same on every rank."""
    sizes = [(name, _nbytes(tensor)) for name, tensor in state.items()]
    if group is None:
        return dict(sizes)
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, sizes, group=group)
    every: dict[str, int] = {}
    for rank_sizes in gathered:
        for name, size in rank_sizes:
            every.setdefault(name, size)
    return every


def _file_of_each_weight(sizes: dict[str, int], max_shard_bytes: int) -> dict[str, int]:
    """Weight name -> output file number (1, 2, ...): in order, a new file when the next weight would take the
    current one over ``max_shard_bytes`` (HF's rule; a larger weight gets a file of its own)."""
    files, index, filled = {}, 1, 0
    for name, size in sizes.items():
        if filled and filled + size > max_shard_bytes:
            index, filled = index + 1, 0
        files[name] = index
        filled += size
    return files


@contextlib.contextmanager
def _plain_errors(call: str, path: str):
    """DCP's ``CheckpointException`` (a ``BaseException``, raised on every rank, its causes in a traceback text)
    as a ``ValueError`` naming the call, the path and the first rank's cause: a weight the checkpoint lacks, a
    shape that differs, a path that cannot be written. Without torch.distributed, DCP's warning that it
    assumes one process is not shown: that is what the call asks for."""
    try:
        with warnings.catch_warnings():  # (in one process DCP warns that it assumes one process: we ask for it)
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            yield
    except CheckpointException as error:
        rank, (cause, _) = next(iter(error.failures.items()))
        raise ValueError(f"{call}({path!r}) failed on rank {rank}: {type(cause).__name__}: {cause}") from error


def _default_group():
    """Every rank holds a part of the model: the default group (None in one process)."""
    return dist.group.WORLD if dist.is_initialized() else None


def save_hf_checkpoint(model: nn.Module, path: str | os.PathLike, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
    """Writes ``model``'s weights and config to ``path`` as ``save_pretrained`` does: ``model-0000i-of-0000n.
    safetensors`` files of at most ``max_shard_bytes`` each (one weight larger than that gets a file of its own),
    ``model.safetensors.index.json`` and ``config.json``, which ``from_pretrained`` reads in one process.

    Call it on every rank of a ``parallelize_hf_model`` model (or in one process with a plain HF model); a
    pipelined model's ranks each write their stages' weights. Each rank first writes the parts of the weights
    it holds (DTensor shards: tp and FSDP2 slices; a replicated weight once) under ``path/sharded``; then the
    ranks assemble the output files, each rank some of them, one weight at a time: no rank ever holds more
    than one full weight. Weights keep their dtype. A failure (a path that cannot be written) raises a
    ``ValueError`` on every rank."""
    path = os.fspath(path)

    def validate():
        if not isinstance(max_shard_bytes, int) or isinstance(max_shard_bytes, bool) or max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"path {path!r} is a file; save_hf_checkpoint writes a directory")

    group = _default_group()
    check_agreement(group, "save_hf_checkpoint", {"path": path, "max_shard_bytes": max_shard_bytes}, validate)
    state = _weights(model)
    files = _file_of_each_weight(_every_rank_weights(state, group), max_shard_bytes)
    sharded = os.path.join(path, _SHARDED)
    with _plain_errors("save_hf_checkpoint", path):
        writer = HuggingFaceStorageWriter(sharded, fqn_to_index_mapping=files, save_distributed=True)
        dcp.save(state, storage_writer=writer, process_group=group, no_dist=group is None)
    if group is None:  # (the every-rank form writes the index only under torch.distributed)
        consolidate_safetensors_files(sharded, path, files)
    else:
        consolidate_safetensors_files_on_every_rank(sharded, path, files, process_group=group)
    if group is not None:
        dist.barrier(group)
    if group is None or dist.get_rank(group) == 0:
        shutil.rmtree(sharded)
        model.config.save_pretrained(path)
        generation_config = getattr(model, "generation_config", None)
        if generation_config is not None and model.can_generate():
            generation_config.save_pretrained(path)
    if group is not None:
        dist.barrier(group)


def _materialise(model: nn.Module) -> None:
    """A model built on the meta device (parameters and buffers) gets storage on the CPU, or on this rank's
    accelerator when torch has one; a tied LM head stays tied; the buffers no HF checkpoint holds are set to
    their start: the rotary embedding's frequencies computed again, fp8 histories and scales reset."""
    if not any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return
    device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else torch.device("cpu")
    head, embedding = getattr(model, "lm_head", None), getattr(model.model, "embed_tokens", None)
    tied = head is not None and embedding is not None and head.weight is embedding.weight
    model.to_empty(device=device)
    if tied:  # (to_empty gives each module a new Parameter off the meta device)
        head.weight = embedding.weight
    for module in model.modules():
        if isinstance(module, Fp8State) and module.fp8_recipe is not None:
            module.reset_fp8_state()
    rotary = getattr(model.model, "rotary_emb", None)
    if rotary is not None:
        with torch.device(device):
            fresh = type(rotary)(rotary.config)
        with torch.no_grad():
            for name, buffer in fresh.named_buffers():
                rotary.get_buffer(name).copy_(buffer)


def load_hf_checkpoint(model: nn.Module, path: str | os.PathLike) -> None:
    """Loads a ``save_pretrained`` (or ``save_hf_checkpoint``) directory into ``model`` in place.

    ``model``: a ``parallelize_hf_model`` model (call on every rank) or a plain HF model in one process, best
    built on the meta device (``with torch.device("meta"): model = AutoModelForCausalLM.from_config(config)``)
    and parallelised there: it is then given storage here and no rank ever holds the full model. Each rank
    reads only the slices of the safetensors files its shards hold; weights are cast to the model's dtype. A
    weight the model has and the directory lacks, or holds at another shape, is a ``ValueError`` on every rank
    naming it."""
    path = os.fspath(path)

    def validate():
        if not os.path.isdir(path):
            raise ValueError(f"path must be a directory written by save_pretrained or save_hf_checkpoint, got "
                             f"{path!r}")
        if not any(name.endswith(".safetensors") for name in os.listdir(path)):
            raise ValueError(f"{path!r} holds no .safetensors files (save_pretrained(..., safe_serialization=True) "
                             "writes them)")
        _check_model(model)

    group = _default_group()
    check_agreement(group, "load_hf_checkpoint", {"path": path}, validate)
    _materialise(model)
    state = _weights(model)
    with _plain_errors("load_hf_checkpoint", path):
        dcp.load(state, storage_reader=HuggingFaceStorageReader(path), process_group=group, no_dist=group is None)
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))  # (no tied LM head in state)
