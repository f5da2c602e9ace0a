"""The main job on N ranks: trains, and --check matches one process to 1e-4 relative loss (2e-2 with --bf16
mixed precision or --fp8 GEMMs against the fp32 process). README's layout runs under torchrun itself, the
others as forks of the test harness's fork server (the environment torchrun gives, torch imported once)."""

import json
import os
import re
import subprocess
import sys
from dataclasses import astuple
from pathlib import Path

import pytest
import torch

from torchdist_ext.testing.processes import run_script

ROOT = Path(__file__).resolve().parents[2]


def run_main_job(*flags: str, processes: int = 4, script: Path = ROOT / "examples" / "train_llama.py",
                 check: bool = True, torchrun: bool = False) -> str:
    """The script's stdout and stderr (rank 0's first) after it ran on ``processes`` ranks with ``flags`` (and
    ``--check``): forks of the test harness's fork server (torchdist_ext.testing.processes, torch imported
    once), or under ``torchrun`` itself."""
    flags = [*(["--check"] if check else []), *flags]
    # One inductor compile thread per rank: four ranks share two cores.
    env = {"OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    if torchrun:
        command = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node",
                   str(processes), str(script), *flags]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ, **env},
                              cwd=ROOT)
        returncode, output = done.returncode, done.stdout + done.stderr
    else:
        returncode, output = astuple(run_script(script, flags, nproc=processes, timeout=600, env=env))
    assert returncode == 0, output[-6000:]
    return output


def largest_relative_difference(output: str) -> float:
    match = re.search(r"largest relative loss difference over \d+ steps: (\S+)", output)
    assert match, output
    return float(match.group(1))


@pytest.mark.parametrize(
    "flags",
    [
        ("--steps", "4"),
        ("--steps", "3", "--tp", "4", "--no-sequence-parallel"),
        ("--steps", "2", "--dp", "1", "--cp", "2", "--experts", "4", "--ep", "2", "--compile"),
        ("--steps", "3", "--dp", "1", "--cp", "2", "--cp-method", "ulysses", "--experts", "4", "--ep", "2",
         "--capacity-factor", "1.0"),
        ("--steps", "3", "--tp", "1", "--experts", "8", "--ep", "4", "--top-k", "1"),
        ("--steps", "3", "--pp", "2", "--tp", "1", "--schedule", "zb-v", "--microbatches", "4",
         "--recompute", "selective"),
        ("--steps", "3", "--pp", "2", "--schedule", "interleaved-1f1b", "--microbatches", "4", "--recompute", "full"),
        ("--steps", "3", "--pp", "2", "--tp", "1", "--experts", "4", "--ep", "2", "--schedule", "zb-h1",
         "--microbatches", "4", "--capacity-factor", "1.0"),
        ("--steps", "3", "--pp", "2", "--tp", "1", "--cp", "2", "--cp-method", "ring", "--schedule", "zb-h1",
         "--microbatches", "4"),
        ("--steps", "3", "--grad-accum", "2", "--experts", "4", "--ep", "2"),
    ],
    ids=["dp2-tp2-sp", "tp4", "cp2-ring-tp2-ep2-compiled", "cp2-ulysses-tp2-ep2-capacity",
         "dp4-ep4-top1", "pp2-dp2-zb-v-recompute-selective",
         "pp2-tp2-sp-interleaved-recompute-full", "pp2-dp2-ep2-zb-h1-capacity", "pp2-cp2-ring-zb-h1",
         "dp2-tp2-sp-ep2-grad-accum2"],
)  # (dp2 x tp2 (SP) compiled: test_fp8_matches_the_fp32_process_within_the_fp8_tolerance[bf16-compiled-...])
def test_matches_single_process(flags):
    # README's layout under torchrun itself; the others from the test harness's fork server.
    output = run_main_job(*flags, torchrun=flags == ("--steps", "4"))
    assert re.search(r"step +0 +loss \d+\.\d+ .* tokens/s", output), output
    if "--experts" in flags:
        assert re.search(r"expert load max/mean \d+\.\d+", output), output
    assert largest_relative_difference(output) < 1e-4


