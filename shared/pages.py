"""A model's weights copied into one anonymous mapping backed by 2 MB pages, where the kernel grants them.

A decode step streams every weight from memory once. With 4 KB pages the CPU walks a page table for
every 4 KB it reads, and its prefetcher stops at each page's end; llama.cpp's weights, mapped from the
GGUF file, sat in 2 MB pages here. A weight allocated alone can hold a 2 MB page only where it spans
an aligned 2 MB of its own (SmolLM2's 2.2 and 3.5 MB matrices mostly do not), so the weights go into
one mapping, aligned to 2 MB, that `madvise(MADV_HUGEPAGE)` asks the kernel to back with huge pages
as it is first written. On SmolLM2 (JAX's row loop, docs/BENCH.md) a float32 decode step took 13% less
time at 1 thread and 4-6% less at 2. Where the kernel has no transparent huge pages (another OS, or
THP off), the same copies sit in ordinary pages: nothing else changes.

Each copy starts on a 4 KB boundary, so a framework that can wrap host memory without copying it (JAX's
device_put on the CPU wraps memory aligned to 64 bytes) keeps it where it is.
"""

from __future__ import annotations

import mmap

import numpy as np

HUGE_PAGE = 2 << 20  # x86-64's and most arm64 kernels' transparent huge page
ALIGN = 4096  # each copy's start: a page, more than any framework asks of host memory it wraps


def aligned(size: int, boundary: int) -> int:
    return (size + boundary - 1) // boundary * boundary


def in_huge_pages(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each array copied (C order, its dtype) into one private anonymous mapping asked for 2 MB pages,
    by name; the mapping lives as long as any of the copies."""
    size = sum(aligned(array.nbytes, ALIGN) for array in arrays.values())
    if size == 0:
        return {name: np.ascontiguousarray(array) for name, array in arrays.items()}
    mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux; before any byte is written, so each page faults in huge
        mapping.madvise(mmap.MADV_HUGEPAGE)
    memory = np.frombuffer(mapping, dtype=np.uint8)  # [size + HUGE_PAGE] bytes: holds the mapping open
    start = -memory.ctypes.data % HUGE_PAGE  # the first 2 MB boundary inside the mapping
    copies = {}
    for name, array in arrays.items():
        copy = memory[start : start + array.nbytes].view(array.dtype).reshape(array.shape)
        copy[...] = array
        copies[name] = copy
        start += aligned(array.nbytes, ALIGN)
    return copies
