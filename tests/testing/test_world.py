"""The persistent test world: results, error propagation, deaths and timeouts."""

import os
import signal
import subprocess
import sys
import textwrap
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


def kill_rank_one_by_signal():
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return "alive"


def exit_on_every_rank():
    sys.exit(3)


def start_a_child_process():
    """Starts a long sleep on each rank and returns its pid (a process the rank leaves running)."""
    return subprocess.Popen(["sleep", "600"]).pid


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, already dead but not reaped by its parent, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_until_gone(pids, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.1)
    return [pid for pid in pids if alive(pid)]


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
        with pytest.raises(WorldError, match=r"rank\(s\) \[0\] of 2 died \(\{0: 'exit code 3'\}\)"):
            world.run(exit_rank_zero)
        assert not world.alive


def test_a_rank_killed_by_a_signal_is_reported_with_the_signal():
    with spawn_world(2) as world:
        with pytest.raises(WorldError, match=r"rank\(s\) \[1\] of 2 died \(\{1: 'killed by SIGKILL'\}\)"):
            world.run(kill_rank_one_by_signal)


def test_system_exit_on_a_rank_does_not_end_the_caller(world2):
    with pytest.raises(WorldError, match=r"rank 0 raised SystemExit\(3\)"):
        world2.run(exit_on_every_rank)
    assert world2.alive


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_closing_a_world_ends_the_processes_its_ranks_started():
    with spawn_world(2) as world:
        children = world.run(start_a_child_process)
        assert all(alive(pid) for pid in children)
    assert wait_until_gone(children, 10.0) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_busy_ranks_die_with_a_killed_parent(tmp_path):
    """A program starts a world whose ranks are busy, prints their pids and is SIGKILLed: no rank survives."""
    program = tmp_path / "parent.py"
    program.write_text(textwrap.dedent("""
        import os, sys, threading, time
        sys.path.insert(0, sys.argv[1])
        from torchdist_ext.testing import spawn_world
        from tests.testing.test_world import sleep_forever

        if __name__ == "__main__":
            world = spawn_world(2, timeout=600.0)
            print(*world.run(os.getpid), flush=True)
            threading.Thread(target=world.run, args=(sleep_forever,), daemon=True).start()
            time.sleep(600)
    """))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parent = subprocess.Popen([sys.executable, str(program), root], stdout=subprocess.PIPE, text=True)
    try:
        ranks = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(ranks) == 2 and all(alive(pid) for pid in ranks)
    finally:
        parent.kill()
        parent.wait()
    assert wait_until_gone(ranks, 10.0) == []


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
