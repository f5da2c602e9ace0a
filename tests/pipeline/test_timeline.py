"""The measured timeline of a pipeline step: every rank's F / B / W actions gathered on every rank, idle
fractions over the step's makespan, the planner's prediction for the measured costs, and the PNG. (How close
measured and predicted bubbles are is a timing figure: python -m benchmarks.bench_pipeline reports it.)"""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from torchdist_ext.pipeline import (
    Pipeline,
    TimedAction,
    action_costs,
    gather_timeline,
    gather_timelines,
    mean_costs,
    measured_idle_fractions,
    plot_timeline,
    pool_steps,
    predicted_idle_fraction,
)
from torchdist_ext.testing import cached_mesh


def timeline_of_a_step(schedule: str, png: str):
    mesh = cached_mesh((2,), ("pp",))
    stage = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
    pipe = Pipeline({mesh.get_local_rank(): stage}, pp_mesh=mesh, schedule=schedule, num_microbatches=4,
                    loss_fn=nn.functional.mse_loss)
    pipe.step(torch.randn(8, 16), torch.randn(8, 16))
    timelines = gather_timeline(pipe)
    if mesh.get_local_rank() == 0:
        plot_timeline(png, timelines, title=schedule)
    per_rank, overall = measured_idle_fractions(timelines)
    return ([[(a.kind, a.stage, a.microbatch) for a in t] for t in timelines], per_rank, overall,
            predicted_idle_fraction(pipe, timelines))


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_every_rank_sees_every_ranks_actions_and_the_figures_are_fractions(world2, tmp_path, schedule):
    png = tmp_path / "timeline.png"
    outcomes = world2.run(timeline_of_a_step, schedule, str(png))
    assert outcomes[0][0] == outcomes[1][0], "the ranks gathered different timelines"
    actions, per_rank, overall, predicted = outcomes[0]
    kinds = "FBW" if schedule == "zb-h1" else "FB"
    for rank, timeline in enumerate(actions):
        assert sorted(timeline) == sorted((k, rank, i) for k in kinds for i in range(4))
    assert all(0.0 <= f < 1.0 for f in per_rank) and overall == pytest.approx(sum(per_rank) / 2)
    assert 0.0 < predicted < 1.0
    assert png.stat().st_size > 0


def test_measured_figures_of_a_synthetic_timeline():
    # Two ranks, 1F1B with one micro-batch: rank 0 F [0, 1], B [3, 5]; rank 1 F [1, 2], B [2, 3].
    timelines = [[TimedAction("F", 0, 0, 0.0, 1.0), TimedAction("B", 0, 0, 3.0, 5.0)],
                 [TimedAction("F", 1, 0, 1.0, 2.0), TimedAction("B", 1, 0, 2.0, 3.0)]]
    per_rank, overall = measured_idle_fractions(timelines)
    assert per_rank == pytest.approx([1 - 3 / 5, 1 - 2 / 5]) and overall == pytest.approx(0.5)
    assert mean_costs(timelines, 2) == {"F": [1.0, 1.0], "B": [2.0, 1.0], "W": [0.0, 0.0]}

def test_predicted_idle_fraction_waits_each_message_between_ranks():
    """The synthetic 1F1B step above, replayed: with no message time the measured costs give rank 0 F [0, 1],
    B [3, 5] and rank 1 F [1, 2], B [2, 3] (idle 0.5); with 0.25 per message, the two messages between the
    ranks (F0's output, B1's input gradient) push rank 1 to [1.25, 3.25] and rank 0's B to [3.5, 5.5]."""
    timelines = [[TimedAction("F", 0, 0, 0.0, 1.0), TimedAction("B", 0, 0, 3.0, 5.0)],
                 [TimedAction("F", 1, 0, 1.0, 2.0), TimedAction("B", 1, 0, 2.0, 3.0)]]
    pipe = SimpleNamespace(pp=2, num_microbatches=1, schedule="1f1b", virtual_stages=1, num_stages=2)
    assert predicted_idle_fraction(pipe, timelines) == pytest.approx(0.5)
    assert predicted_idle_fraction(pipe, timelines, message_seconds=0.25) == pytest.approx(1 - 5 / (2 * 5.5))


