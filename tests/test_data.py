"""DataParallelSampler: shards by the data-parallel rank only (the tp ranks of a replica read the same samples),
reads every epoch as one permutation in global batches, rank r the r-th block of each (what one process reading
the global batch and chunking it by dp would give), reshuffles each epoch without set_epoch, and resumes at
another dp size where it stopped."""

import numpy as np
import pytest
import torch

from torchdist_ext.data import DataParallelSampler
from torchdist_ext.testing import cached_mesh

SAMPLES, GLOBAL_BATCH = 24, 6


def one_process_batches(epochs: int, *, num_samples: int = SAMPLES, **kwargs) -> list[torch.Tensor]:
    """The global batches of ``epochs`` epochs as one process reads them."""
    sampler = DataParallelSampler(num_samples, batch_size=GLOBAL_BATCH, seed=5, **kwargs)
    return list(torch.tensor([i for _ in range(epochs) for i in sampler]).split(GLOBAL_BATCH))


def read_on_ranks(dp: int, tp: int, *, state: dict | None = None, save_after: int | None = None, **kwargs):
    """(this rank's (dp, tp) coordinates, its samples per step over two epochs, the state after
    ``save_after`` steps)."""
    mesh = cached_mesh((dp, tp), ("dp", "tp"))
    sampler = DataParallelSampler(kwargs.pop("num_samples", SAMPLES), dp_mesh=mesh["dp"],
                                  batch_size=GLOBAL_BATCH // dp, seed=5, **kwargs)
    if state is not None:
        sampler.load_state_dict(state)
    per_step, saved = [], None
    for _ in range(2):
        for batch in torch.tensor(list(sampler), dtype=torch.long).split(GLOBAL_BATCH // dp):
            per_step.append(batch)
            sampler.advance()
            if len(per_step) == save_after:
                saved = sampler.state_dict()
    return (mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()), per_step, saved


def test_dp_ranks_read_their_block_of_each_global_batch_and_tp_ranks_the_same(world_pool):
    results = {coordinate: steps for coordinate, steps, _ in world_pool.get(4).run(read_on_ranks, 2, 2)}
    expected = one_process_batches(epochs=2)  # the second epoch reshuffled, without set_epoch
    assert len(results[(0, 0)]) == len(expected) == 2 * SAMPLES // GLOBAL_BATCH
    for dp_rank in range(2):
        for tp_rank in range(2):
            for step, batch in enumerate(expected):
                assert torch.equal(results[(dp_rank, tp_rank)][step], batch.chunk(2)[dp_rank])


def test_resumes_at_another_dp_size(world_pool):
    """Saved after 3 steps at dp=2, resumed at dp=3 with the same global batch: the same batches follow."""
    saved = world_pool.get(2).run(read_on_ranks, 2, 1, save_after=3)[0][2]
    assert saved == {"epoch": 0, "position": 3 * GLOBAL_BATCH, "seed": 5, "num_samples": SAMPLES}
    expected = one_process_batches(epochs=2)[3:]
    for (dp_rank, _), steps, _ in world_pool.get(3).run(read_on_ranks, 3, 1, state=saved):
        assert len(steps) == len(expected)
        for step, batch in enumerate(expected):
            assert torch.equal(steps[step], batch.chunk(3)[dp_rank])


def test_an_uneven_dataset_completes_or_drops_its_last_global_batch(world_pool):
    for drop_last in (False, True):
        expected = one_process_batches(1, num_samples=20, drop_last=drop_last)
        assert len(expected) == (3 if drop_last else 4)
        for (dp_rank, _), steps, _ in world_pool.get(2).run(read_on_ranks, 2, 1, num_samples=20, drop_last=drop_last):
            assert all(torch.equal(steps[s], batch.chunk(2)[dp_rank]) for s, batch in enumerate(expected))


def test_each_epoch_is_a_new_permutation_without_set_epoch():
    sampler = DataParallelSampler(SAMPLES, seed=1)
    epochs = [list(sampler) for _ in range(3)]
    assert all(sorted(epoch) == list(range(SAMPLES)) for epoch in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    sampler.set_epoch(0)
    assert list(sampler) == epochs[0]
    assert list(DataParallelSampler(5, shuffle=False)) == [0, 1, 2, 3, 4]


def test_a_state_read_to_the_end_of_its_epoch_resumes_with_the_next():
    sampler = DataParallelSampler(SAMPLES, batch_size=GLOBAL_BATCH, seed=5)
    first = list(sampler)
    sampler.advance(SAMPLES // GLOBAL_BATCH)
    resumed = DataParallelSampler(SAMPLES, batch_size=GLOBAL_BATCH, seed=5)
    resumed.load_state_dict(sampler.state_dict())
    assert resumed.epoch == 1 and len(resumed) == SAMPLES
    assert list(resumed) == list(sampler) != first


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="num_samples must be an int >= 1, got 0"):
        DataParallelSampler(0)
    with pytest.raises(TypeError, match="batch_size must be an int, got 2.0"):
        DataParallelSampler(4, batch_size=2.0)
    with pytest.raises(TypeError, match="seed must be an int, got tensor"):
        DataParallelSampler(4, seed=torch.tensor(1))
    with pytest.raises(ValueError, match="seed must be an int >= 0, got -1"):
        DataParallelSampler(4, seed=-1)
    numpy_sized = DataParallelSampler(np.int64(4), batch_size=np.int32(2), seed=np.int64(3))  # numpy ints count
    assert list(numpy_sized) == list(DataParallelSampler(4, batch_size=2, seed=3))
    with pytest.raises(TypeError, match="dp_mesh must be a 1-D DeviceMesh"):
        DataParallelSampler(4, dp_mesh="dp")
    with pytest.raises(ValueError, match="must be at least one global batch"):
        DataParallelSampler(4, batch_size=5, drop_last=True)
    sampler = DataParallelSampler(4, batch_size=2)
    with pytest.raises(ValueError, match="global_batches 3 goes past the end of epoch 0"):
        sampler.advance(3)
    with pytest.raises(ValueError, match="state seed 1 differs from this sampler's 0"):
        sampler.load_state_dict({"epoch": 0, "position": 0, "seed": 1, "num_samples": 4})
    with pytest.raises(ValueError, match="state position 1 must be divisible by the global batch 2"):
        sampler.load_state_dict({"epoch": 0, "position": 1, "seed": 0, "num_samples": 4})
    with pytest.raises(ValueError, match="state must be a mapping with the keys epoch, position, seed, num_samples"):
        sampler.load_state_dict({"epoch": 0})
    with pytest.raises(TypeError, match="shuffle must be a bool, got 'no'"):
        DataParallelSampler(4, shuffle="no")


def test_seeds_do_not_share_orders_one_epoch_apart():
    """Seeding with seed + epoch would give seed 0's epoch 1 the order of seed 1's epoch 0."""
    zero, one = DataParallelSampler(SAMPLES, seed=0), DataParallelSampler(SAMPLES, seed=1)
    list(zero)
    assert list(zero) != list(one)
    assert len(list(DataParallelSampler(SAMPLES, seed=2**80))) == SAMPLES  # any int seeds the generator