def test_a_preset_is_built_shard_by_shard_and_matches_one_process():
    """llama3.2-1b's width (one block, a 16k vocabulary) at dp2 x tp2 (SP): built on the meta device, each rank
    allocates its quarter of the model and nothing more while building (measured: a peak of 122.3 MiB for a
    122.0 MiB shard of the 488 MiB model), 2 steps match one process building the whole model alike (measured
    1.3e-7), and the step's peak is within 5 % of the planner's memory per rank (measured 1.01 with two blocks)."""
    output = run_main_job("--model", "llama3.2-1b", "--layers", "1", "--vocab", "16384", "--steps", "2",
                          "--batch", "4", "--seq", "16", "--ledger")
    built = re.search(r"model llama3.2-1b \(1 block, vocab 16,384\): 127,932,416 parameters \(([\d,.]+) MiB\); built "
                      r"on the meta device, rank 0 holds ([\d,.]+) MiB of them, peak ([\d,.]+) MiB while building", output)
    assert built, output
    whole, shard, peak = (float(value.replace(",", "")) for value in built.groups())
    assert whole == pytest.approx(127_932_416 * 4 / 2**20, abs=0.1)
    assert shard == pytest.approx(whole / 4, rel=0.01)
    assert shard <= peak <= 1.05 * shard + 1, output
    assert largest_relative_difference(output) < 1e-4
    assert 0.95 <= ledger_rows(output)["memory per rank"][2] <= 1.05, output


def test_the_planners_memory_at_a_presets_width_across_pipeline_stages():
    """llama3.2-1b's width (two blocks, a 16k vocabulary) at pp2 x tp2 (SP, 1F1B): each pipeline rank's peak
    is the planner's for its stage (measured 1.02 and 1.00; between passes 0.99 and 1.00)."""
    output = run_main_job("--model", "llama3.2-1b", "--layers", "2", "--vocab", "16384", "--steps", "2",
                          "--batch", "4", "--seq", "32", "--pp", "2", "--microbatches", "2", "--ledger", check=False)
    rows = ledger_rows(output)
    for row in ("memory per rank", "between passes", "pp rank 0", "pp rank 1"):
        assert 0.95 <= rows[row][2] <= 1.05, output


def test_bf16_mixed_precision_with_ring_attention_matches_fp32_process():
    output = run_main_job("--steps", "4", "--bf16", "--dp", "1", "--cp", "2", "--cp-method", "ring")
    assert "bf16 on cpu" in output, output
    assert largest_relative_difference(output) < 2e-2


def fp8_run_against_fp32(*flags: str, steps: int, losses: Path) -> list[float]:
    """A main-job run with ``--fp8 <recipe>`` in ``flags``, checked against the fp32 process within the fp8
    tolerance: its losses."""
    output = run_main_job("--steps", str(steps), *flags, "--check-reference", "fp32", "--losses", str(losses))
    recipe = flags[flags.index("--fp8") + 1]
    match = re.search(rf"with fp8 GEMMs \({recipe}\) in (\d+) linears", output)
    assert match and int(match.group(1)) > 0, output
    assert largest_relative_difference(output) < 2e-2
    written = json.loads(losses.read_text())["losses"]
    assert len(written) == steps
    return written


@pytest.mark.parametrize("flags", [
    ("--fp8", "current", "--dp", "1", "--cp", "2", "--cp-method", "ulysses"),
    ("--fp8", "delayed", "--bf16", "--compile", "--fp8-all-gather"),
    ("--fp8", "delayed", "--experts", "4", "--ep", "2"),
    ("--fp8", "block", "--tp", "1", "--cp", "2", "--cp-balance"),
], ids=["cp2-ulysses-tp2-current", "bf16-compiled-delayed-fp8-all-gather", "ep2-delayed", "dp2-cp2-balanced-block"])
def test_fp8_matches_the_fp32_process_within_the_fp8_tolerance(flags, tmp_path):
    """(dp2 x tp2 with delayed scaling in fp32: test_fp8_histories_resume_with_the_model. That FSDP2's fp8
    all-gathers train exactly as full-precision gathers: tests/fp8/test_fsdp_all_gather.py.)"""
    fp8_run_against_fp32(*flags, steps=3, losses=tmp_path / "losses.json")


EIGHT_RANKS_FIVE_AXES = ("--pp", "2", "--schedule", "zb-h1", "--microbatches", "4", "--experts", "4", "--ep", "2",
                         "--recompute", "selective")  # dp2 x tp2 (SP) x pp2, ep2 carved out of dp


