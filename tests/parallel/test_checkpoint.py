"""Distributed checkpoints reshard TP layers: saved at tp=2 (x dp=2, FSDP2), loaded at tp=1 and in one process."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

import torchdist_ext  # noqa: F401
from tests.numerics import assert_close_to_scale
from tests.parallel.test_fsdp import inputs, parallel_model, reference_model
from torchdist_ext.testing import cached_mesh


def save_at_tp2(path):
    mesh = cached_mesh((2, 2), ("dp", "tp"))
    model = parallel_model(reference_model(), mesh["tp"], mesh["dp"], sequence_parallel=True)
    dcp.save(get_model_state_dict(model), checkpoint_id=path)
    return True


def scrambled_reference():
    model = reference_model()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-3.0).add_(1.0)
    return model


def load_at_tp1(path):
    mesh = cached_mesh((2, 1), ("dp", "tp"))
    model = parallel_model(scrambled_reference(), mesh["tp"], mesh["dp"], sequence_parallel=False)
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state)
    x = inputs().chunk(2, dim=0)[mesh["dp"].get_local_rank()]
    expected = reference_model()(inputs()).chunk(2, dim=0)[mesh["dp"].get_local_rank()]
    assert_close_to_scale(model(x), expected, what="tp=1 output after load")
    return True


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_save_tp2_load_tp1_and_single_process(world4, world2, tmp_path):
    path = str(tmp_path / "ckpt")
    assert all(world4.run(save_at_tp2, path))
    assert all(world2.run(load_at_tp1, path))

    plain = scrambled_reference()
    state = plain.state_dict()
    dcp.load(state, checkpoint_id=path, no_dist=True)
    plain.load_state_dict(state)
    assert_close_to_scale(plain(inputs()), reference_model()(inputs()), what="single-process output after load")