def test_replayed_with_each_actions_own_time_a_gap_free_step_is_reproduced():
    """1F1B, p = 2, m = 2, stage 0's first forward three times its second: rank 0 F0.0 [0, 3], F0.1 [3, 4],
    B0.0 [5, 6], B0.1 [7, 8]; rank 1 F1.0 [3, 4], B1.0 [4, 5], F1.1 [5, 6], B1.1 [6, 7] (idle 1 - 10 / 16).
    Each action's own time replays it exactly; stage 0's mean forward (2) does not: rank 0's forwards end at
    2 and 4, and the step at 7 (idle 1 - 10 / 14)."""
    timelines = [[TimedAction("F", 0, 0, 0.0, 3.0), TimedAction("F", 0, 1, 3.0, 4.0),
                  TimedAction("B", 0, 0, 5.0, 6.0), TimedAction("B", 0, 1, 7.0, 8.0)],
                 [TimedAction("F", 1, 0, 3.0, 4.0), TimedAction("B", 1, 0, 4.0, 5.0),
                  TimedAction("F", 1, 1, 5.0, 6.0), TimedAction("B", 1, 1, 6.0, 7.0)]]
    assert action_costs(timelines, 2, 2) == {"F": [3.0, 1.0, 1.0, 1.0], "B": [1.0] * 4, "W": [0.0] * 4}
    pipe = SimpleNamespace(pp=2, num_microbatches=2, schedule="1f1b", virtual_stages=1, num_stages=2)
    measured = measured_idle_fractions(timelines)[1]
    assert measured == pytest.approx(1 - 10 / 16)
    assert predicted_idle_fraction(pipe, timelines, each_action=True) == pytest.approx(measured)
    assert predicted_idle_fraction(pipe, timelines) == pytest.approx(1 - 10 / 14)


def test_several_steps_give_the_stages_mean_costs_over_all_of_them():
    """The step above, then one with every action 1 long: stage 0's mean forward over both is 1.5. 1F1B
    timed with it: rank 0 F0.0 [0, 1.5], F0.1 [1.5, 3], B0.0 [3.5, 4.5], B0.1 [5.5, 6.5]; rank 1 F1.0
    [1.5, 2.5], B1.0 [2.5, 3.5], F1.1 [3.5, 4.5], B1.1 [4.5, 5.5]: idle 1 - 9 / 13. Each action's own time
    needs one step's actions."""
    first = [[TimedAction("F", 0, 0, 0.0, 3.0), TimedAction("F", 0, 1, 3.0, 4.0),
              TimedAction("B", 0, 0, 5.0, 6.0), TimedAction("B", 0, 1, 7.0, 8.0)],
             [TimedAction("F", 1, 0, 3.0, 4.0), TimedAction("B", 1, 0, 4.0, 5.0),
              TimedAction("F", 1, 1, 5.0, 6.0), TimedAction("B", 1, 1, 6.0, 7.0)]]
    second = [[a._replace(start=10.0 * i, end=10.0 * i + 1.0) for i, a in enumerate(t)] for t in first]
    pooled = [first[rank] + second[rank] for rank in range(2)]
    assert mean_costs(pooled, 2) == {"F": [1.5, 1.0], "B": [1.0, 1.0], "W": [0.0, 0.0]}
    pipe = SimpleNamespace(pp=2, num_microbatches=2, schedule="1f1b", virtual_stages=1, num_stages=2)
    assert predicted_idle_fraction(pipe, pooled) == pytest.approx(1 - 9 / 13)
    with pytest.raises(ValueError, match="timelines must hold one step, got F of stage 0, micro-batch 0 twice"):
        predicted_idle_fraction(pipe, pooled, each_action=True)


def timelines_of_two_steps():
    mesh = cached_mesh((2,), ("pp",))
    stage = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
    pipe = Pipeline({mesh.get_local_rank(): stage}, pp_mesh=mesh, schedule="1f1b", num_microbatches=2,
                    loss_fn=nn.functional.mse_loss)
    kept = []
    for _ in range(2):
        pipe.step(torch.randn(4, 16), torch.randn(4, 16))
        kept.append(pipe.timeline)
    return kept, gather_timeline(pipe), gather_timelines(pipe, kept)


def test_several_steps_gathered_at_once_are_each_ranks_timeline_of_each_step(world2):
    outcomes = world2.run(timelines_of_two_steps)
    kept = [outcome[0] for outcome in outcomes]
    for _, last, steps in outcomes:
        assert steps == [[kept[rank][step] for rank in range(2)] for step in range(2)]
        assert steps[-1] == last
        assert pool_steps(steps) == [kept[rank][0] + kept[rank][1] for rank in range(2)]
