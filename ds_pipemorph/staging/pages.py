"""``release_pages``: give a consumed staging slot's pages back to the system (host rings on Linux).

A ring's shared memory is resident as far as messages reached and stays so until the ring is
unlinked: a ring that once carried a 32 MiB message keeps 32 MiB resident in both processes that
touched it, for good. The consumer of a slot, once it has taken the bytes out and before it hands the
slot back to the producer, punches the slot's pages out of the segment (``madvise(MADV_REMOVE)``):
every mapping of them goes, in both processes, and the producer's next write there gets fresh zeroed
pages. A ring then holds only the messages in it. Not for a pinned ring (a GPU's DMA target): its
pages must stay where they were registered.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys

_MADV_REMOVE = 9  # linux/mman.h
_PAGE = mmap.PAGESIZE
_libc = None  # None: not loaded yet; False: cannot be (the pages then stay resident)


def _madvise():
    global _libc
    if _libc is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            libc.madvise.restype = ctypes.c_int
            _libc = libc
        except (OSError, AttributeError):
            _libc = False
    return _libc.madvise if _libc else None


def release_pages(address: int, nbytes: int) -> bool:
    """Punch the whole pages of [address, address + nbytes) out of their shared-memory segment; False
    where that is not possible (not Linux, an older kernel, no C library to call): the pages then stay
    resident."""
    start = -(-address // _PAGE) * _PAGE
    end = (address + nbytes) // _PAGE * _PAGE
    if end <= start or not sys.platform.startswith("linux"):
        return False
    madvise = _madvise()
    return madvise is not None and madvise(start, end - start, _MADV_REMOVE) == 0
