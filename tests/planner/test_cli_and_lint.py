"""The planner CLI (text, --json parsed back, --plot PNG) and the static lint of training scripts."""

import json
import re
import subprocess
import sys
import textwrap

import pytest

from torchdist_ext.planner.__main__ import main
from torchdist_ext.planner import lint


def run_cli(capsys, *argv):
    assert main(list(argv)) in (0, 1)
    return capsys.readouterr().out


def test_estimate_text(capsys):
    out = run_cli(capsys, "--model", "llama3-70b", "--gpus", "32", "--gpu", "h100-80gb", "--seq", "4096",
                  "--global-batch", "32", "--tp", "8", "--zero", "3", "--sp")
    assert "llama3-70b: 70.6B parameters" in out
    assert "layout tp=8 dp=4 zero3 sp" in out
    assert "fits" in out and "MFU" in out and "findings: none" in out
    assert "per pipeline rank" not in out


def test_estimate_text_lists_each_pipeline_rank(capsys):
    """1F1B's first rank holds the most micro-batches (and the embedding): it is the fullest."""
    out = run_cli(capsys, "--model", "llama3-70b", "--gpus", "64", "--tp", "8", "--pp", "4", "--zero", "1", "--sp")
    assert "memory per GPU (pipeline rank 0, the fullest):" in out
    ranks = re.search(r"per pipeline rank: ([\d.]+) GiB, ([\d.]+) GiB, ([\d.]+) GiB, ([\d.]+) GiB", out)
    assert ranks and sorted(map(float, ranks.groups()), reverse=True) == list(map(float, ranks.groups())), out


def test_context_parallel_method_sets_what_cp_exposes(capsys):
    """32k tokens on 8 H100s: the ring's K/V hide behind the attention, Ulysses' all-to-alls (here in the
    hybrid, 2 inside a ring of 4) do not; the JSON layout carries cp_ulysses."""
    common = ("--model", "llama3-8b", "--gpus", "8", "--seq", "32768", "--global-batch", "8", "--cp", "8", "--zero", "3")
    assert re.search(r"cp +[\d.]+ GiB +[\d.]+ s +exposed +0\.000 s", run_cli(capsys, *common))
    out = run_cli(capsys, *common, "--cp-ulysses", "2")
    assert "layout cp=8 ulysses=2 zero3" in out
    assert not re.search(r"cp +[\d.]+ GiB +[\d.]+ s +exposed +0\.000 s", out), out
    assert json.loads(run_cli(capsys, *common, "--cp-ulysses", "8", "--json"))["layout"]["cp_ulysses"] == 8


def test_estimate_json_round_trip(capsys):
    out = run_cli(capsys, "--model", "llama3-70b", "--gpus", "64", "--tp", "16", "--json")
    document = json.loads(out)
    assert document["mode"] == "estimate"
    assert document["layout"]["tp"] == 16 and document["layout"]["dp"] == 4
    assert [f["code"] for f in document["findings"]] == ["TDX001"]
    assert document["estimate"]["total_memory"] > 0
    assert document["estimate"]["comm"]["tp"]["intra_domain"] is False
    assert [r["total"] for r in document["estimate"]["pipeline_ranks"]] == [document["estimate"]["total_memory"]]


def test_search_json_and_table(capsys):
    document = json.loads(run_cli(capsys, "--model", "llama3-8b", "--gpus", "16", "--global-batch", "64", "--json",
                                  "--top", "5"))
    assert document["mode"] == "search" and 1 <= len(document["results"]) <= 5
    steps = [r["estimate"]["step_seconds"] for r in document["results"]]
    assert steps == sorted(steps)
    table = run_cli(capsys, "--model", "llama3-8b", "--gpus", "16", "--global-batch", "64", "--top", "3")
    assert "fastest feasible layouts" in table and "tokens/s" in table


