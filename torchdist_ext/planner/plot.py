"""PNG figures of the planner: per-GPU memory of layouts, and pipeline timelines (simulated or measured)."""

from __future__ import annotations

from pathlib import Path

from torchdist_ext.planner.estimate import Estimate
from torchdist_ext.planner.schedule import ScheduledPass, stage_of

__all__ = ["draw_timeline", "plot_plan", "simulated_rows"]

_MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "backward", "buffers")
_PASS_COLORS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}
_PASS_NAMES = ["F forward", "B backward (with W unless split)", "W weight grad"]

# One pipeline rank's passes to draw: (kind "F" / "B" / "W", start, end, label inside the bar).
TimelineRow = list[tuple[str, float, float, str]]


def draw_timeline(axes, rows: list[TimelineRow], *, xlabel: str, title: str = "") -> None:
    """Draws one bar row per pipeline rank on matplotlib ``axes``, each pass coloured by its kind and labelled
    (gaps are the bubble): the planner's simulated step and a measured one look alike."""
    import matplotlib.pyplot as plt

    for rank, passes in enumerate(rows):
        for kind, start, end, label in passes:
            axes.barh(rank, end - start, left=start, color=_PASS_COLORS[kind], edgecolor="white", linewidth=0.5)
            axes.text((start + end) / 2, rank, label, ha="center", va="center", fontsize="x-small", color="white")
    axes.set_yticks(range(len(rows)), [f"rank {r}" for r in range(len(rows))])
    axes.invert_yaxis()
    axes.set_xlabel(xlabel)
    axes.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _PASS_COLORS.values()]
    axes.legend(handles, _PASS_NAMES, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")


def simulated_rows(passes: list[ScheduledPass], pp: int, schedule: str) -> list[TimelineRow]:
    """``draw_timeline``'s rows of a simulated step, each pass labelled ``stage.micro-batch``."""
    rows: list[TimelineRow] = [[] for _ in range(pp)]
    for p in passes:
        rows[p.rank].append((p.kind, p.start, p.end, f"{stage_of(p.rank, p.chunk, pp, schedule)}.{p.microbatch}"))
    return rows


def plot_plan(path: str | Path, layouts: list[tuple[str, Estimate]], timeline: list[TimelineRow] | None = None,
              timeline_title: str = "") -> None:
    """Writes a PNG: a stacked bar of each layout's per-GPU memory against the GPU's memory, and, when
    ``timeline`` is given (``simulated_rows``), the pipeline schedule's step below it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = 2 if timeline else 1
    figure, axes = plt.subplots(rows, 1, figsize=(13, 4.5 * rows), squeeze=False)
    memory_axes = axes[0][0]
    labels = [label for label, _ in layouts]
    bottoms = [0.0] * len(layouts)
    for part in _MEMORY_PARTS:
        values = [getattr(e, part) / 2**30 for _, e in layouts]
        memory_axes.bar(labels, values, bottom=bottoms, label=part)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    limit = min(e.gpu_memory for _, e in layouts) / 2**30
    memory_axes.axhline(limit, color="black", linestyle="--", label=f"GPU memory ({limit:.0f} GiB)")
    memory_axes.set_ylabel("GiB per GPU")
    memory_axes.set_title("Per-GPU memory (fullest pipeline rank)")
    memory_axes.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    memory_axes.tick_params(axis="x", labelrotation=20, labelsize="small")
    if timeline:
        draw_timeline(axes[1][0], timeline, xlabel="time (one forward = 1; labels: stage.micro-batch)",
                      title=timeline_title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
