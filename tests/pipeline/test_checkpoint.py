"""A distributed checkpoint of a pp=2 model (each rank saves its stages, named as in the whole model) loads
into the whole model in one process (pp=1): the weights are those the pipeline trained, and the outputs equal
the model trained in one process."""

from collections import OrderedDict

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from tests.pipeline.test_schedules import batch, loss_fn, reference_model
from torchdist_ext.pipeline import Pipeline, num_stages, partition_layers, stages_of_rank
from torchdist_ext.testing import cached_mesh


def save_at_pp2_and_load_at_pp1(path: str):
    mesh = cached_mesh((2,), ("pp",))
    model = reference_model()
    layers = partition_layers(len(model), num_stages("zb-h1", 2))
    # Each stage keeps its blocks under their names in the whole model ("4.0.weight", ...).
    mine = {s: nn.Sequential(OrderedDict((str(i), model[i]) for i in layers[s]))
            for s in stages_of_rank("zb-h1", 2, mesh.get_local_rank())}
    pipe = Pipeline(mine, pp_mesh=mesh, schedule="zb-h1", num_microbatches=4, loss_fn=loss_fn)
    inputs, targets = batch()
    pipe.step(inputs, targets)
    for stage in mine.values():
        torch.optim.SGD(stage.parameters(), lr=0.1).step()
    state = {k: v for stage in mine.values() for k, v in stage.state_dict().items()}
    dcp.save(state, checkpoint_id=path)

    whole = reference_model()  # pp=1: the whole model, freshly initialised with other weights
    with torch.no_grad():
        for p in whole.parameters():
            p.zero_()
    loaded = whole.state_dict()
    dcp.load(loaded, checkpoint_id=path)
    whole.load_state_dict(loaded)
    same_weights = all(torch.equal(whole.get_parameter(k), v) for k, v in state.items())

    single = reference_model()  # one process trains the same step on the whole batch
    loss_fn(single(inputs), targets).backward()
    torch.optim.SGD(single.parameters(), lr=0.1).step()
    with torch.no_grad():
        torch.testing.assert_close(whole(inputs), single(inputs), rtol=1e-5, atol=1e-6)
    return same_weights, sorted(state)


def test_pp2_checkpoint_loads_into_the_whole_model(world2, tmp_path):
    outcomes = world2.run(save_at_pp2_and_load_at_pp1, str(tmp_path / "ckpt"))
    assert all(same for same, _ in outcomes)
    names = outcomes[0][1] + outcomes[1][1]
    assert sorted(names) == sorted(reference_model().state_dict())