def test_eight_ranks_of_pipeline_and_context_parallelism_match_one_process():
    """pp2 x cp2 (Ulysses) x tp2 (SP), ep2 carved out of the cp ranks, zb-v: every stage's sequence shard
    travels between the stages."""
    output = run_main_job("--steps", "3", "--pp", "2", "--tp", "2", "--cp", "2", "--cp-method", "ulysses",
                          "--schedule", "zb-v", "--microbatches", "4", "--experts", "4", "--ep", "2", processes=8)
    assert "pp=2 (zb-v, 4 micro-batches) x dp=1 x cp=2 (ulysses" in output, output
    assert "4 experts (top 2) over ep=2" in output, output
    assert largest_relative_difference(output) < 1e-6  # measured 1.2e-7


def ledger_rows(output: str) -> dict[str, tuple[float, float, float]]:
    """The --ledger table's rows: {name: (planner, measured, ratio)} (planner NaN where it has none)."""
    rows = {}
    for name, planner, measured, ratio in re.findall(r"^ {2,4}(\w[\w +]*?)\s{2,}(n/a|[\d.]+)\s+([\d.]+)\s+([\d.]*)",
                                                     output, flags=re.MULTILINE):
        rows[name] = (float("nan") if planner == "n/a" else float(planner), float(measured),
                      float(ratio) if ratio else float("nan"))
    return rows


def test_eight_ranks_of_every_axis_match_one_process():
    """With the communication ledger on: every axis's bytes as the planner predicts (the experts' all-to-alls
    within the routing's imbalance of the uniform expectation)."""
    output = run_main_job("--steps", "3", *EIGHT_RANKS_FIVE_AXES, "--ledger", processes=8)
    assert "pp=2 (zb-h1, 4 micro-batches) x dp=2" in output and "tp=2, sequence_parallel=True" in output, output
    assert "4 experts (top 2) over ep=2" in output and "recompute=selective" in output, output
    assert largest_relative_difference(output) < 1e-6  # measured 1.4e-7 over 10 steps
    rows = ledger_rows(output)
    for axis in ("tp", "dp", "pp"):  # measured 1.00, 1.01, 1.00
        assert 0.98 <= rows[f"{axis} bytes sent"][2] <= 1.03, output
    # The planner is asked at the measured routing: the untrained router sends the last stage's busiest ep rank
    # 1.57 x the mean of the rows (the first stage's 1.01). At ep = 2 that rank sends as many rows as with
    # uniform routing; the deduplicated dispatch sends more when the routing skews (measured 1.09).
    routing = re.search(r"routing: the busiest ep rank's experts got ([\d.]+) x the mean", output)
    assert routing and 1 <= float(routing.group(1)) <= 2, output
    assert 0.8 <= rows["ep bytes sent"][2] <= 1.25, output
    # The peak inside a B pass (the held activations, the layer's gradients and selective's rerun): measured 1.01
    # (1.06 before the planner counted the backward's gradients); between pipeline passes measured 1.02.
    assert 0.95 <= rows["memory per rank"][2] <= 1.1, output
    assert 0.95 <= rows["between passes"][2] <= 1.1, output
    # Each pipeline rank against its own estimate (the fullest, with the planner's figure above, is rank 0),
    # each at its stage's routing: measured 1.02 (peak) and 1.02 between passes (1.02 and 1.15 at uniform routing).
    assert rows["pp rank 0"][0] == rows["memory per rank"][0] > rows["pp rank 1"][0], output
    assert 0.95 <= rows["pp rank 1"][2] <= 1.1, output
    assert 0 < rows["pipeline bubble"][1] < 1, output


