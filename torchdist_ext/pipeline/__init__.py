"""Pipeline parallelism: a model split into stages over the ranks of a pipeline mesh, trained with the
schedules the planner simulates (gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-v), the zero-bubble ones with the
weight gradient split off our linears' backward.

    layers = partition_layers(len(blocks), num_stages("zb-h1", pp))
    mine = {s: nn.Sequential(*(blocks[i] for i in layers[s])) for s in stages_of_rank("zb-h1", pp, rank)}
    pipe = Pipeline(mine, pp_mesh=mesh["pp"], schedule="zb-h1", num_microbatches=8, loss_fn=loss_fn)
    loss = pipe.step(inputs, targets); optimizer.step()

``schedule`` (the action orders), ``stages`` (partition_layers), ``runtime`` (Pipeline), ``timeline``
(measured bubble, the planner's prediction for the measured costs, the timeline PNG).
"""

from torchdist_ext.pipeline.runtime import Pipeline, TimedAction, enable_weight_grad_split
from torchdist_ext.pipeline.schedule import (
    SCHEDULES,
    Action,
    num_stages,
    rank_actions,
    rank_of_stage,
    splits_weight_grad,
    stages_of_rank,
)
from torchdist_ext.pipeline.stages import partition_layers
from torchdist_ext.pipeline.timeline import (
    action_costs,
    gather_timeline,
    gather_timelines,
    mean_costs,
    measured_idle_fractions,
    plot_timeline,
    pool_steps,
    predicted_idle_fraction,
)

__all__ = [
    "SCHEDULES",
    "Action",
    "Pipeline",
    "TimedAction",
    "action_costs",
    "enable_weight_grad_split",
    "gather_timeline",
    "gather_timelines",
    "mean_costs",
    "measured_idle_fractions",
    "num_stages",
    "partition_layers",
    "plot_timeline",
    "pool_steps",
    "predicted_idle_fraction",
    "rank_actions",
    "rank_of_stage",
    "splits_weight_grad",
    "stages_of_rank",
]
