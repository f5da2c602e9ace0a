"""torchdist_ext.checkpoint: a model saved as two parts (pipeline stages, one optimizer each) loads into another
split of the same model (here one part holding both), parameters and Adam state alike; bad arguments are refused.
The multi-rank resharding (dp2 x tp2 x pp2 saved, dp4 x tp2 and one process loaded) is the main job's test
(tests/examples/test_train_llama.py::test_resumes_at_another_layout_as_if_uninterrupted)."""

import pytest
import torch
from torch import nn

from torchdist_ext import checkpoint

# One process without a process group: what DCP warns it assumes is what these tests mean.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")


def model() -> nn.ModuleDict:
    torch.manual_seed(0)
    return nn.ModuleDict({"first": nn.Linear(4, 8), "second": nn.Linear(8, 2)})


def trained_parts() -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
    whole = model()
    parts = [nn.ModuleDict({"first": whole["first"]}), nn.ModuleDict({"second": whole["second"]})]
    optimizers = [torch.optim.AdamW(part.parameters(), lr=0.1) for part in parts]
    whole["second"](whole["first"](torch.randn(3, 4))).square().sum().backward()
    for optimizer in optimizers:
        optimizer.step()
    return parts, optimizers


def test_parts_load_into_another_split(tmp_path):
    parts, optimizers = trained_parts()
    checkpoint.save(tmp_path, parts, optimizers, extra={"step": 7})
    whole = nn.ModuleDict({"first": nn.Linear(4, 8), "second": nn.Linear(8, 2)})  # other weights
    optimizer = torch.optim.AdamW(whole.parameters(), lr=0.1)
    assert checkpoint.load(tmp_path, [whole], [optimizer], extra={"step": 0}) == {"step": 7}
    for name, param in whole.named_parameters():
        saved = next(p for part in parts for n, p in part.named_parameters() if n == name)
        assert torch.equal(param, saved)
        state = next(o.state[saved] for o in optimizers if saved in o.state)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optimizer.state[param][key], state[key]), (name, key)


def test_bad_arguments_are_refused(tmp_path):
    parts, optimizers = trained_parts()
    with pytest.raises(ValueError, match="one optimizer per part: got 2 parts and 1 optimizers"):
        checkpoint.save(tmp_path, parts, optimizers[:1])
    with pytest.raises(TypeError, match="parts must be nn.Modules"):
        checkpoint.save(tmp_path, ["first", parts[1]], optimizers)
    with pytest.raises(TypeError, match="optimizers must be torch.optim.Optimizers"):
        checkpoint.save(tmp_path, parts, [optimizers[0], None])
    with pytest.raises(ValueError, match=r"parts must not share parameters or buffers: \['first.bias', 'first.weight'\]"):
        checkpoint.save(tmp_path, [parts[0], parts[0]], [optimizers[0], torch.optim.AdamW(parts[0].parameters())])


def test_load_with_gradients_present_still_loads_the_optimizer_state(tmp_path):
    parts, optimizers = trained_parts()
    checkpoint.save(tmp_path, parts, optimizers)
    whole = model()
    optimizer = torch.optim.AdamW(whole.parameters(), lr=0.1)
    whole["second"](whole["first"](torch.randn(3, 4))).sum().backward()  # gradients of the step in progress
    checkpoint.load(tmp_path, [whole], [optimizer])
    assert all(int(optimizer.state[p]["step"]) == 1 for p in whole.parameters())
    assert all(p.grad is not None for p in whole.parameters())


def test_a_never_stepped_optimizer_is_saved_and_loaded_without_state(tmp_path):
    whole = model()
    optimizer = torch.optim.AdamW(whole.parameters(), lr=0.1)
    checkpoint.save(tmp_path, [whole], [optimizer])
    assert not optimizer.state  # saving did not step it
    stepped = torch.optim.AdamW(whole.parameters(), lr=0.1)
    whole["first"].weight.grad = torch.ones_like(whole["first"].weight)
    stepped.step()
    checkpoint.load(tmp_path, [whole], [stepped])
    assert not stepped.state


def test_parameters_saved_with_different_hyperparameters_do_not_merge_silently(tmp_path):
    parts, _ = trained_parts()
    optimizers = [torch.optim.AdamW(parts[0].parameters(), lr=0.1), torch.optim.AdamW(parts[1].parameters(), lr=0.2)]
    checkpoint.save(tmp_path, parts, optimizers)
    whole = model()
    with pytest.raises(ValueError, match=r"optimizers\[0\]: one param group would get the saved lr values"):
        checkpoint.load(tmp_path, [whole], [torch.optim.AdamW(whole.parameters(), lr=0.9)])


def test_bad_checkpoint_arguments_name_the_problem(tmp_path):
    parts, optimizers = trained_parts()
    with pytest.raises(ValueError, match=r"optimizers\[0\] holds parameters that are not in parts\[0\]"):
        checkpoint.save(tmp_path, parts, optimizers[::-1])
    with pytest.raises(TypeError, match=r"extra\['k'\] keys must be strings, got 1"):
        checkpoint.save(tmp_path, parts, optimizers, extra={"k": {1: "a"}})
    with pytest.raises(TypeError, match="parts and optimizers must be sequences"):
        checkpoint.save(tmp_path, parts[0], optimizers[0])
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        checkpoint.load(tmp_path / "missing", parts, optimizers)
    checkpoint.save(tmp_path, parts, optimizers)
    bigger = nn.ModuleDict({"first": nn.Linear(4, 8), "second": nn.Linear(8, 2), "third": nn.Linear(2, 2)})
    with pytest.raises(ValueError, match="third.weight"):
        checkpoint.load(tmp_path, [bigger], [torch.optim.AdamW(bigger.parameters())])