@pytest.mark.parametrize("flags, processes", [
    (("--dp", "1", "--cp", "2", "--cp-method", "ring"), 4),
    (("--dp", "1", "--cp", "2", "--cp-method", "ulysses"), 4),
    (("--tp", "1", "--cp", "4", "--cp-method", "hybrid", "--cp-ulysses", "2"), 4),
    (("--cp", "4", "--cp-method", "ulysses"), 8),  # 2 kv heads of a tp rank, replicated to one per Ulysses rank
], ids=["cp2-ring-tp2", "cp2-ulysses-tp2", "cp4-hybrid-ulysses2", "cp4-ulysses-tp2-kv-replicated"])
def test_ledger_counts_what_the_planner_predicts_for_context_parallelism(flags, processes):
    """The ring's K/V blocks, Ulysses' all-to-alls (hybrid: both), the tensor-parallel rings and FSDP2's
    traffic over dp x cp, each equal to the planner's bytes for the layout (the few bytes of the norms' and
    the loss's small all-reduces are all the difference); and the same run equals one process (these are the
    main job's context-parallel layouts: ring, Ulysses, hybrid)."""
    output = run_main_job("--steps", "3", *flags, "--ledger", processes=processes)
    assert largest_relative_difference(output) < 1e-4
    rows = ledger_rows(output)
    for axis in ("cp", "tp", "dp"):
        if rows[f"{axis} bytes sent"][1]:
            assert 0.99 <= rows[f"{axis} bytes sent"][2] <= 1.01, output
    assert rows["cp bytes sent"][1] > 0, output


def test_hsdp_with_experts_matches_one_process_and_the_planners_bytes():
    """dp=4 as 2 HSDP replicas of 2 shards, experts over ep=2 within each replica: the same losses as one
    process, and FSDP2's traffic within the replicas (dp) and the replicas' all-reduce (dp_replicate) equal to
    the planner's bytes for the layout (measured 1.00 and 1.00; ep 0.99 at the measured routing)."""
    output = run_main_job("--steps", "3", "--tp", "1", "--dp-replicate", "2", "--experts", "4", "--ep", "2",
                          "--ledger")
    assert "dp=4 (HSDP: 2 x 2)" in output, output
    assert largest_relative_difference(output) < 1e-4
    rows = ledger_rows(output)
    for axis in ("dp", "dp_replicate"):
        assert 0.99 <= rows[f"{axis} bytes sent"][2] <= 1.01, output
    assert 0.9 <= rows["ep bytes sent"][2] <= 1.1, output


def test_eight_ranks_of_every_axis_in_fp8_match_one_process_running_the_same_recipe():
    """Delayed scaling against one process with the same recipe and scales: measured 7.7e-5 over 4 steps (fp8
    rounding flips from the GEMMs' summation order, compounded by the updates); 5e-6 after 2 steps."""
    output = run_main_job("--steps", "4", *EIGHT_RANKS_FIVE_AXES, "--fp8", "delayed", "--check-tolerance", "5e-4",
                          processes=8)
    assert "with fp8 GEMMs (delayed)" in output, output
    assert largest_relative_difference(output) < 5e-4


def test_pipeline_zero_bubble_compiled_matches_one_process_and_reports_its_bubble(tmp_path):
    png = tmp_path / "timeline.png"
    output = run_main_job("--steps", "3", "--pp", "2", "--schedule", "zb-h1", "--microbatches", "4", "--compile",
                          "--timeline", str(png))
    assert "pp=2 (zb-h1, 4 micro-batches) x dp=1" in output, output
    assert re.search(r"pipeline zb-h1, pp=2, m=4: measured bubble 0\.\d+ \(per pp rank 0\.\d+, 0\.\d+; "
                     r"mean of 2 steps\), planner 0\.\d+ for the measured F/B/W times \(closed form 0\.077\)",
                     output), output
    assert largest_relative_difference(output) < 1e-4
    assert png.stat().st_size > 0


def losses_of_run(*flags: str, processes: int, path: Path) -> tuple[int, list[float]]:
    run_main_job(*flags, "--losses", str(path), processes=processes, check=False)
    written = json.loads(path.read_text())
    return written["first_step"], written["losses"]


