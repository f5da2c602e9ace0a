"""pytest fixtures ``world2``, ``world4`` and ``world8``: persistent worlds shared by a whole pytest run.

Enable them in a ``conftest.py`` with::

    pytest_plugins = ["torchdist_ext.testing.pytest_fixtures"]

A world is started the first time a test asks for it and reused by every later
test; one that was shut down by a failure is replaced by a fresh one.
"""

import pytest

from torchdist_ext.testing.world import World, spawn_world


# Seconds one run may take in a session world before it is shut down (and each collective's timeout in it):
# late in a full suite on two loaded cores a first torch.compile of an MoE block took 82-120 s (14 s alone),
# so the default 120 s cut a passing test short; a hang is still reported, after this long.
SESSION_TIMEOUT = 300.0


class WorldPool:
    """One live world per size, started on first use."""

    def __init__(self):
        self._worlds: dict[int, World] = {}

    def get(self, world_size: int) -> World:
        world = self._worlds.get(world_size)
        if world is None or not world.alive:
            world = spawn_world(world_size, timeout=SESSION_TIMEOUT)
            self._worlds[world_size] = world
        return world

    def close(self) -> None:
        for world in self._worlds.values():
            world.close()
        self._worlds.clear()


@pytest.fixture(scope="session")
def world_pool():
    pool = WorldPool()
    yield pool
    pool.close()


@pytest.fixture
def world2(world_pool) -> World:
    return world_pool.get(2)


@pytest.fixture
def world4(world_pool) -> World:
    return world_pool.get(4)


@pytest.fixture
def world8(world_pool) -> World:
    return world_pool.get(8)
