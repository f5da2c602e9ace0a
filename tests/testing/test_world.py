"""The persistent test world: results, error propagation, deaths and timeouts."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from torchdist_ext.testing import WorldError, WorldTimeoutError, spawn_world


def rank_and_size(offset, *, scale=1):
    return (dist.get_rank() + offset) * scale, dist.get_world_size()


def all_reduce_rank():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def raise_on_every_rank():
    raise ValueError(f"bad value on rank {dist.get_rank()}")


def raise_on_rank_one_others_block():
    if dist.get_rank() == 1:
        raise KeyError("only rank 1")
    dist.barrier()  # the other ranks wait for rank 1, which never arrives


def exit_rank_zero():
    if dist.get_rank() == 0:
        os._exit(3)
    return "alive"


def sleep_forever():
    while True:
        time.sleep(1.0)


def unpicklable_result():
    return lambda: None


def test_results_come_back_in_rank_order(world4):
    assert world4.run(rank_and_size, 10, scale=2) == [(20, 4), (22, 4), (24, 4), (26, 4)]


def test_collectives_run_across_ranks(world4):
    assert world4.run(all_reduce_rank) == [6.0] * 4  # 0 + 1 + 2 + 3


def test_error_on_every_rank_is_reraised_and_world_survives(world2):
    with pytest.raises(ValueError, match="bad value on rank 0") as info:
        world2.run(raise_on_every_rank)
    assert "raise ValueError" in str(info.value.__cause__)  # the rank's traceback
    assert any("rank 0 of 2" in note for note in getattr(info.value, "__notes__", []))
    assert world2.alive
    assert world2.run(rank_and_size, 0) == [(0, 2), (1, 2)]


def test_error_on_one_rank_ends_a_blocked_world_quickly():
    with spawn_world(2, timeout=60.0) as world:
        start = time.monotonic()
        with pytest.raises(KeyError, match="only rank 1"):
            world.run(raise_on_rank_one_others_block)
        assert time.monotonic() - start < 30.0
        assert not world.alive
        with pytest.raises(WorldError, match="shut down"):
            world.run(rank_and_size, 0)


def test_dead_rank_is_reported():
    with spawn_world(2) as world:
        with pytest.raises(WorldError, match=r"rank\(s\) \[0\] of 2 died"):
            world.run(exit_rank_zero)
        assert not world.alive


def test_hung_world_is_killed_after_timeout():
    with spawn_world(2, timeout=3.0) as world:
        start = time.monotonic()
        with pytest.raises(WorldTimeoutError, match="did not answer within 3 s"):
            world.run(sleep_forever)
        assert time.monotonic() - start < 20.0
        assert not world.alive


def test_unpicklable_result_is_an_error(world2):
    with pytest.raises(WorldError, match="could not be pickled"):
        world2.run(unpicklable_result)
    assert world2.alive


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        spawn_world(0)
    with pytest.raises(ValueError, match="timeout must be positive"):
        spawn_world(2, timeout=0)