def test_resumes_at_another_layout_as_if_uninterrupted(tmp_path):
    """4 steps at tp2 x pp2 (SP, zb-h1) on 4 ranks with a WSD schedule whose lr changes at every step but
    one, saved every 2 steps; resumed from step 2 at dp2 x tp2 and in one process: steps 2 and 3 equal the
    uninterrupted run's, lr included (measured: equal at dp2 x tp2, about 1e-7 in one process)."""
    layout = ("--pp", "2", "--dp", "1", "--schedule", "zb-h1", "--microbatches", "4")
    schedule = ("--lr-schedule", "wsd", "--warmup-steps", "1", "--decay-steps", "2")  # lr x 1/2, 1, 1, 1/2
    _, uninterrupted = losses_of_run("--steps", "4", *layout, *schedule, "--save", str(tmp_path / "ckpt"),
                                     "--save-every", "2", processes=4, path=tmp_path / "whole.json")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-2", "step-4"]
    for flags, processes in [(("--tp", "2"), 4), (("--tp", "1"), 1)]:
        first, resumed = losses_of_run("--steps", "4", *flags, *schedule, "--resume", str(tmp_path / "ckpt" / "step-2"),
                                       processes=processes, path=tmp_path / f"resumed{processes}.json")
        assert first == 2 and resumed == pytest.approx(uninterrupted[2:], rel=1e-5), (flags, resumed, uninterrupted)


def test_fp8_histories_resume_with_the_model(tmp_path):
    """--fp8 delayed at dp2 x tp2, within the fp8 tolerance of the fp32 process, saved every 2 of 4 steps:
    resumed from step 2 at the same layout, the fp8 amax histories and scales come back and the losses equal
    the uninterrupted run's exactly; at tp1 x pp2 within 1e-4 (measured 1.0e-5: fp8 rounding of sums in
    another order)."""
    ckpt = tmp_path / "ckpt"
    uninterrupted = fp8_run_against_fp32("--fp8", "delayed", "--save", str(ckpt), "--save-every", "2", steps=4,
                                         losses=tmp_path / "whole.json")
    _, same = losses_of_run("--steps", "4", "--fp8", "delayed", "--resume", str(ckpt / "step-2"), processes=4,
                            path=tmp_path / "same.json")
    assert same == uninterrupted[2:]
    _, other = losses_of_run("--steps", "4", "--fp8", "delayed", "--tp", "1", "--pp", "2", "--resume",
                             str(ckpt / "step-2"), processes=4, path=tmp_path / "other.json")
    assert other == pytest.approx(uninterrupted[2:], rel=1e-4)


@pytest.mark.parametrize("flags, message", [
    (("--pp", "2", "--microbatches", "3"), "--batch 8 / dp=1 must be divisible by --microbatches 3"),
    (("--pp", "2", "--schedule", "interleaved-1f1b", "--microbatches", "3", "--batch", "6"),
     "TDX008 error: Layout: schedule 'interleaved-1f1b' needs num_microbatches divisible by pp=2, got 3"),
    (("--tp", "4", "--seq", "66"), "TDX008 error: Layout: with sequence_parallel, tp=4 must divide seq_len / cp = 66"),
    (("--experts", "3", "--ep", "2"), "--ep 2 must divide dp x cp = 2 and --experts 3"),
    (("--tp", "3", "--dp", "1", "--pp", "1"), "--dp 1 x --cp 1 x --tp 3 x --pp 1 must equal the world size 4"),
    (("--grad-accum", "3"), "--batch 8 / dp=2 must be divisible by --grad-accum 3"),
    (("--grad-accum", "2", "--pp", "2"), "--grad-accum with --pp: the pipeline's --microbatches already accumulate"),
    (("--pp", "2", "--compile", "--fp8", "delayed"), "--fp8 delayed with --compile and --pp is not supported"),
    (("--dp", "1", "--cp", "2", "--experts", "4", "--ep", "2", "--ledger"),
     "--ledger sets the run beside the planner, whose expert-parallel ranks are data-parallel ranks: --ep 2 must "
     "divide dp=1 (here ep spans cp ranks, which the planner does not model)"),
    (("--pp", "4", "--tp", "1", "--schedule", "zb-v"),
     "--pp 4 with --schedule zb-v makes 8 pipeline stages (2 per rank): num_layers=4 must be divisible by "
     "num_stages=8"),
    (("--tp", "8"), "--cp 1 x --tp 8 x --pp 1 = 8 must divide the world size 4 (dp takes the rest)"),
    (("--dp-replicate", "4"), "--dp-replicate 4 must divide dp=2"),
    (("--lr-schedule", "wsd", "--steps", "10", "--warmup-steps", "9"), "--lr-schedule wsd: WarmupStableDecay: "
     "warmup_steps + decay_steps = 9 + 2 must not exceed total_steps=10"),
    (("--lr-schedule", "warmup-cosine", "--min-lr-ratio", "2"), "--lr-schedule warmup-cosine: WarmupCosine: "
     "min_ratio=2.0 must be a number in [0, 1]"),
    (("--save-every", "2",), "--save-every needs --save DIR"),
    (("--tp", "1", "--dp-replicate", "2", "--experts", "4", "--ep", "4"),
     "--ep 4 must divide dp x cp = 2 of an HSDP replica and --experts 4"),
    (("--model", "mixtral-8x7b", "--top-k", "1"), "--top-k 1 contradicts --model mixtral-8x7b, whose is 2"),
    (("--vocab", "255",), "the model's vocabulary (255) must hold the data's: the built-in corpus (bytes) has 256"),
    (("--model", "llama3.2-1b", "--tp", "3", "--dp", "1", "--cp", "1", "--pp", "1", "--seq", "96"),
     "--dp 1 x --cp 1 x --tp 3 x --pp 1 must equal the world size 4"),
    (("--model", "llama3.2-1b", "--pp", "4", "--tp", "1", "--layers", "6"),
     "num_layers=6 must be divisible by num_stages=4"),
], ids=["batch", "interleaved", "sequence-parallel", "experts", "world", "grad-accum", "grad-accum-pp",
        "fp8-delayed-compiled-pp", "ledger-ep-over-cp", "stages-over-layers", "world-without-dp", "hsdp",
        "lr-wsd", "lr-cosine", "save-every", "hsdp-ep", "preset-top-k", "vocab", "preset-world",
        "preset-stages"])
