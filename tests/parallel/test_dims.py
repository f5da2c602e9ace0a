"""ParallelDims: its checks, the planner's Layout both ways, and every mesh's ranks against the rank order it
documents (pp, dp_replicate, dp_shard, ring, ulysses, tp; row-major)."""

import pytest
import torch

from torchdist_ext.parallel import ParallelDims, hybrid_attention, ring_attention, ulysses_attention
from torchdist_ext.planner import Layout


@pytest.mark.parametrize("fields, error, message", [
    ({"world_size": 8, "tp": 0}, ValueError, "ParallelDims: tp=0 must be at least 1"),
    ({"world_size": 8, "dp_shard": 0}, ValueError, "dp_shard=0 must be at least 1, or -1"),
    ({"world_size": 8, "dp_shard": -2}, ValueError, "dp_shard=-2 must be at least 1, or -1"),
    ({"world_size": 8, "cp": 2.0}, TypeError, "cp must be an int, got float 2.0"),
    ({"world_size": 8, "pp": True}, TypeError, "pp must be an int, got bool"),
    ({"world_size": 8, "tp": 3}, ValueError, r"= 3 must divide world_size=8 \(dp_shard=-1 takes the rest\)"),
    ({"world_size": 8, "dp_shard": 2, "tp": 2}, ValueError, "= 4 must equal world_size=8"),
    ({"world_size": 8, "cp": 4, "cp_ulysses": 3}, ValueError, "cp_ulysses=3 must divide cp=4"),
    ({"world_size": 8, "tp": 2, "dp_replicate": 2, "ep": 4}, ValueError,
     r"ep=4 must divide dp_shard x cp = 2 x 1"),
])
def test_dims_that_cannot_exist_are_refused(fields, error, message):
    with pytest.raises(error, match=message):
        ParallelDims(**fields)


def test_dp_shard_takes_what_the_others_leave():
    dims = ParallelDims(world_size=32, dp_replicate=2, cp=2, tp=2, pp=2)
    assert (dims.dp_shard, dims.dp, dims.ring) == (2, 4, 2)


def test_the_planners_layout_both_ways():
    """The planner's ep ranks are data-parallel ranks: dp_shard = its dp x ep / dp_replicate."""
    layout = Layout(tp=2, pp=2, dp=4, dp_replicate=2, cp=2, cp_ulysses=2, ep=2, zero_stage=3, seq_len=128)
    dims = ParallelDims.from_layout(layout)
    assert dims == ParallelDims(world_size=64, dp_replicate=2, dp_shard=4, cp=2, cp_ulysses=2, tp=2, pp=2, ep=2)
    assert dims.layout(seq_len=128) == layout


@pytest.mark.parametrize("call, message", [
    (lambda: ParallelDims.from_layout(Layout(dp=4, zero_stage=1)), r"zero_stage=1; .* \(set zero_stage=3\)"),
    (lambda: ParallelDims.from_layout("tp=2"), "layout must be a torchdist_ext.planner.Layout, got str"),
    (lambda: ParallelDims(world_size=4, cp=2, ep=4).layout(), "ep=4 does not divide dp_shard=2"),
    (lambda: ParallelDims(world_size=4, tp=2).layout(tp=2), r"\['tp'\] are the dims' own"),
])
def test_what_the_planner_cannot_describe_is_refused(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call()


def ranks_of(mesh) -> list[list[int]]:
    """The rank groups of ``mesh``'s process group(s) that hold this rank, as lists (2-D: its whole slice)."""
    return mesh.mesh.reshape(-1, mesh.mesh.shape[-1]).tolist() if mesh.ndim > 1 else [mesh.mesh.tolist()]


def meshes_of(fields: dict) -> dict:
    meshes = ParallelDims(**fields).build_meshes("cpu")
    names = ("pp", "tp", "dp", "batch", "stage", "fsdp", "cp", "ep", "expert_fsdp")
    groups = {name: None if getattr(meshes, name) is None else ranks_of(getattr(meshes, name)) for name in names}
    attention = meshes.context_attention()
    groups["attention"] = None if attention is None else attention.func.__name__
    return groups


def test_meshes_of_hsdp_ring_tp_and_experts(world_pool):
    """8 ranks: dp_replicate 2 x dp_shard 1 x cp 2 (ring) x tp 2, ep 2 over the cp ranks."""
    fields = {"world_size": 8, "dp_replicate": 2, "cp": 2, "tp": 2, "ep": 2}
    results = world_pool.get(8).run(meshes_of, fields)
    grid = torch.arange(8).view(2, 1, 2, 1, 2)  # dp_replicate, dp_shard, ring, ulysses, tp
    for rank, groups in enumerate(results):
        r, _, c, _, t = (int(i) for i in (grid == rank).nonzero()[0])
        assert groups["tp"] == [grid[r, 0, c, 0].tolist()]
        assert groups["cp"] == [grid[r, 0, :, 0, t].tolist()]
        assert groups["dp"] == [grid[:, 0, c, 0, t].tolist()]
        assert groups["batch"] == [grid[:, :, :, :, t].flatten().tolist()]
        assert groups["stage"] == [list(range(8))]
        assert groups["fsdp"] == grid[:, 0, :, 0, t].tolist()  # HSDP: (replicate, shard over dp_shard x cp)
        assert groups["ep"] == [grid[r, 0, :, 0, t].tolist()]
        assert groups["expert_fsdp"] == [[grid[0, 0, c, 0, t].item()], [grid[1, 0, c, 0, t].item()]]
        assert groups["pp"] == [[rank]] and groups["attention"] == ring_attention.__name__


@pytest.mark.parametrize("cp_ulysses, attention", [(4, ulysses_attention), (2, hybrid_attention)])
def test_meshes_of_pipeline_and_ulysses(world_pool, cp_ulysses, attention):
    """8 ranks: pp 2 x cp 4 (Ulysses, or 2 ring x 2 Ulysses): the cp mesh is Ulysses' or the hybrid's 2-D."""
    results = world_pool.get(8).run(meshes_of, {"world_size": 8, "pp": 2, "cp": 4, "cp_ulysses": cp_ulysses})
    for rank, groups in enumerate(results):
        stage = list(range(rank // 4 * 4, rank // 4 * 4 + 4))
        assert groups["pp"] == [[rank % 4, rank % 4 + 4]]
        assert groups["stage"] == groups["batch"] == groups["fsdp"] == [stage]
        assert groups["dp"] == groups["ep"] == [[rank]] and groups["expert_fsdp"] == [stage]
        assert [r for group in groups["cp"] for r in group] == stage and groups["attention"] == attention.__name__


def build_for_four() -> str:
    try:
        ParallelDims(world_size=4, tp=2).build_meshes("cpu")
    except ValueError as error:
        return str(error)
    return "built"


def test_meshes_need_the_world_they_describe(world_pool):
    assert world_pool.get(2).run(build_for_four) == ["ParallelDims.build_meshes: world_size=4 but the process group has "
                                            "2 ranks"] * 2
