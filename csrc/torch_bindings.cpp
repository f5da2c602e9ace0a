// The index of every tdx op: one TORCH_LIBRARY with all schemas, grouped by
// family. Each family's host code (csrc/ops/<family>.cpp) implements its ops
// once for every device; fake impls and autograd are in
// torchdist_ext/ops/<family>.py.
//
// Conventions: tensors are batch-first; an op that communicates takes
// `str group_name` (torch.distributed's registered name of the process group,
// `mesh.get_group().group_name`) and resolves it in C++. A differentiable op
// with a separate backward is named <name>_fwd / <name>_bwd; a trailing `_`
// marks an op that writes into an argument.

#include <torch/library.h>

TORCH_LIBRARY(tdx, m) {
  // ---- collective_matmul: sequence-parallel GEMMs as overlapped rings ----
  // out = all_gather(x, gather_dim) @ weight.T. `gathered` is the all-gathered
  // x when return_gathered (else an empty tensor); it carries no gradient.
  m.def(
      "all_gather_matmul(Tensor x, Tensor weight, str group_name, int gather_dim, "
      "bool return_gathered=False) -> (Tensor out, Tensor gathered)");
  // out = reduce_scatter(x @ weight.T, scatter_dim), summed over the group.
  m.def(
      "matmul_reduce_scatter(Tensor x, Tensor weight, str group_name, int scatter_dim) -> Tensor");
  // out[a, b] = sum over rows of dense[..., a] * all_gather(shard, gather_dim)[..., b]:
  // the weight gradient of the two ops above, without materialising the gather.
  m.def(
      "all_gather_weight_grad(Tensor dense, Tensor shard, str group_name, int gather_dim) -> Tensor");

  // ---- cross_entropy: vocab-parallel softmax cross-entropy ----
  // logits: this rank's vocab shard [..., V/tp], covering [vocab_start, vocab_start + V/tp)
  // of a vocabulary of vocab_size. Returns the per-row loss (0 where target ==
  // ignore_index) and the global log-sum-exp (fp32, fp64 for fp64 logits).
  // inplace_backward: autograd writes the logits' gradient over the (contiguous) logits.
  // A target outside [0, vocab_size) other than ignore_index raises (ValueError) while index
  // checks are on (torchdist_ext.set_index_checks), else gives that row a NaN loss and lse.
  m.def(
      "vocab_parallel_cross_entropy_fwd(Tensor logits, Tensor target, int vocab_start, int vocab_size, "
      "int ignore_index, str group_name, bool inplace_backward=False) -> (Tensor loss, Tensor lse)");
  m.def(
      "vocab_parallel_cross_entropy_bwd(Tensor grad_loss, Tensor logits, Tensor target, "
      "Tensor lse, int vocab_start, int ignore_index) -> Tensor");
  // The same gradient written over the contiguous logits.
  m.def(
      "vocab_parallel_cross_entropy_bwd_(Tensor grad_loss, Tensor(a!) logits, Tensor target, "
      "Tensor lse, int vocab_start, int ignore_index) -> ()");

  // ---- attention: context-parallel attention over a sequence-sharded ring ----
  // q [B, Hq, S_local, D], k/v [B, Hkv, S_local, D] (Hq % Hkv == 0), this rank's sequence
  // shard in `layout` ('contiguous' or 'zigzag'). Returns out (like q) and the global
  // log-sum-exp [B, Hq, S_local] (fp32; fp64 for fp64 inputs).
  m.def(
      "ring_attention_fwd(Tensor q, Tensor k, Tensor v, str group_name, bool causal, float scale, "
      "str layout) -> (Tensor out, Tensor lse)");
  m.def(
      "ring_attention_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "str group_name, bool causal, float scale, str layout) -> (Tensor grad_q, Tensor grad_k, Tensor grad_v)");
  // Merges a partial attention result into an accumulator by log-sum-exp, in place:
  // out [..., rows, D] and lse [..., rows] (fp32, fp64 for fp64 blocks); block_out any float dtype.
  m.def("lse_merge_(Tensor(a!) out, Tensor(b!) lse, Tensor block_out, Tensor block_lse) -> ()");

  // ---- all_to_all: Ulysses sequence <-> head re-sharding ----
  // [B, H, S/N, D] (this rank's sequence shard in `layout`: 'contiguous' or 'zigzag') ->
  // [B, H/N, S, D] (a head shard of the whole sequence, in order), and back.
  m.def("all_to_all_seq_to_heads(Tensor x, str group_name, str layout) -> Tensor");
  m.def("all_to_all_heads_to_seq(Tensor x, str group_name, str layout) -> Tensor");
}
