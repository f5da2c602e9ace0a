"""Rank processes that start in milliseconds: forks of one server that has imported torch.

Importing torch and torchdist_ext takes seconds of CPU per process; a test that starts four ranks pays it four
times, on a two-core machine more than the test itself. ``preloaded_context()`` is a ``multiprocessing``
context whose processes are forks of a server that imported them once (``forkserver``, preloaded), and
``run_script`` runs a script on N such ranks as ``torchrun --standalone`` would::

    result = run_script("examples/train_llama.py", ["--steps", "3"], nproc=4, timeout=600)
    assert result.returncode == 0, result.output

A process forked from the server sees the environment it is given, but what a module read from the
environment when it was imported keeps the server's value: libgomp's ``OMP_NUM_THREADS`` (set the threads
with ``torch.set_num_threads``, as the examples do).
"""

from __future__ import annotations

import ctypes
import functools
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import runpy
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ScriptResult", "preloaded_context", "run_script"]

# What the server imports: torch, FSDP2 and DTensor (a second of their own), and this package.
_PRELOAD = ["torch", "torch.distributed.fsdp", "torchdist_ext"]
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


@functools.cache
def preloaded_context() -> multiprocessing.context.BaseContext:
    """The ``forkserver`` context whose server has imported torch and torchdist_ext (``spawn`` where there
    is no fork server). The server starts with the first process and inherits this process's environment at
    that moment; it ends when this process does."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def detach_from_parent_fate() -> None:
    """Makes the calling process the leader of its own process group (so that ending it can kill everything
    it started) and, on Linux, makes it die when its parent dies (for a fork server's process, the server,
    which ends with the process that started it).

    The fork server ends when the last holder of its "alive" pipe's write end does; multiprocessing hands
    that end to every process it forks, so the ranks would keep the server, and the server the ranks, alive
    after their starter died. A rank closes its copy (it starts no forkserver processes of its own)."""
    os.setpgid(0, 0)
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    alive_fd = getattr(server, "_forkserver_alive_fd", None)
    if alive_fd is not None and multiprocessing.parent_process() is not None:
        os.close(alive_fd)
        server._forkserver_alive_fd = None
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass(frozen=True)
class ScriptResult:
    """A ``run_script`` run: ``returncode`` 0 when every rank exited 0, else the exit code of the first rank
    to fail (minus the signal's number for a signal); ``output`` every rank's stdout and stderr, rank 0's
    first, each other rank's under a ``[rank N]`` line where it wrote anything."""

    returncode: int
    output: str


def run_script(script: str | os.PathLike, argv: Sequence[str] = (), *, nproc: int, timeout: float = 600.0,
               grace: float = 30.0, env: Mapping[str, str] | None = None) -> ScriptResult:
    """Runs ``script`` as ``__main__`` with ``sys.argv[1:] = argv`` on ``nproc`` local ranks, with the
    environment ``torchrun --standalone --nproc-per-node nproc`` gives (RANK, LOCAL_RANK, WORLD_SIZE,
    LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), over this process's environment updated with ``env``. Each
    rank runs in the working directory with the script's folder first on ``sys.path``.

    When a rank fails, the others get ``grace`` seconds to end (a rank blocked in a collective with the failed
    one never does), then are killed; past ``timeout`` seconds every rank is killed and ``TimeoutError``
    raised, with the output so far."""
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive int, got {nproc!r}")
    for name, seconds in (("timeout", timeout), ("grace", grace)):
        if not (isinstance(seconds, (int, float)) and seconds > 0):
            raise ValueError(f"{name} must be positive seconds, got {seconds!r}")
    script = Path(script).resolve()
    if not script.is_file():
        raise ValueError(f"script {str(script)!r} is not a file")
    base = {**os.environ, **(env or {}), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
            "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "NODE_RANK": "0"}
    context = preloaded_context()
    with tempfile.TemporaryDirectory(prefix="tdx_run_") as folder:
        logs = [os.path.join(folder, f"rank{rank}.log") for rank in range(nproc)]
        procs = []
        for rank in range(nproc):
            rank_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            proc = context.Process(target=_run_rank, args=(str(script), list(argv), rank_env, logs[rank]),
                                   name=f"tdx-rank{rank}", daemon=True)
            proc.start()
            procs.append(proc)
        returncode = _wait(procs, timeout, grace)
        for proc in procs:
            _kill_group(proc)
        output = _collect_output(logs)
    if returncode is None:
        raise TimeoutError(f"{script.name} on {nproc} ranks did not finish within {timeout:g} s; every rank "
                           f"was killed. Output:\n{output}")
    return ScriptResult(returncode, output)


def _run_rank(script: str, argv: list[str], env: dict[str, str], log: str) -> None:
    """One rank: the environment, stdout and stderr to ``log``, then ``script`` as ``__main__``."""
    detach_from_parent_fate()
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(script))
    status = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as error:  # as the interpreter reads it: None is 0, a number the status, else printed
        if isinstance(error.code, int) or error.code is None:
            status = error.code or 0
        else:
            print(error.code, file=sys.stderr)
            status = 1
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _wait(procs: list, timeout: float, grace: float) -> int | None:
    """Waits for every process, for ``timeout`` seconds (once one fails, ``grace`` more if less); returns the
    exit code of the first to fail, 0 when every one exited 0, None when time ran out with none failed."""
    deadline = time.monotonic() + timeout
    running = {proc.sentinel: proc for proc in procs}
    failure = None
    while running:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return failure
        for sentinel in multiprocessing.connection.wait(list(running), timeout=remaining):
            proc = running.pop(sentinel)
            proc.join()
            if proc.exitcode != 0 and failure is None:
                failure = proc.exitcode
                deadline = min(deadline, time.monotonic() + grace)
    return failure or 0


def _kill_group(proc) -> None:
    """Kills what is left of a rank's process group (the rank, if running, and what it started)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.is_alive():  # not yet in a group of its own (still starting)
        proc.kill()
    proc.join()


def _collect_output(logs: list[str]) -> str:
    parts = []
    for rank, log in enumerate(logs):
        text = Path(log).read_text(errors="replace") if os.path.exists(log) else ""
        if rank == 0:
            parts.append(text)
        elif text:
            parts.append(f"[rank {rank}]\n{text}")
    return "".join(parts)


def _free_port() -> int:
    """A TCP port free on this machine now, for rank 0's store (as ``torchrun --standalone`` picks one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
