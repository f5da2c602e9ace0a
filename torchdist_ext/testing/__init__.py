"""Multi-rank testing on CPU: persistent gloo worlds and helpers for exact comparisons.

    with spawn_world(4) as world:
        results = world.run(fn, *args)     # one result per rank; a rank's error comes back with its traceback

Also: ``shard_replicated`` / ``gather_replicated``, ``cached_mesh``, ``RetainedMemory`` and
``pin_inductor_cpu_isa``; pytest fixtures ``world2`` / ``world4`` through
``pytest_plugins = ["torchdist_ext.testing.pytest_fixtures"]``.
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