def test_a_layout_that_cannot_run_is_refused_before_any_process_group(flags, message, monkeypatch, capsys):
    """The main job's argument parsing, in this process with WORLD_SIZE=4 and no process group: the refusal
    comes before any group is built, with the planner's finding code where the planner sees the problem."""
    assert_refused(flags, message, monkeypatch, capsys)


def assert_refused(flags: tuple[str, ...], message: str, monkeypatch, capsys) -> None:
    """The main job's parse_args, in this process with WORLD_SIZE=4 and no process group, ends with argparse's
    one-line error (exit status 2) holding ``message``."""
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    monkeypatch.setenv("WORLD_SIZE", "4")
    from train_llama import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(list(flags))
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in error, error
    assert "Traceback" not in error


@pytest.mark.parametrize("flag, value", [
    ("--tp", "0"), ("--pp", "0"), ("--cp", "0"), ("--dp", "0"), ("--microbatches", "0"), ("--microbatches", "-1"),
    ("--cp-ulysses", "0"), ("--virtual-stages", "0"), ("--ep", "0"), ("--steps", "0"), ("--batch", "-8"),
    ("--grad-accum", "0"), ("--tp", "two"), ("--dp-replicate", "0"),
])
def test_a_size_below_one_is_refused_naming_its_flag(flag, value, monkeypatch, capsys):
    """Not divided by (ZeroDivisionError), nor read as the default (--dp 0, --microbatches 0), nor passed on to
    the planner's figures (--microbatches -1 as a negative micro-batch)."""
    got = repr(value) if not value.lstrip("-").isdigit() else value
    assert_refused((flag, value), f"argument {flag}: must be an integer >= 1, got {got}", monkeypatch, capsys)


