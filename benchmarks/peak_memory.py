"""Peak memory of a block of code, shared by the benchmarks.

    with PeakMemory("cpu") as memory:
        run()
    memory.peak_mb   # MiB above the value at entry

On CUDA: the caching allocator's peak of allocated bytes (exact). On CPU: this
process's resident memory sampled every 0.5 ms from /proc/self/statm; on entry
the C allocator returns its free memory to the system (glibc ``malloc_trim``),
so that memory freed by earlier cases is not silently reused below the baseline.
"""

import ctypes
import os
import threading
import time

import torch

__all__ = ["PeakMemory"]

PAGE = os.sysconf("SC_PAGE_SIZE")


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakMemory:
    def __init__(self, device: str = "cpu"):
        self.device = device

    def __enter__(self):
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.baseline = torch.cuda.memory_allocated()
            return self
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        self.baseline = self.peak = _resident_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.device == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
            return
        self._stop.set()
        self._thread.join()

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _resident_bytes())
            time.sleep(0.0005)

    @property
    def peak_mb(self) -> float:
        return (self.peak - self.baseline) / 2**20
