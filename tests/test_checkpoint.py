"""torchdist_ext.checkpoint: a model saved as two parts (pipeline stages, one optimizer each) loads into another
split of the same model (here one part holding both), parameters and Adam state alike; bad arguments are refused.
The multi-rank resharding (dp2 x tp2 x pp2 saved, dp4 x tp2 and one process loaded) is the main job's test
(tests/examples/test_train_llama.py::test_resumes_at_another_layout_as_if_uninterrupted)."""

import pickle

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


def corrupt_load_error(tmp_path, damage) -> ValueError:
    """Saves a checkpoint, ``damage(directory)``s it and returns the ValueError its load raises."""
    parts, optimizers = trained_parts()
    checkpoint.save(tmp_path, parts, optimizers, extra={"step": 7})
    damage(tmp_path)
    whole = model()
    with pytest.raises(ValueError) as error_info:
        checkpoint.load(tmp_path, [whole], [torch.optim.AdamW(whole.parameters())], extra={"step": 0})
    return error_info.value


def one_line_without_frames_or_unsafe_advice(error: ValueError) -> str:
    message = str(error)
    assert "\n" not in message and "FrameSummary" not in message and "Traceback" not in message, message
    assert "weights_only" not in message, message  # never pass on torch.load's advice to unpickle unsafely
    assert error.__cause__ is not None  # the original, chained
    return message


@pytest.mark.parametrize("content", [b"garbage" * 10, b"", pickle.dumps({"not": "metadata"})],
                         ids=["garbage", "empty", "foreign-pickle"])
def test_a_corrupt_metadata_file_is_named(tmp_path, content):
    error = corrupt_load_error(tmp_path, lambda directory: (directory / ".metadata").write_bytes(content))
    message = one_line_without_frames_or_unsafe_advice(error)
    assert message.startswith(f"checkpoint {tmp_path}: its metadata file {tmp_path / '.metadata'} is corrupt or "
                              "not a checkpoint written by torchdist_ext.checkpoint"), message
    with pytest.raises(ValueError, match="its metadata file .* is corrupt"):
        checkpoint.load_extra(tmp_path, {"step": 0})


def flip_a_global_of_each_shard(directory) -> None:
    """A bit flipped in each shard's first tensor record: its pickle then names a global torch.load refuses."""
    for shard in directory.glob("*.distcp"):
        data = bytearray(shard.read_bytes())
        at = data.find(b"_rebuild_tensor_v2")
        assert at >= 0, shard
        data[at + 1] ^= 0x01
        shard.write_bytes(bytes(data))


def zero_each_shard(directory) -> None:
    for shard in directory.glob("*.distcp"):
        shard.write_bytes(bytes(shard.stat().st_size))


@pytest.mark.parametrize("damage", [flip_a_global_of_each_shard, zero_each_shard], ids=["bit-flip", "zeroed"])
def test_a_corrupt_shard_file_is_named_without_unsafe_advice(tmp_path, damage):
    message = one_line_without_frames_or_unsafe_advice(corrupt_load_error(tmp_path, damage))
    assert message.startswith(f"checkpoint {tmp_path}: a shard file (*.distcp) is corrupt or not a checkpoint "
                              "written by torchdist_ext.checkpoint"), message


def test_a_missing_shard_file_is_named(tmp_path):
    def remove_shards(directory):
        for shard in directory.glob("*.distcp"):
            shard.unlink()

    message = one_line_without_frames_or_unsafe_advice(corrupt_load_error(tmp_path, remove_shards))
    assert message.startswith(f"checkpoint {tmp_path}: its shard file {tmp_path}") and "is missing" in message


def test_a_refused_load_says_why_in_one_line(tmp_path):
    """DCP's failure (a key the checkpoint lacks) without the stack frames it carries."""
    parts, optimizers = trained_parts()
    checkpoint.save(tmp_path, parts, optimizers)
    bigger = nn.ModuleDict({"first": nn.Linear(4, 8), "second": nn.Linear(8, 2), "third": nn.Linear(2, 2)})
    with pytest.raises(ValueError) as error_info:
        checkpoint.load(tmp_path, [bigger], [torch.optim.AdamW(bigger.parameters())])
    message = one_line_without_frames_or_unsafe_advice(error_info.value)
    missing = "Missing key in checkpoint state_dict: model.third.weight"
    assert message.startswith(f"checkpoint {tmp_path}: {missing}"), message


def test_extra_values_load_without_a_model(tmp_path):
    parts, optimizers = trained_parts()
    checkpoint.save(tmp_path, parts, optimizers, extra={"step": 7, "sampler": {"epoch": 2}})
    assert checkpoint.load_extra(tmp_path, {"step": 0}) == {"step": 7}
    assert checkpoint.load_extra(tmp_path, {"step": 0, "sampler": {"epoch": 0}}) == {"step": 7, "sampler": {"epoch": 2}}
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        checkpoint.load_extra(tmp_path / "missing", {"step": 0})
    with pytest.raises(TypeError, match="extra must be a dict, got NoneType"):
        checkpoint.load_extra(tmp_path, None)


def test_latest_is_the_checkpoint_itself_or_the_largest_step_in_a_directory(tmp_path):
    for step in (2, 10, 4):
        (tmp_path / f"step-{step}").mkdir()
        (tmp_path / f"step-{step}" / ".metadata").write_bytes(b"")
    (tmp_path / "step-20").mkdir()  # a save that never finished: no .metadata
    assert checkpoint.latest(tmp_path) == tmp_path / "step-10"
    assert checkpoint.latest(tmp_path / "step-4") == tmp_path / "step-4"
    with pytest.raises(FileNotFoundError, match="step-20 holds no checkpoint"):
        checkpoint.latest(tmp_path / "step-20")
    with pytest.raises(FileNotFoundError, match="missing holds no checkpoint"):
        checkpoint.latest(tmp_path / "missing")


def test_a_hyperparameter_the_checkpoint_lacks_keeps_this_runs_value(tmp_path):
    """Saved without an lr scheduler, loaded into an optimizer that has one (its initial_lr): the state and the
    saved lr load, initial_lr stays this run's (before the fix DCP refused the missing key)."""
    from torchdist_ext.lr_schedules import WarmupCosine, lr_scheduler

    parts, optimizers = trained_parts()
    checkpoint.save(tmp_path, parts, optimizers)
    whole = model()
    optimizer = torch.optim.AdamW(whole.parameters(), lr=0.5)
    lr_scheduler(optimizer, WarmupCosine(total_steps=10))
    checkpoint.load(tmp_path, [whole], [optimizer])
    assert optimizer.param_groups[0]["initial_lr"] == 0.5 and optimizer.param_groups[0]["lr"] == 0.1
    assert all(torch.equal(optimizer.state[p]["step"], torch.tensor(1.0)) for p in whole.parameters())
