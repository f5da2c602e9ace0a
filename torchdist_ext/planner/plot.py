"""PNG figures of the planner: per-GPU memory of layouts, and a pipeline schedule's timeline."""

from __future__ import annotations

from pathlib import Path

from torchdist_ext.planner.estimate import Estimate

__all__ = ["plot_plan"]

_MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "backward", "buffers")
_PASS_COLORS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}


def plot_plan(path: str | Path, layouts: list[tuple[str, Estimate]], timeline: list[dict] | None = None,
              timeline_title: str = "") -> None:
    """Writes a PNG: a stacked bar of each layout's per-GPU memory against the GPU's memory, and, when
    ``timeline`` is given, one row per pipeline stage with its F / B / W passes (gaps are the bubble)."""
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
        stage_axes = axes[1][0]
        for p in timeline:
            stage_axes.barh(p["stage"], p["end"] - p["start"], left=p["start"], color=_PASS_COLORS[p["kind"]],
                            edgecolor="white", linewidth=0.5)
        stages = max(p["stage"] for p in timeline) + 1
        stage_axes.set_yticks(range(stages), [f"stage {s}" for s in range(stages)])
        stage_axes.invert_yaxis()
        stage_axes.set_xlabel("time (one forward = 1)")
        stage_axes.set_title(timeline_title)
        handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _PASS_COLORS.values()]
        stage_axes.legend(handles, ["F forward", "B backward (with W unless split)", "W weight grad"],
                          loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