def test_a_routing_imbalance_prices_the_busiest_expert_rank(capsys):
    """--expert-imbalance: the estimate of a layout and every layout of the search at that routing (capped at
    each layout's ep); the busiest ep rank holds and computes more, so the step is slower."""
    argv = ("--model", "mixtral-8x7b", "--gpus", "64", "--tp", "2", "--ep", "8", "--zero", "1", "--sp", "--json")
    uniform = json.loads(run_cli(capsys, *argv))
    skewed = json.loads(run_cli(capsys, *argv, "--expert-imbalance", "1.5"))
    assert skewed["layout"]["expert_imbalance"] == 1.5 and uniform["layout"]["expert_imbalance"] == 1
    assert skewed["estimate"]["activations"] > uniform["estimate"]["activations"]
    assert skewed["estimate"]["step_seconds"] > uniform["estimate"]["step_seconds"]
    assert "ep-load=1.5" in run_cli(capsys, *argv[:-1], "--expert-imbalance", "1.5")
    search = ("--model", "mixtral-8x7b", "--gpus", "64", "--global-batch", "256", "--top", "20", "--json")
    for result in json.loads(run_cli(capsys, *search, "--expert-imbalance", "4"))["results"]:
        layout = result["layout"]
        assert layout["expert_imbalance"] == min(4, layout["ep"]), layout


@pytest.mark.parametrize(
    "schedule",
    [["--schedule", "1f1b"], ["--schedule", "zb-v"], ["--schedule", "interleaved-1f1b", "--virtual-stages", "2"]],
    ids=["1f1b", "zb-v", "interleaved-1f1b"],
)
def test_plot_writes_png_with_a_pipeline_timeline(tmp_path, capsys, schedule):
    path = tmp_path / "plan.png"
    run_cli(capsys, "--model", "llama3-70b", "--gpus", "64", "--tp", "8", "--pp", "4", "--global-batch", "64",
            *schedule, "--plot", str(path))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    search_plot = tmp_path / "search.png"
    run_cli(capsys, "--model", "llama3-8b", "--gpus", "16", "--global-batch", "64", "--plot", str(search_plot))
    assert search_plot.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gpus", "8", "--tp", "0"], "argument --tp: must lie in [1, 16777216], got 0"),
        (["--gpus", "8", "--tp", "8", "--micro-batch", "0"], "argument --micro-batch: must lie in [1, 16777216], got 0"),
        (["--gpus", "1e30"], "argument --gpus: must be a positive integer, got '1e30'"),
        (["--gpus", "1099511627776"], "argument --gpus: must lie in [1, 16777216], got 1099511627776"),
        (["--gpus", "8", "--tp", "3"], "Layout: tp x pp x dp x cp x ep = 3 x 1 x 2 x 1 x 1 = 6 must equal"),
        (["--gpus", "8", "--tp", "8", "--schedule", "zb-x"], "argument --schedule: invalid choice: 'zb-x'"),
        (["--gpus", "8", "--expert-imbalance", "0.5"], "argument --expert-imbalance: must be a finite number >= 1"),
        (["--gpus", "8", "--expert-imbalance", "nan"], "argument --expert-imbalance: must be a finite number >= 1"),
        (["--gpus", "8", "--tp", "8", "--expert-imbalance", "2"], "Layout.expert_imbalance must lie in [1, ep=1]"),
        (["--gpus", "8", "--cp", "8", "--cp-ulysses", "3"], "Layout.cp_ulysses=3 must divide Layout.cp=8"),
        (["--gpus", "16", "--dp-replicate", "2"], "--dp-replicate 2 prices a layout: give its axes (e.g. --dp)"),
        (["--gpus", "16", "--dp", "16", "--dp-replicate", "2", "--zero", "0"], "Layout.dp_replicate=2 needs zero_stage >= 1"),
    ],
)
def test_bad_arguments_end_with_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "llama3-8b", *argv])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in error, error


@pytest.mark.parametrize("where", ["missing/x.png", "file.txt/x.png"], ids=["missing-dir", "file-as-dir"])
def test_plot_into_a_missing_directory_is_refused_before_the_plan(tmp_path, capsys, where):
    """One line, before the plan is computed or printed: no plan followed by a traceback."""
    (tmp_path / "file.txt").write_text("not a directory")
    path = tmp_path / where
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "llama3-8b", "--gpus", "8", "--tp", "8", "--plot", str(path)])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and captured.out == ""
    problem = "does not exist" if where.startswith("missing") else "is not a directory"
    error = captured.err.strip().splitlines()[-1]
    assert f"argument --plot: {path}: its directory {path.parent} {problem}" in error, captured.err
    assert "Traceback" not in captured.err


