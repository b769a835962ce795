"""This process's memory: its peak resident size while a run works (`PeakRSS`), and handing freed heap back
to the system (glibc's ``malloc_trim`` / ``mallopt``; elsewhere these do nothing). Used by the streaming
compression (`hf_tensorcomp.streaming`) and the GGUF conversion (`hf_tensorcomp.convert`)."""

from __future__ import annotations

import os
import resource
import threading


class PeakRSS:
    """Peak resident memory of this process above its value at the start, sampled every 2 ms from
    ``/proc/self/statm`` (elsewhere: the process's lifetime maximum, an upper bound)."""

    def __enter__(self) -> "PeakRSS":
        self.start = self.peak = rss()
        self.before_mark = None  # the peak up to `mark`, once marked
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())

    def mark(self) -> None:
        """Track the peak from here on separately: the peak so far is kept in ``before_mark``."""
        self.before_mark, self.peak = self.peak, rss()

    @property
    def above_start(self) -> int:
        """The peak since the start (or since `mark`, when marked) above the start."""
        return self.peak - self.start


def rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _libc():
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
            _LIBC.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        except (OSError, AttributeError):
            _LIBC = False
    return _LIBC


def return_large_frees() -> None:
    """Serve allocations of 1 MB and more by their own mappings, handed back to the system when freed (glibc
    ``mallopt(M_MMAP_THRESHOLD)``, for the rest of the process). glibc's default raises that threshold with
    every large free, after which freed layers and decomposition workspaces stay in its heap: the resident
    memory of a streaming run then grows by tens of MB per layer although nothing is held."""
    libc = _libc()
    if libc:
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD


def trim() -> None:
    """Hand freed heap memory back to the system (glibc ``malloc_trim``)."""
    libc = _libc()
    if libc:
        libc.malloc_trim(0)


_LIBC = None
