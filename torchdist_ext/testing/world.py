"""Persistent worlds: a set of worker processes with torch.distributed initialised that run many tests, so that
starting processes and importing torch (seconds on a small machine) is paid once per world, not per test::

    with spawn_world(4) as world:
        results = world.run(my_test_fn, 3, scale=0.5)   # one result per rank

What happens when a rank raises, dies or hangs: ``World.run``.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

from torchdist_ext.testing.processes import detach_from_parent_fate

__all__ = ["World", "WorldError", "WorldTimeoutError", "spawn_world"]

# How long the other ranks may take to finish once one rank has raised; after
# that they are taken to be stuck in a collective that will never complete.
_GRACE_AFTER_ERROR = 5.0
_START_TIMEOUT = 300.0


class WorldError(Exception):
    """A world cannot run: a rank died, or the world was shut down."""


class WorldTimeoutError(WorldError, TimeoutError):
    """Not every rank answered within the world's timeout; the world was shut down."""


class RemoteTraceback(Exception):
    """The traceback of an exception raised on a rank, as text."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


def _worker_main(rank: int, world_size: int, init_file: str, timeout: float, threads: int, backend: str,
                 conn) -> None:
    """Worker loop: initialise the process group, then run (sys_path, fn, args, kwargs) requests until told to stop."""
    detach_from_parent_fate()
    faulthandler.enable(all_threads=True)  # a rank killed by a signal prints every thread's Python stack
    import torch
    import torch.distributed as dist

    from torchdist_ext.testing.inductor_isa import pin_inductor_cpu_isa

    pin_inductor_cpu_isa()
    torch.set_num_threads(threads)
    try:
        if "ledger_" in backend:  # a communication ledger: register its backends in this process
            from torchdist_ext import ledger

            ledger.backend(backend.replace("ledger_", ""))
        if torch.cuda.is_available() and "nccl" in backend:
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        conn.send(("ok", None))
    except BaseException:
        conn.send(("error", (None, traceback.format_exc())))
        return
    while True:
        try:
            request = conn.recv()
        except EOFError:
            break
        if request is None:
            break
        try:
            sys_path, fn, args, kwargs = pickle.loads(request)
            sys.path[:0] = [p for p in sys_path if p not in sys.path]
            reply = ("ok", fn(*args, **kwargs))
        except BaseException as error:  # report everything, including KeyboardInterrupt
            reply = ("error", (error, traceback.format_exc()))
        try:
            conn.send(reply)
        except Exception:  # the result or the exception did not pickle
            kind, payload = reply
            if kind == "ok":
                message = f"the result of type {type(payload).__name__} could not be pickled"
                conn.send(("error", (None, message + "\n" + traceback.format_exc())))
            else:
                conn.send(("error", (None, payload[1])))
    dist.destroy_process_group()


class World:
    """``world_size`` processes with torch.distributed initialised that run functions on every rank.

    Args:
        world_size: number of ranks (>= 1).
        timeout: seconds one ``run`` may take before the world is shut down;
            also the collective timeout inside the workers.
        threads_per_rank: ``torch.set_num_threads`` in every worker.
        backend: ``init_process_group`` backend; the default gloo runs on CPU.
            ``"cpu:gloo,cuda:nccl"`` also gives each rank a GPU (rank % device count);
            ``torchdist_ext.ledger.backend(...)`` counts every group's communication.

    Each rank runs in a process group of its own, which shutting the world down kills whole (the processes the
    rank started too); on Linux a rank also dies with the thread that started the world (the parent-death
    signal follows the creating thread). Ranks are spawned, not forked from the preloaded server of
    ``torchdist_ext.testing.processes``: a world's ranks live through many tests, and a rank forked from that
    server once aborted in glibc's free() (``munmap_chunk(): invalid pointer``) in a fresh-clone CI run.
    """

    def __init__(self, world_size: int, *, timeout: float = 120.0, threads_per_rank: int = 1,
                 backend: str = "gloo"):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
        self.world_size = world_size
        self.timeout = float(timeout)
        self._tmpdir = tempfile.TemporaryDirectory(prefix="tdx_world_")
        context = multiprocessing.get_context("spawn")
        self._conns = []
        self._procs = []
        init_file = os.path.join(self._tmpdir.name, "rendezvous")
        for rank in range(world_size):
            parent_end, child_end = context.Pipe(duplex=True)
            proc = context.Process(
                target=_worker_main,
                args=(rank, world_size, init_file, self.timeout, threads_per_rank, backend, child_end),
                name=f"tdx-world-rank{rank}",
                daemon=True,
            )
            proc.start()
            child_end.close()
            self._conns.append(parent_end)
            self._procs.append(proc)
        self._alive = True
        self._collect(max(self.timeout, _START_TIMEOUT), what="start-up")

    @property
    def alive(self) -> bool:
        """True while the world can run functions."""
        return self._alive

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Runs ``fn(*args, **kwargs)`` on every rank; returns the results in rank order.

        ``fn`` must be picklable by reference (a module-level function) and return a picklable value; it runs
        with ``torch.distributed`` initialised on every rank. Nothing hangs:

        - a rank that raises an ``Exception``: it is re-raised here, with the rank and that rank's traceback
          attached (as a note and as ``__cause__``). If every rank raised, the world stays usable; otherwise the
          ranks still running may be stuck in a collective and the world is shut down. A rank's ``SystemExit``
          or ``KeyboardInterrupt`` becomes a ``WorldError`` (it never ends the caller).
        - a rank that dies (crash, ``os._exit``, a signal): ``WorldError`` naming its exit code or signal; the
          world is shut down.
        - no reply from every rank within ``timeout`` seconds: ``WorldTimeoutError``; the world is shut down.

        A shut-down world raises ``WorldError`` here; check ``alive``.
        """
        if not self._alive:
            raise WorldError("this world was shut down after an earlier failure; spawn a new one")
        request = pickle.dumps((list(sys.path), fn, args, kwargs))
        for conn in self._conns:
            conn.send(request)
        return self._collect(self.timeout, what=getattr(fn, "__qualname__", repr(fn)))

    def _collect(self, timeout: float, what: str) -> list[Any]:
        deadline = time.monotonic() + timeout
        replies: dict[int, tuple[str, Any]] = {}
        waiting = {conn: rank for rank, conn in enumerate(self._conns)}
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            ready = multiprocessing.connection.wait([*waiting, *sentinels], timeout=remaining)
            for handle in ready:
                if handle in waiting:
                    rank = waiting.pop(handle)
                    try:
                        replies[rank] = handle.recv()
                    except EOFError:
                        replies[rank] = ("died", None)
                elif handle in sentinels:
                    rank = sentinels.pop(handle)
                    conn = self._conns[rank]
                    if conn in waiting and not conn.poll():
                        waiting.pop(conn)
                        replies[rank] = ("died", None)
            if any(kind != "ok" for kind, _ in replies.values()):
                deadline = min(deadline, time.monotonic() + _GRACE_AFTER_ERROR)
        return self._outcome(replies, timeout, what)

    def _outcome(self, replies: dict[int, tuple[str, Any]], timeout: float, what: str) -> list[Any]:
        died = sorted(rank for rank, (kind, _) in replies.items() if kind == "died")
        errors = sorted(rank for rank, (kind, _) in replies.items() if kind == "error")
        silent = sorted(set(range(self.world_size)) - set(replies))
        if died:
            causes = {rank: self._death_cause(rank) for rank in died}
            self._stop(polite=False)
            raise WorldError(f"{what}: rank(s) {died} of {self.world_size} died ({causes})")
        if errors:
            if silent or len(errors) < self.world_size:
                self._stop(polite=False)
            raise _rank_exception(errors[0], self.world_size, replies[errors[0]][1], what)
        if silent:
            self._stop(polite=False)
            raise WorldTimeoutError(
                f"{what}: rank(s) {silent} of {self.world_size} did not answer within {timeout:.0f} s; "
                "the world was shut down"
            )
        return [replies[rank][1] for rank in range(self.world_size)]

    def _death_cause(self, rank: int) -> str:
        """'exit code N' or 'killed by SIGNAL' of a dead rank (reaped first, so its status is known)."""
        proc = self._procs[rank]
        proc.join(timeout=5.0)
        code = proc.exitcode
        if code is None:
            return "no exit status"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:  # a signal without a name
                return f"killed by signal {-code}"
        return f"exit code {code}"

    def close(self) -> None:
        """Stops every worker (politely, then by force, with the processes it started); the world can no
        longer run."""
        self._stop(polite=True)

    def _stop(self, polite: bool) -> None:
        """``close``; not ``polite`` after a failure, when the ranks still running are stuck."""
        if not self._procs:
            return
        self._alive = False
        for conn in self._conns if polite else ():
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + (5.0 if polite else 0.0)
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            # The worker's process group: the worker and whatever it started, which outlives it (a pid
            # cannot be reused while a process group of that id has members).
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if proc.is_alive():  # not yet in a group of its own (still starting up)
                proc.kill()
            proc.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        self._tmpdir.cleanup()

    def __enter__(self) -> "World":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_procs", None):
            self.close()


def _rank_exception(rank: int, world_size: int, payload: tuple[Any, str], what: str) -> Exception:
    error, text = payload
    if isinstance(error, BaseException) and not isinstance(error, Exception):
        error = WorldError(f"{what}: rank {rank} raised {error!r} (SystemExit and KeyboardInterrupt on a rank "
                           f"end its call, not the caller):\n{text}")
    elif not isinstance(error, BaseException):
        error = WorldError(f"{what}: rank {rank} failed:\n{text}")
    if hasattr(error, "add_note"):  # Python >= 3.11
        error.add_note(f"(raised on rank {rank} of {world_size} while running {what})")
    error.__cause__ = RemoteTraceback(text)
    return error


def spawn_world(world_size: int, *, timeout: float = 120.0, threads_per_rank: int = 1,
                backend: str = "gloo") -> World:
    """Starts a persistent world of ``world_size`` ranks (gloo on CPU by default); use it as a context manager."""
    return World(world_size, timeout=timeout, threads_per_rank=threads_per_rank, backend=backend)
