"""Train a Hugging Face causal LM on the byte corpus at dp x cp x tp (x ep) with torchrun.

    torchrun --standalone --nproc-per-node 4 examples/finetune_hf.py --tp 2 --check         # dp2 x tp2, SP
    torchrun --standalone --nproc-per-node 4 examples/finetune_hf.py --cp 2 --tp 2 --check  # cp2 (ring) x tp2
    torchrun --standalone --nproc-per-node 4 examples/finetune_hf.py --cp 4 --cp-method ulysses --packed
    torchrun --standalone --nproc-per-node 4 examples/finetune_hf.py --tp 2 --compile --save-hf /tmp/tiny-llama
    torchrun --standalone --nproc-per-node 4 examples/finetune_hf.py --hf DIR --ep 2 --check  # a saved MoE model

The model is ``transformers.LlamaForCausalLM`` from a small config (random init, no download), or
``--hf DIR``'s ``save_pretrained`` directory (any model ``parallelize_hf_model`` takes, Mixtral, Qwen2-MoE
and Qwen3-MoE with expert parallelism over ``--ep`` ranks; a vocabulary of at least 256 for the bytes).
A dense one is built on the meta device and each rank reads only its slices (``load_hf_checkpoint``); an
MoE one is read whole by each rank and then parallelised (HF checkpoints of a parallelised MoE model are
not supported yet). Three lines make it parallel (``parallelize_hf_model``) and feed it (``shard_hf_batch``).
Each step prints the loss and the world's tokens/s. ``--packed`` packs documents
(each window is cut into documents at random lengths, position_ids restarting at
each, HF's packed-sequence convention) and masks attention across them.
``--compile`` compiles each decoder layer (fullgraph); ``--save-hf DIR`` writes the
trained model as a ``save_pretrained`` directory (``save_hf_checkpoint``).
``--check`` trains the same model in one process on the whole batch and
compares the losses (fp32: summation order only; exits non-zero above 1e-4
relative).
"""

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from one_process_check import check_losses, exit_now
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from torchdist_ext.integrations.hf import (
    load_hf_checkpoint,
    parallelize_hf_model,
    save_hf_checkpoint,
    shard_hf_batch,
)
from torchdist_ext.integrations.hf.moe import MOE_MODEL_TYPES
from torchdist_ext.parallel import ParallelDims

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"
CHECK_TOLERANCE = 1e-4


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (with sequence parallelism)")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel ranks")
    parser.add_argument("--cp-method", choices=["ring", "ulysses"], default="ring")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (an MoE --hf model)")
    parser.add_argument("--hf", type=Path, metavar="DIR", help="a save_pretrained directory to train")
    parser.add_argument("--packed", action="store_true", help="pack documents into each sequence")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true", help="compile each decoder layer (fullgraph)")
    parser.add_argument("--save-hf", metavar="DIR", help="write the trained model to DIR for from_pretrained")
    parser.add_argument("--check", action="store_true", help="also train in one process and compare losses")
    return parser.parse_args(argv)


def build_model(args, *, parallel: bool):
    """The small Llama from ``--seed``; or ``--hf``'s model: a dense one on the meta device when it is to be
    parallelised (``load_hf_checkpoint`` then gives each rank its slices), else read whole."""
    if args.hf is None:
        config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                             tie_word_embeddings=True, attn_implementation="sdpa", use_cache=False)
        torch.manual_seed(args.seed)
        return LlamaForCausalLM(config)
    config = AutoConfig.from_pretrained(args.hf)
    if not parallel or config.model_type in MOE_MODEL_TYPES:  # (from_pretrained leaves eval mode)
        return AutoModelForCausalLM.from_pretrained(args.hf, attn_implementation="sdpa", dtype=torch.float32).train()
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def batches(args: argparse.Namespace):
    """HF batches of byte windows ``[batch, seq]`` (the same on every rank), optionally packed."""
    data = torch.frombuffer(bytearray(CORPUS.read_bytes()), dtype=torch.uint8).long()
    generator = torch.Generator().manual_seed(args.seed)
    for _ in range(args.steps):
        starts = torch.randint(0, data.numel() - args.seq, (args.batch,), generator=generator)
        input_ids = torch.stack([data[s : s + args.seq] for s in starts.tolist()])
        batch = {"input_ids": input_ids, "labels": input_ids.clone()}
        if args.packed:
            rows = []
            for _ in range(args.batch):
                cuts = torch.randint(1, args.seq, (3,), generator=generator).sort().values.tolist()
                lengths = [b - a for a, b in zip([0, *cuts], [*cuts, args.seq]) if b > a]
                rows.append(torch.cat([torch.arange(length) for length in lengths]))
            batch["position_ids"] = torch.stack(rows)
        yield batch


def train(model, args, dp_rank: int, dp: int, cp_mesh, report: bool) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for step, batch in enumerate(batches(args)):
        start = time.perf_counter()
        batch = {key: value.chunk(dp)[dp_rank] for key, value in batch.items()}
        inputs = shard_hf_batch(batch, cp_mesh=cp_mesh) if cp_mesh is not None else batch
        loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())  # (the whole batch's loss, over every dp and cp rank)
        if report:
            tokens_per_second = args.batch * args.seq / (time.perf_counter() - start)
            print(f"step {step:3d}  loss {losses[-1]:.4f}  {tokens_per_second:,.0f} tokens/s", flush=True)
    return losses


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        if world % (args.tp * args.cp):
            raise SystemExit(f"--tp {args.tp} x --cp {args.cp} must divide the world size {world}")
        try:
            dims = ParallelDims(world_size=world, cp=args.cp, cp_ulysses=args.cp if args.cp_method == "ulysses" else 1,
                                tp=args.tp, ep=args.ep)
        except ValueError as error:
            raise SystemExit(f"--tp {args.tp} --cp {args.cp} --ep {args.ep} on {world} ranks: {error}") from None
        if args.batch % dims.dp:
            raise SystemExit(f"--batch {args.batch} must be divisible by dp = {dims.dp}")
        meshes = dims.build_meshes("cpu")
        model = build_model(args, parallel=True)
        if model.config.vocab_size < 256:
            raise SystemExit(f"--hf {args.hf}: its vocabulary ({model.config.vocab_size}) must hold the corpus's "
                             f"256 byte ids")
        parallelize_hf_model(model, meshes=meshes, sequence_parallel=args.tp > 1, compile=args.compile)
        if any(p.is_meta for p in model.parameters()):
            load_hf_checkpoint(model, args.hf)
        if rank == 0:
            print(f"world {world}: dp={dims.dp} x cp={args.cp} ({args.cp_method if args.cp > 1 else 'off'}) x "
                  f"tp={args.tp}{' (sequence parallel)' if args.tp > 1 else ''}"
                  f"{f' x ep={args.ep} (out of dp x cp)' if args.ep > 1 else ''}, "
                  f"{'packed documents, ' if args.packed else ''}HF {type(model).__name__}", flush=True)
        losses = train(model, args, meshes.dp.get_local_rank(), dims.dp, meshes.cp, report=rank == 0)
        if args.save_hf:
            save_hf_checkpoint(model, args.save_hf)
        if not args.check:
            return 0
        return check_losses(losses, lambda: train(build_model(args, parallel=False), args, 0, 1, None, report=False),
                            CHECK_TOLERANCE)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    exit_now(main())
