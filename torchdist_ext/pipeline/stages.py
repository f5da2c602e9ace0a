"""Splitting a model's layers into pipeline stages."""

__all__ = ["partition_layers"]


def partition_layers(num_layers: int, num_stages: int | None = None, *,
                     stage_sizes: list[int] | None = None) -> list[range]:
    """The layer indices of each stage: ``num_stages`` contiguous equal groups (``num_layers`` divisible by
    it), or groups of the given ``stage_sizes`` (positive, summing to ``num_layers``)."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
    if (num_stages is None) == (stage_sizes is None):
        raise ValueError("give exactly one of num_stages and stage_sizes")
    if stage_sizes is None:
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"num_stages must be a positive int, got {num_stages!r}")
        if num_layers % num_stages:
            raise ValueError(f"num_layers={num_layers} must be divisible by num_stages={num_stages} (or give "
                             f"stage_sizes)")
        stage_sizes = [num_layers // num_stages] * num_stages
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in stage_sizes) or sum(stage_sizes) != num_layers:
        raise ValueError(f"stage_sizes must be positive ints summing to num_layers={num_layers}, got {stage_sizes}")
    starts = [sum(stage_sizes[:i]) for i in range(len(stage_sizes))]
    return [range(start, start + size) for start, size in zip(starts, stage_sizes)]
