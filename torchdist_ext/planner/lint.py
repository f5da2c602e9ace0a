"""Static checks of a training script for the three failure modes that live in training code.

    TDX003  DistributedSampler without set_epoch: every epoch replays the same shuffle.
    TDX004  manual ``no_sync()`` gradient accumulation under FSDP / ZeRO-3: at the accumulation
            boundary the backward escapes no_sync and early micro-batches sync out of order.
    TDX005  gradient clipping on local shard norms under FSDP / tensor parallelism: each rank
            clips by the norm of its shard, under-clipping the true global norm.

The scan reads the script's syntax tree (nothing is imported or run), so it
sees what is written, not what a helper called from elsewhere does.
"""

from __future__ import annotations

import ast
from pathlib import Path

from torchdist_ext.planner.estimate import Finding

__all__ = ["lint"]

_SHARDING_NAMES = {"fully_shard", "FullyShardedDataParallel", "FSDP", "DTensor", "distribute_tensor",
                   "parallelize_module", "ColumnParallelLinear", "RowParallelLinear", "zero_optimization"}
_CLIP_CALLS = {"clip_grad_norm_", "clip_grads_with_norm_", "get_total_norm"}
_NORM_CALLS = {"norm", "vector_norm"}
_LOCAL_ACCESSORS = {"to_local", "_local_tensor", "local_tensor"}


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _called(node: ast.AST) -> str | None:
    return _name(node.func) if isinstance(node, ast.Call) else None


def _mentions(tree: ast.AST, names: set[str]) -> bool:
    for node in ast.walk(tree):
        if _name(node) in names:
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
            return True
    return False


def _uses_grad(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "grad" for n in ast.walk(node))


def _reads_local_shard(node: ast.AST) -> bool:
    return any(_name(n) in _LOCAL_ACCESSORS for n in ast.walk(node) if isinstance(n, ast.Attribute))


def _sampler_findings(tree: ast.AST, path: str) -> list[Finding]:
    samplers = [n for n in ast.walk(tree) if _called(n) == "DistributedSampler"]
    if not samplers or any(_called(n) == "set_epoch" for n in ast.walk(tree)):
        return []
    return [Finding("TDX003", "warning",
                    "DistributedSampler without set_epoch(epoch): every epoch sees the same shuffle. Call "
                    "sampler.set_epoch(epoch) at the start of each epoch, or use "
                    "torchdist_ext.data.DataParallelSampler (a new shuffle each epoch by itself, sharded by the "
                    "dp mesh).", path, n.lineno) for n in samplers]


def _no_sync_findings(tree: ast.AST, path: str, sharded: bool) -> list[Finding]:
    if not sharded:
        return []
    findings = []
    for node in ast.walk(tree):
        if isinstance(node, ast.With) and any(_called(item.context_expr) == "no_sync" for item in node.items):
            findings.append(Finding(
                "TDX004", "warning",
                "manual no_sync() gradient accumulation with FSDP / ZeRO-3: the backward at the accumulation "
                "boundary runs outside no_sync and earlier micro-batches' gradients sync out of order. Use the "
                "framework's accumulation API (FSDP2: model.set_requires_gradient_sync(is_last_microbatch); "
                "DeepSpeed: gradient_accumulation_steps).", path, node.lineno))
    return findings


def _local_norm_findings(tree: ast.AST, path: str, sharded: bool) -> list[Finding]:
    """Clipping helpers fed local shards, or gradient norms taken tensor by tensor in a loop."""
    if not sharded:
        return []
    message = ("gradient norm of local shards: under FSDP / tensor parallelism each rank holds part of each "
               "gradient, so this norm is smaller than the global one and clipping under-clips. Clip with "
               "torchdist_ext.clip_grad_norm_(model_parts, max_norm, pp_mesh=...): it reduces every mesh's DTensor "
               "gradients and the pipeline stages.")
    in_loops = {id(n) for loop in ast.walk(tree) if isinstance(loop, (ast.For, ast.ListComp, ast.GeneratorExp))
                for n in ast.walk(loop)}
    findings = []
    for node in ast.walk(tree):
        called = _called(node)
        if called not in _CLIP_CALLS and called not in _NORM_CALLS:
            continue
        operands = [*node.args, *(k.value for k in node.keywords), node.func]
        local = any(_reads_local_shard(a) for a in operands)
        grads = any(_uses_grad(a) for a in operands)
        if (called in _CLIP_CALLS and local) or (called in _NORM_CALLS and grads and (local or id(node) in in_loops)):
            findings.append(Finding("TDX005", "warning", message, path, node.lineno))
    return findings


def lint(path: str | Path) -> list[Finding]:
    """TDX003, TDX004 and TDX005 findings of the Python script at ``path``, with their lines."""
    source_path = Path(path)
    if not source_path.is_file():
        raise ValueError(f"path {str(path)!r} is not a file")
    try:
        tree = ast.parse(source_path.read_bytes(), filename=str(source_path))
    except (SyntaxError, ValueError) as error:  # ValueError: null bytes, undecodable text
        raise ValueError(f"{path} is not a Python source file: {error}") from error
    sharded = _mentions(tree, _SHARDING_NAMES)
    name = str(source_path)
    findings = (_sampler_findings(tree, name) + _no_sync_findings(tree, name, sharded)
                + _local_norm_findings(tree, name, sharded))
    return sorted(findings, key=lambda f: (f.line or 0, f.code))
