"""DeviceMeshes built once per worker process.

Creating a mesh creates process groups, a collective call on every rank; tests
that run hundreds of times in a persistent world reuse one mesh per shape.
"""

import functools

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["cached_mesh"]


@functools.cache
def cached_mesh(shape: tuple[int, ...], names: tuple[str, ...], device_type: str = "cpu") -> DeviceMesh:
    """``init_device_mesh(device_type, shape, mesh_dim_names=names)``, memoised per process.

    Every rank must call it with the same arguments in the same order (it is a
    collective the first time).
    """
    return init_device_mesh(device_type, shape, mesh_dim_names=names)