@pytest.mark.parametrize("plot, what", [("plan.txt", "a .txt file"), ("", "a suffix-less file"),
                                        (".", "a directory")], ids=["format", "empty", "directory"])
def test_plot_that_names_no_image_file_is_refused_before_the_plan(capsys, plot, what):
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "llama3-8b", "--gpus", "8", "--tp", "8", "--plot", plot])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and captured.out == ""
    assert captured.err.strip().splitlines()[-1].endswith(
        f"argument --plot: {plot!r} is {what}: it must name a .png, .pdf, .svg file"), captured.err


def test_search_is_bounded_on_a_huge_cluster(capsys):
    document = json.loads(run_cli(capsys, "--model", "llama3-8b", "--gpus", "16777216", "--global-batch",
                                  "16777216", "--top", "1", "--json"))
    assert document["results"][0]["layout"]["dp"] >= 16777216 // 8 // 32 // 16


def test_module_entry_point_runs_as_a_program():
    result = subprocess.run([sys.executable, "-m", "torchdist_ext.planner", "--model", "llama3-8b", "--gpus", "8",
                             "--tp", "8", "--json"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["layout"]["tp"] == 8


def write(tmp_path, name, source):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


CLEAN = """
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, DistributedSampler

    def train(model, dataset, optimizer, epochs, accumulation):
        fully_shard(model)
        sampler = DistributedSampler(dataset)
        loader = DataLoader(dataset, sampler=sampler)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for step, batch in enumerate(loader):
                model.set_requires_gradient_sync((step + 1) % accumulation == 0)
                model(batch).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
"""


def test_clean_script_has_no_findings(tmp_path):
    assert lint(write(tmp_path, "clean.py", CLEAN)) == []


@pytest.mark.parametrize(
    "code, mistake, fix",
    [
        ("TDX003", "sampler.set_epoch(epoch)", "pass"),
        ("TDX004", "model.set_requires_gradient_sync((step + 1) % accumulation == 0)",
         "with model.no_sync():\n                    model(batch).backward()"),
        ("TDX005", "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
         "torch.nn.utils.clip_grad_norm_([p.grad.to_local() for p in model.parameters()], 1.0)"),
        ("TDX005", "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
         "norms = [p.grad.norm() for p in model.parameters()]"),
    ],
)
def test_each_code_triggers_on_its_mistake(tmp_path, code, mistake, fix):
    source = textwrap.dedent(CLEAN).replace(mistake, fix)
    assert source != textwrap.dedent(CLEAN)
    findings = lint(write(tmp_path, "train.py", source))
    assert [f.code for f in findings] == [code]
    assert findings[0].line > 0 and str(findings[0]).startswith(str(tmp_path / "train.py"))


def test_unsharded_scripts_may_use_no_sync_and_local_norms(tmp_path):
    source = textwrap.dedent(CLEAN).replace("fully_shard(model)", "model = DDP(model)").replace(
        "from torch.distributed.fsdp import fully_shard",
        "from torch.nn.parallel import DistributedDataParallel as DDP")
    source = source.replace("model.set_requires_gradient_sync((step + 1) % accumulation == 0)",
                            "with model.no_sync():\n                    pass")
    assert lint(write(tmp_path, "ddp.py", source)) == []


def test_lint_cli_and_bad_paths(tmp_path, capsys):
    path = write(tmp_path, "train.py", textwrap.dedent(CLEAN).replace("sampler.set_epoch(epoch)", "pass"))
    assert main(["lint", str(path), "--json"]) == 1
    assert [f["code"] for f in json.loads(capsys.readouterr().out)] == ["TDX003"]
    with pytest.raises(ValueError, match="is not a file"):
        lint(tmp_path / "missing.py")
    with pytest.raises(ValueError, match="is not a Python source file"):
        lint(write(tmp_path, "broken.py", "def ("))
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ValueError, match="is not a Python source file"):
        lint(binary)
    with pytest.raises(SystemExit) as exit_info:
        main(["lint", str(binary)])
    assert exit_info.value.code == 2 and "is not a Python source file" in capsys.readouterr().err
