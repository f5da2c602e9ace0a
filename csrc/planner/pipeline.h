#pragma once
// Pipeline schedules: the idle ("bubble") fraction of a step, and a simulated
// timeline of one step for plotting and for checking the closed forms.

#include <vector>

#include "planner/options.h"

namespace tdx::planner {

// Idle fraction of the pipeline's step time with p stages and m micro-batches,
// assuming equal stages and T_F = T_B = T_W (forward, input-gradient and
// weight-gradient passes of one micro-batch cost the same):
//   gpipe, 1f1b   (p - 1) / (m + p - 1)              (Huang et al. 2018; Narayanan et al. 2019)
//   interleaved   (p - 1) / (v m + p - 1)            (Narayanan et al. 2021: the bubble shrinks by v)
//   zb-h1         (p - 1) / (3 m + p - 1)            (Qi et al. 2024: bubble (p-1)(T_F + T_B - T_W), a third of 1F1B's)
//   zb-v          (p - 1) / (6 m + p - 1)            V-shaped placement, chunks of half a stage: the start-up and
//                                                    cool-down triangles halve again. Qi et al. report near-zero
//                                                    bubbles; with equal pass times a pipeline still fills and
//                                                    drains. Their handcrafted order (pipeline.cpp), which holds
//                                                    no more than 1F1B, reaches exactly this for m >= 2p - 1,
//                                                    and our greedy one (as little) for m = p and some m
//                                                    between (p = 4, m = 5).
// With m < p (zb-v: and p < m < 2p - 1) the zero-bubble schedules have no closed form here: the value is the
// simulated one.
double bubble_fraction(long pp, long num_microbatches, Schedule schedule, long virtual_stages);

// The chunks (stages) each pipeline rank holds: virtual_stages under interleaved, 2 under zb-v, else 1.
long chunks_per_rank(Schedule schedule, long virtual_stages);

// The stage that chunk `chunk` of pipeline rank `rank` holds: round-robin (chunk x pp + rank), zb-v's two
// chunks in a V (rank, then 2 pp - 1 - rank).
long stage_of(long rank, long chunk, long pp, Schedule schedule);

// Stage-boundary messages the busiest pipeline rank sends per micro-batch: each stage sends its output
// forward unless it is the last and its input's gradient backward unless it is the first; a boundary
// between two stages of one rank (zb-v's turn at the last rank) sends nothing.
double busiest_rank_boundary_sends(long pp, Schedule schedule, long virtual_stages);

// One pass of one micro-batch on one stage: 'F' forward, 'B' backward (input
// gradient, and also the weight gradient in gpipe / 1f1b), 'W' weight gradient.
struct ScheduledPass {
  long rank;  // the pipeline rank (device) that runs it
  char kind;
  long microbatch;
  double start;
  double end;
  long chunk = 0;  // the model chunk on that rank (interleaved: 0..v-1; its stage: stage_of)
};

// The step simulated pass by pass: a pass starts when its stage is free and its inputs exist (F after the
// previous stage's F; B after the next stage's B and its own F; W after its own B), stages choosing among
// ready passes by the schedule's priorities, or following a fixed pass order: Megatron-LM's for interleaved,
// Qi et al.'s ZB-H1 for zb-h1 (stage s defers at most s weight gradients, so it holds at most 1F1B's p
// micro-batches) and their ZB-V for zb-v with m > p (at most 2p chunk units, 1F1B's p stages; pipeline.cpp).
// T_F = T_B = T_W = 1 for a whole stage (B = 2 when it includes W; a chunk of an interleaved stage costs 1/v
// of it, a ZB-V chunk 1/2). Supported: gpipe, 1f1b, zb-h1, zb-v, interleaved-1f1b (num_microbatches divisible by
// pp); the simulated idle fraction equals bubble_fraction (tested).
std::vector<ScheduledPass> simulate_schedule(long pp, long num_microbatches, Schedule schedule,
                                             long virtual_stages = 1);

// The passes of simulate_schedule(pp, num_microbatches, schedule, virtual_stages) in the same per-device
// order, timed again with the given costs of one pass of one micro-batch on each pipeline stage (a
// device's chunk as it runs: what a pipeline runtime measures; one value for every stage, one per stage in
// stage order, or one per stage and micro-batch, stage-major, as each pass of a run took): each device runs its passes in that order, each as soon as the device is free and its
// inputs exist (F after the previous stage's F; B after its own F and the next stage's B; W after its own
// B), an input made on another device `message` later (one activation or gradient's transfer between stages;
// 0: free). In gpipe, 1f1b and interleaved a B costs backward + weight (it computes both). The order the
// planner prices, with the measured times: its idle fraction is the planner's prediction for a run that
// measured those costs.
std::vector<ScheduledPass> replay_schedule(long pp, long num_microbatches, Schedule schedule, long virtual_stages,
                                           const std::vector<double>& forward, const std::vector<double>& backward,
                                           const std::vector<double>& weight, double message = 0.0);

// The most activation memory a pipeline rank holds during a simulated step, in units of one chunk's stored
// activations of one micro-batch, on the rank that holds the most: each F adds a unit; each B frees its F's
// unit and, where the schedule defers weight gradients (the timeline has W passes), keeps `weight_inputs`
// units (what the chunk's W needs, as a fraction of its activations) until that W. Held counts are taken
// between passes: a B frees its layers' activations as it creates their W inputs (many of which are those
// very activations: the linears' and norms' inputs). With weight_inputs = 0 it is the forwards' peak: the
// closed forms of in_flight_microbatches (times the chunks per rank; tested).
double peak_held_activations(const std::vector<ScheduledPass>& timeline, long pp, double weight_inputs);

// What one micro-batch holds on one model chunk (stage) for its backward: `forward` bytes from its F to its B and,
// where the schedule defers weight gradients, `weight_input` bytes (what its W needs) from its B to its W; and
// `backward_peak`, the most bytes a B pass holds at once on top of what its rank held before it (a layer's
// gradients and a recomputed layer's rerun, with what the pass has queued and released by then).
struct StageBytes {
  double forward = 0;
  double weight_input = 0;
  double backward_peak = 0;
};

// The most bytes each pipeline rank holds, between passes or inside a B (its stage's backward_peak), over
// a simulated step (in rank order), each pass counted by what its stage holds: `stages` in stage order, the
// chunks placed on the ranks as `schedule` places them (stage_of). Unequal stages: the first stage's
// embedding, the last one's head and loss.
std::vector<double> peak_held_bytes_per_rank(const std::vector<ScheduledPass>& timeline, long pp, Schedule schedule,
                                             const std::vector<StageBytes>& stages);

// peak_held_activations of each pipeline rank, in rank order (its maximum is peak_held_activations).
std::vector<double> peak_held_activations_per_rank(const std::vector<ScheduledPass>& timeline, long pp,
                                                   double weight_inputs);

// The same for the schedule that runs, without simulating where the order's warm-up gives it (the planner's
// search prices thousands of layouts): rank r of gpipe holds m units, of 1f1b min(p - r, m), of interleaved
// min(2 (p - r - 1) + (v - 1) p + 1, v m) chunk units (our interleaved order's warm-up forwards and the first
// steady one, pipeline.cpp); zb-h1 and zb-v with their deferred W inputs come from simulate_schedule (equal:
// tested).
std::vector<double> held_activations_per_rank(long pp, long num_microbatches, Schedule schedule,
                                              long virtual_stages, double weight_inputs);

// Idle fraction of a simulated timeline: 1 - busy time / (ranks x makespan).
double idle_fraction(const std::vector<ScheduledPass>& timeline, long pp);

}  // namespace tdx::planner
