// The index of every native tdx op: one TORCH_LIBRARY with all schemas, grouped
// by family. One op is defined in Python instead: tdx::defer_weight_grad
// (torchdist_ext/_weight_grad.py), the effectful op that queues a deferred
// weight gradient under torch.compile; it calls back into Python objects. Each family's host code (csrc/ops/<family>.cpp) implements its ops
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
  // The fp8 pair of the first two (torch._scaled_mm per ring block; no autograd: the fp8 linears'
  // own backward calls them). x: fp8, mat2 [k, n] fp8 (column-major on a GPU, as _scaled_mm takes),
  // scale_x / scale_mat2: 1-element fp32 dequantisation factors (the inverse cast scales).
  // out = (all_gather(x, gather_dim) @ mat2) * scale_x * scale_mat2 in out_dtype, and the gathered x.
  m.def(
      "all_gather_scaled_mm(Tensor x, Tensor mat2, Tensor scale_x, Tensor scale_mat2, ScalarType out_dtype, "
      "str group_name, int gather_dim) -> (Tensor out, Tensor gathered)");
  // out = reduce_scatter((x @ mat2) * scale_x * scale_mat2 in out_dtype, scatter_dim), summed in out_dtype.
  m.def(
      "scaled_mm_reduce_scatter(Tensor x, Tensor mat2, Tensor scale_x, Tensor scale_mat2, ScalarType out_dtype, "
      "str group_name, int scatter_dim) -> Tensor");

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
  // shard in `order` ('contiguous' or 'zigzag'). Returns out (like q) and the global
  // log-sum-exp [B, Hq, S_local] (fp32; fp64 for fp64 inputs).
  // document_ids [B, S_local] (integer; optional): per-token documents of packed sequences, sharded like the
  // tokens; a token attends only to its own document, a negative id is padding (output and gradients 0).
  // positions [B, S_local] (integer; optional, order then 'contiguous'): the tokens' global positions (a
  // balanced sequence plan's shard); the causal mask compares them instead of the order's.
  m.def(
      "ring_attention_fwd(Tensor q, Tensor k, Tensor v, str group_name, bool causal, float scale, "
      "str order, Tensor? document_ids=None, Tensor? positions=None) -> (Tensor out, Tensor lse)");
  m.def(
      "ring_attention_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "str group_name, bool causal, float scale, str order, Tensor? document_ids=None, Tensor? positions=None) "
      "-> (Tensor grad_q, Tensor grad_k, Tensor grad_v)");
  // The same masked attention on one rank's whole sequence, document_ids (and positions) [B, S] (Ulysses'
  // local attention).
  m.def(
      "document_attention_fwd(Tensor q, Tensor k, Tensor v, Tensor document_ids, bool causal, float scale, "
      "Tensor? positions=None) -> (Tensor out, Tensor lse)");
  m.def(
      "document_attention_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor document_ids, bool causal, float scale, Tensor? positions=None) "
      "-> (Tensor grad_q, Tensor grad_k, Tensor grad_v)");
  // [ranks, ranks] int64 on the CPU: the attention scores ring rank r computes for the key block of rank s,
  // for the document ids [B, S] of the whole sequence in order (the per-rank work spread of a document mix).
  m.def("context_attention_work(Tensor document_ids, int ranks, str order, bool causal) -> Tensor");
  // (indices [B, ranks, S / ranks], costs [B, ranks]) int64 on the CPU: per batch row, the global positions each
  // rank holds (ascending) and its causal work, balanced over the documents of document_ids [B, S]
  // (ops/sequence_plan.h).
  m.def("balanced_sequence_plan(Tensor document_ids, int ranks) -> (Tensor indices, Tensor costs)");
  // Merges a partial attention result into an accumulator by log-sum-exp, in place:
  // out [..., rows, D] and lse [..., rows] (fp32, fp64 for fp64 blocks); block_out any float dtype.
  m.def("lse_merge_(Tensor(a!) out, Tensor(b!) lse, Tensor block_out, Tensor block_lse) -> ()");

  // ---- all_to_all: Ulysses sequence <-> head re-sharding ----
  // [B, H, S/N, D] (this rank's sequence shard in `order`: 'contiguous' or 'zigzag') ->
  // [B, H/N, S, D] (a head shard of the whole sequence, in order), and back.
  m.def("all_to_all_seq_to_heads(Tensor x, str group_name, str order) -> Tensor");
  m.def("all_to_all_heads_to_seq(Tensor x, str group_name, str order) -> Tensor");

  // ---- moe: expert-parallel token exchange and expert-major permutation ----
  // x [T, D] tokens, expert_ids [T, k] int64 (global expert, -1: dropped), weights [T, k] (fp32; fp64 for fp64 x)
  // over a group holding num_experts / n experts per rank. Returns the rows this rank receives: x [R, D],
  // expert_ids [R, k] (local experts, -1 for slots of other ranks), weights [R, k] (0 there), and counts
  // [2, n, 1 + experts per rank] on the host (rows sent / received per rank, then slots per local expert;
  // pass it to moe_combine). rows_per_rank -1: dropless (R from a count exchange); >= 0: exactly that many
  // rows per rank pair, zero-padded (static shapes). With `counts` given, no counts are exchanged.
  m.def(
      "moe_dispatch(Tensor x, Tensor expert_ids, Tensor weights, int num_experts, int rows_per_rank, "
      "str group_name, Tensor? counts=None) -> (Tensor x, Tensor expert_ids, Tensor weights, Tensor counts)");
  // The adjoint: y [R, D] and weights [R, k] back to their tokens: out [T, D] sums a token's rows over the
  // ranks in rank order (in fp32, fp64 for fp64); out_weights [T, k] takes slot j from its expert's rank
  // (weights None: out_weights is empty). expert_ids may keep the tokens' leading dims [..., k]: out is
  // then [..., D] (and out_weights [..., k]).
  m.def(
      "moe_combine(Tensor y, Tensor? weights, Tensor expert_ids, Tensor counts, int num_experts, "
      "int rows_per_rank, str group_name) -> (Tensor out, Tensor out_weights)");
  // x [R, D] and expert_ids [R, k] (local, -1 none) -> x_sorted [A, D]: one row per slot, expert-major and
  // in slot order within an expert; positions [R, k] (each slot's row in x_sorted, -1 none); offsets
  // [num_experts] int32 (each expert's end row, for torch._grouped_mm). Dropless (capacity -1): A is the sum
  // of tokens_per_expert (host int64 [num_experts]); else A = num_experts * capacity, zero-padded.
  m.def(
      "moe_permute(Tensor x, Tensor expert_ids, Tensor tokens_per_expert, int num_experts, int capacity) "
      "-> (Tensor x_sorted, Tensor positions, Tensor offsets)");
  // y [R, D]: y[r] = sum over j, in order, of weights[r, j] * sorted[positions[r, j]] (weights None: 1),
  // accumulated in fp32 (fp64 for fp64). sorted may be [experts, capacity, D] (its rows flattened).
  m.def("moe_unpermute(Tensor sorted, Tensor positions, Tensor? weights) -> Tensor");
  // Its gradients: grad_sorted (sorted's shape) and grad_weights [R, k] (empty without weights).
  m.def(
      "moe_unpermute_bwd(Tensor grad, Tensor sorted, Tensor positions, Tensor? weights) "
      "-> (Tensor grad_sorted, Tensor grad_weights)");
  // x [A, K] expert-major (tokens_per_expert, host int64 [E], rows each) times weight [E, N, K] per expert:
  // out [A, N] = x_e @ weight[e].T; an expert without rows is skipped. For where torch._grouped_mm does not
  // run (CPU float32 under torch.compile, float64, unaligned widths).
  m.def("moe_grouped_mm(Tensor x, Tensor weight, Tensor tokens_per_expert) -> Tensor");
  // Its weight gradient: [E, N, K], per expert grad_e.T @ x_e (zero without rows).
  m.def("moe_grouped_mm_wgrad(Tensor grad, Tensor x, Tensor tokens_per_expert) -> Tensor");

  // ---- fp8: scaled casts for fp8 GEMMs ----
  // x (fp32, bf16 or fp16, any shape) -> x_fp8 = cast(x * scale) in fp8_dtype (float8_e4m3fn or
  // float8_e5m2; contiguous, x's shape): finite elements saturate to the format's largest value (also
  // where x * scale overflows fp32), inf and NaN become NaN, rounding to nearest even; amax = max |x| (fp32, 0-d; NaN if x holds a NaN, inf if
  // it holds an inf). scale: fp32 with one element, on x's device. One read of x. Not differentiable.
  m.def("fp8_cast_amax(Tensor x, Tensor scale, ScalarType fp8_dtype) -> (Tensor x_fp8, Tensor amax)");
  // The same cast of a matrix x [rows, cols] in both orientations, from one read: x_fp8 [rows, cols] and
  // x_fp8_t [cols, ceil(rows / row_multiple) * row_multiple] = x_fp8.T with zero bytes in the padding
  // columns (the operands torch._scaled_mm takes column-major, and the weight gradient's, whose
  // contraction over the rows needs multiples of 16 on a GPU). Not differentiable.
  m.def(
      "fp8_cast_transpose_amax(Tensor x, Tensor scale, ScalarType fp8_dtype, int row_multiple=1) "
      "-> (Tensor x_fp8, Tensor x_fp8_t, Tensor amax)");
  // A cast with one scale per block of block_rows x block_cols elements of x [rows, cols] (rowwise: 1 x cols;
  // DeepSeek-V3's 1 x 128 tiles and 128 x 128 blocks): each block's scale fp8_max / max(amax, eps) (1 where
  // the amax is not finite; rounded down to a power of two with power_of_2). Returns the fp8 bytes and the
  // inverse scales [ceil(rows / block_rows), ceil(cols / block_cols)] (fp32).
  m.def(
      "fp8_cast_blockwise(Tensor x, int block_rows, int block_cols, ScalarType fp8_dtype, bool power_of_2=False, "
      "float eps=1e-12) -> (Tensor x_fp8, Tensor inverse_scale)");

  // ---- init: counter-based initialisation (layout-independent, no generator state) ----
  // self: a contiguous block at `offsets` of a tensor of shape `whole_shape`; fills it with what the whole
  // tensor holds there: element i (its row-major index in the whole tensor) is N(mean, std^2) truncated to
  // [a, b], a function of (seed, key, i) alone (kernels/init.h). So a shard holds the whole tensor's values
  // on every rank, whatever the layout that cut it.
  m.def(
      "counter_trunc_normal_(Tensor(a!) self, int[] whole_shape, int[] offsets, int seed, int key, float mean, "
      "float std, float a, float b) -> ()");

  // ---- linear_grad: a linear's backward in two halves (zero-bubble pipelines run W after B) ----
  // The input gradient: grad_out [..., out] @ weight [out, in] -> [..., in] (same dtype).
  m.def("linear_dgrad(Tensor grad_out, Tensor weight) -> Tensor");
  // The weight gradient, accumulated in place: main_grad [out, in] += grad_out.flatten(0, -2).T @
  // input.flatten(0, -2), computed in main_grad's dtype (an fp32 main gradient of bf16 activations).
  m.def("linear_wgrad_(Tensor(a!) main_grad, Tensor grad_out, Tensor input) -> ()");
}
