"""Multi-rank testing on CPU: persistent gloo worlds and replicated-tensor helpers.

    spawn_world(world_size, *, timeout=120.0) -> World     (see world.py)
    World.run(fn, *args, **kwargs) -> list                 one result per rank
    shard_replicated(x, *, mesh, dim) / gather_replicated(x, *, mesh, dim)   (see replicated.py)
    cached_mesh(shape, names)                              a DeviceMesh built once per process
    RetainedMemory()                                       bytes a forward keeps alive (see retained_memory.py)
    pin_inductor_cpu_isa()                                 one inductor CPU vector ISA per machine (see inductor_isa.py)
pytest fixtures ``world2`` / ``world4``: ``pytest_plugins = ["torchdist_ext.testing.pytest_fixtures"]``.
"""

from torchdist_ext.testing.inductor_isa import pin_inductor_cpu_isa
from torchdist_ext.testing.mesh_cache import cached_mesh
from torchdist_ext.testing.replicated import gather_replicated, shard_replicated
from torchdist_ext.testing.retained_memory import RetainedMemory
from torchdist_ext.testing.world import World, WorldError, WorldTimeoutError, spawn_world

__all__ = [
    "RetainedMemory",
    "World",
    "WorldError",
    "WorldTimeoutError",
    "cached_mesh",
    "gather_replicated",
    "pin_inductor_cpu_isa",
    "shard_replicated",
    "spawn_world",
]