def test_experts_may_be_zero_but_not_negative(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    monkeypatch.setenv("WORLD_SIZE", "4")
    from train_llama import parse_args

    assert parse_args(["--experts", "0"]).experts == 0
    assert_refused(("--experts", "-1"), "argument --experts: must be an integer >= 0, got -1", monkeypatch, capsys)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")
def test_steps_below_the_resumed_step_are_refused_before_any_process_group(tmp_path, monkeypatch, capsys):
    """--steps counts from the start of the run: below the checkpoint's step the run would train nothing. The
    step is read from the checkpoint before any group is built (checkpoint.load_extra)."""
    from torchdist_ext import checkpoint

    layer = torch.nn.Linear(2, 2)
    checkpoint.save(tmp_path / "ckpt", [layer], [torch.optim.AdamW(layer.parameters())], extra={"step": 5})
    resume = ("--resume", str(tmp_path / "ckpt"))
    assert_refused((*resume, "--steps", "3"), f"--steps 3 is smaller than step 5, where the checkpoint --resume "
                   f"{tmp_path / 'ckpt'} was saved: --steps counts from the start of the run, so give --steps 5 "
                   "or more", monkeypatch, capsys)
    from train_llama import parse_args

    assert parse_args([*resume, "--steps", "5"]).steps == 5
    assert_refused(("--resume", str(tmp_path / "missing")), f"--resume {tmp_path / 'missing'}: {tmp_path / 'missing'} "
                   "holds no checkpoint", monkeypatch, capsys)
    (tmp_path / "ckpt" / ".metadata").write_bytes(b"garbage")
    assert_refused(resume, f"--resume {tmp_path / 'ckpt'}: checkpoint {tmp_path / 'ckpt'}: its metadata file",
                   monkeypatch, capsys)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")
def test_a_resume_with_another_lr_schedule_is_refused_before_any_process_group(tmp_path, monkeypatch, capsys):
    """A schedule's lr at a step depends on --steps and its flags: resuming a warmup-cosine run of 2 steps with
    --steps 4 would jump back up the longer curve. A checkpoint saved without a schedule is a constant lr's."""
    from torchdist_ext import checkpoint
    from torchdist_ext.lr_schedules import WarmupCosine

    layer = torch.nn.Linear(2, 2)
    schedule = repr(WarmupCosine(total_steps=2))
    checkpoint.save(tmp_path / "ckpt", [layer], [torch.optim.AdamW(layer.parameters())],
                    extra={"step": 2, "lr_schedule": schedule})
    resume = ("--resume", str(tmp_path / "ckpt"), "--lr-schedule", "warmup-cosine")
    assert_refused((*resume, "--steps", "4"), f"was saved by a run with the lr schedule {schedule}; this run's is "
                   "WarmupCosine(total_steps=4, warmup_steps=0, min_ratio=0.1): resume with the same --steps and "
                   "--lr-schedule flags", monkeypatch, capsys)
    from train_llama import parse_args

    assert parse_args([*resume, "--steps", "2"]).steps == 2
    checkpoint.save(tmp_path / "old", [layer], [torch.optim.AdamW(layer.parameters())], extra={"step": 2})
    assert parse_args(["--resume", str(tmp_path / "old"), "--steps", "4"]).steps == 4
    assert_refused(("--resume", str(tmp_path / "old"), "--steps", "4", "--lr-schedule", "wsd"),
                   "was saved by a run with the lr schedule constant", monkeypatch, capsys)


def test_device_cuda_without_a_gpu_says_so():
    """--device cuda is the GPU path (NCCL, bf16); without a visible GPU it stops with a clear message."""
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "1",
                             str(ROOT / "examples" / "train_llama.py"), "--device", "cuda", "--tp", "1"],
                            capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert result.returncode != 0
    assert "--device cuda: no CUDA device is visible to this process" in result.stdout + result.stderr


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_one_gpu_in_bf16_matches_the_fp32_process():
    output = run_main_job("--device", "cuda", "--tp", "1", "--steps", "10", processes=1)
    assert "bf16 on cuda" in output, output
    assert largest_relative_difference(output) < 2e-2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_one_gpu_fp8_all_gather_matches_the_fp32_process():
    output = run_main_job("--device", "cuda", "--tp", "1", "--steps", "10", "--fp8", "delayed", "--fp8-all-gather",
                          processes=1)
    assert "(fp8 all-gathers) on cuda" in output, output
    assert largest_relative_difference(output) < 2e-2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cublas_workspaces_are_counted_apart_from_tensors(monkeypatch):
    """The --ledger report's CUDA peak leaves out cuBLAS's workspaces (one per handle and stream: here the
    forward's thread and autograd's backward thread): counting them frees them, and what stays allocated is
    the tensors alone."""
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    from predicted_vs_measured import cublas_workspace_bytes

    device = torch.device("cuda")
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    a = torch.randn(64, 64, device=device, requires_grad=True)
    (a @ a).sum().backward()
    assert cublas_workspace_bytes(device) > 0
    assert cublas_workspace_bytes(device) == 0  # freed by the first count
    assert torch.cuda.memory_allocated(device) - before == a.nbytes + a.grad.nbytes
