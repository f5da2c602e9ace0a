"""What a pipeline rank keeps during a step: each action records the live bytes after it, and a stage's
outputs give up their storage once their messages are sent (their backward needs only their grad_fn)."""

import torch
from torch import nn

from torchdist_ext import cpu_memory
from torchdist_ext.pipeline import Pipeline
from torchdist_ext.testing import cached_mesh


class RecordingStage(nn.Module):
    """A linear that keeps a reference to each output it returns (autograd saves nothing of it)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(64, 64)
        self.outputs = []

    def forward(self, x):
        out = self.linear(x)
        self.outputs.append(out)
        return out


def outputs_after_a_step(schedule: str):
    mesh = cached_mesh((2,), ("pp",))
    if schedule == "zb-v":  # rank 0 holds stages 0 and 3 (the last), rank 1 stages 1 and 2
        stages = {0: RecordingStage(), 3: RecordingStage()} if mesh.get_local_rank() == 0 else \
            {1: RecordingStage(), 2: RecordingStage()}
    else:
        stages = {mesh.get_local_rank(): RecordingStage()}
    pipe = Pipeline(stages, pp_mesh=mesh, schedule=schedule, num_microbatches=4, loss_fn=nn.functional.mse_loss)
    pipe.step(torch.randn(64, 64), torch.randn(64, 64))
    return {index: [out.untyped_storage().nbytes() for out in stage.outputs] for index, stage in stages.items()}


def test_stage_outputs_give_up_their_storage(world2):
    """Every stage output but the last stage's (the loss keeps it) is released: sent over the wire (1f1b) and
    handed over in memory at zb-v's turn (stage 1 to 2 on rank 1)."""
    for schedule, last_stage in (("1f1b", 1), ("zb-v", 3)):
        for stages in world2.run(outputs_after_a_step, schedule):
            for stage, sizes in stages.items():
                expected = 16 * 64 * 4 if stage == last_stage else 0  # a micro-batch: 16 rows of 64 fp32
                assert sizes == [expected] * 4, (schedule, stage, sizes)


def live_bytes_after_each_action():
    cpu_memory.track()  # counts from here on, for the rest of this world's life (transparent to other tests)
    mesh = cached_mesh((2,), ("pp",))
    stage = nn.Sequential(nn.Linear(64, 64), nn.Tanh())
    pipe = Pipeline({mesh.get_local_rank(): stage}, pp_mesh=mesh, schedule="1f1b", num_microbatches=4,
                    loss_fn=nn.functional.mse_loss)
    inputs, targets = torch.randn(64, 64), torch.randn(64, 64)
    pipe.step(inputs, targets)  # allocates the .grad buffers, which the next step accumulates into
    before = cpu_memory.memory_allocated()
    pipe.step(inputs, targets)
    return before, [(a.kind, a.microbatch, a.live_bytes) for a in pipe.timeline]


def test_each_action_records_the_live_bytes_after_it(world2):
    """1F1B, stage 0 of 2: two forwards' activations held (the tanh's output, 16 rows of 64 fp32, at least: the
    linear's input is a view of the step's inputs), then each backward frees one micro-batch's."""
    before, actions = world2.run(live_bytes_after_each_action)[0]
    assert [(kind, i) for kind, i, _ in actions[:3]] == [("F", 0), ("F", 1), ("B", 0)]
    live = [b for _, _, b in actions]
    assert all(isinstance(b, int) for b in live)
    one_microbatch = 16 * 64 * 4
    # gloo's worker thread drops the previous step's all-reduced loss (a 4-byte fp32 scalar) a moment after that
    # step returns: now and then inside this step, after `before` was read.
    late_scalar = 4
    assert live[1] - live[0] >= one_microbatch and live[0] - before >= one_microbatch - late_scalar
    assert live[2] < live[1]
