"""run_script: a script on N ranks as torchrun runs it, from the fork server that imported torch once."""

import textwrap
import time

import pytest

from torchdist_ext.testing.processes import run_script

SCRIPT = """
    import os, sys, time
    import torch
    import torch.distributed as dist

    if __name__ == "__main__":
        dist.init_process_group("gloo")
        total = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(total)
        print(f"rank {os.environ['RANK']}/{os.environ['WORLD_SIZE']} local {os.environ['LOCAL_RANK']}/"
              f"{os.environ['LOCAL_WORLD_SIZE']} argv {sys.argv[1:]} sum {total.item():g} "
              f"color {os.environ.get('COLOR')} path0 {os.path.basename(sys.path[0])}")
        mode = sys.argv[1]
        if mode == "fail-one" and dist.get_rank() == 1:
            raise SystemExit("rank 1 refuses")
        if mode == "fail-one":
            dist.barrier()  # waits for rank 1, which never comes
        if mode == "hang":
            dist.barrier() if dist.get_rank() == 0 else time.sleep(600)
        dist.destroy_process_group()
        sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "folder" / "script.py"
    path.parent.mkdir()
    path.write_text(textwrap.dedent(SCRIPT))
    return path


def test_every_rank_runs_the_script_with_torchruns_environment(script):
    result = run_script(script, ["ok"], nproc=3, env={"COLOR": "blue"})
    assert result.returncode == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == "rank 0/3 local 0/3 argv ['ok'] sum 3 color blue path0 folder"
    assert "[rank 2]" in lines and "rank 2/3 local 2/3 argv ['ok'] sum 3 color blue path0 folder" in lines


def test_an_exit_status_comes_back(script):
    assert run_script(script, ["ok", "7"], nproc=2).returncode == 7


def test_a_failing_rank_ends_the_others_after_the_grace(script):
    start = time.monotonic()
    result = run_script(script, ["fail-one"], nproc=2, grace=2.0)
    assert result.returncode == 1 and "rank 1 refuses" in result.output, result.output
    assert time.monotonic() - start < 60


def test_a_hung_run_is_killed_at_the_timeout(script):
    with pytest.raises(TimeoutError, match=r"script.py on 2 ranks did not finish within 8 s(.|\n)*rank 0/2"):
        run_script(script, ["hang"], nproc=2, timeout=8)


@pytest.mark.parametrize("kwargs, message", [
    (dict(nproc=0), "nproc must be a positive int, got 0"),
    (dict(nproc=2, timeout=0), "timeout must be positive seconds, got 0"),
    (dict(nproc=2, grace=-1), "grace must be positive seconds, got -1"),
])
def test_bad_arguments_are_refused(script, kwargs, message):
    with pytest.raises(ValueError, match=message):
        run_script(script, **kwargs)


def test_a_missing_script_is_refused(tmp_path):
    with pytest.raises(ValueError, match="is not a file"):
        run_script(tmp_path / "missing.py", nproc=1)
