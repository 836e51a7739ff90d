"""Keep freed memory in the process: the buffer's data passes through short-lived buffers of 64 KiB to
a few MiB (received messages, served batches), and fresh pages cost far more than the bytes in them."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2): blocks up to this come from the heap
MMAP_THRESHOLD = 32 * 1024**2
# free memory kept in the heap before it is given back to the OS
TRIM_THRESHOLD = 1024**3


def retain_freed_memory() -> bool:
    """Ask glibc to serve blocks up to 32 MiB from its heaps and not to give freed memory back to the OS
    below 1 GiB. By default it maps each block of 128 KiB or more (say a 512 KiB message) freshly and
    unmaps it on free, and returns the top of a heap once 128 KiB of it are free: the next message then
    pays a page fault per 4 KiB page it touches (on a VM several times the cost of copying the page),
    which was most of the buffer's per-byte cost. The price: memory the buffer held at its peak stays
    mapped. False where the C library is not glibc (nothing is changed)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not ok:
        log.info("mallopt refused the heap thresholds; freed memory goes back to the OS as usual")
    return ok
