"""glibc's heap, asked to give freed memory back to the system (elsewhere every function here is a no-op).

A conversion frees every layer's tensors as the loop moves on. glibc raises its mmap threshold as large blocks are
freed and then serves later tensors from the heap, whose freed holes stay in the process's resident set: memory no
tensor uses. :func:`return_freed_memory` fixes the threshold for the whole process (the CLI calls it once);
:func:`trim_heap` gives the heap's free pages back now (the low-memory stream calls it after each layer).
Values are never affected.
"""

from __future__ import annotations

import ctypes
import os

M_MMAP_THRESHOLD = -3  # mallopt parameter (glibc malloc.h)


def _libc():
    """The C library when it is glibc, else None."""
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def return_freed_memory() -> None:
    """Serve allocations of 1 MiB and more with mmap, so that freed tensors go back to the system; fixing the
    threshold also stops glibc's dynamic adjustment. A MALLOC_MMAP_THRESHOLD_ set by the user wins."""
    libc = _libc()
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or libc is None:
        return
    try:
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)
    except AttributeError:  # a libc.so.6 without mallopt
        pass


def trim_heap() -> None:
    """Give the heap's free pages back to the system (glibc malloc_trim)."""
    libc = _libc()
    try:
        if libc is not None:
            libc.malloc_trim(0)
    except AttributeError:  # a libc.so.6 without malloc_trim
        pass


__all__ = ["return_freed_memory", "trim_heap"]
