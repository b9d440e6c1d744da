"""A decode step's float32 products as a loop numba compiles, the weight's output rows dealt
across the threads --threads gives: llama.cpp's way of using a second core, in NumPy's ecosystem.

A decode step at batch 1 is one-row products, bound by how fast the weights stream from memory.
OpenBLAS's one-row kernel (gemv) streamed SmolLM2's weights at 15-32 GB/s at 2 threads, and ran the
576 x 576 product on one thread; handing pieces of a product to Python threads cost more than it
saved (a thread wakes in tens of microseconds here). A loop compiled by numba, `prange` over blocks
of output rows, each row's dot product in vector registers, streamed the same weights at 48-71 GB/s
on 2 threads, and its threads wait for the next product spinning, not sleeping (docs/BENCH.md,
"NumPy's one-row products compiled by numba").

Numerics: each output is one weight row's dot product with the input, summed in the loop's vector
lanes (LLVM may reassociate the sum and fuse multiply-adds: `fastmath={"reassoc", "contract"}`,
with no assumption that values are finite, so an overflow still reaches the logits as inf or nan).
- float32 logits move from OpenBLAS's by rounding, ~1e-6 of their size; the tokens keep agreeing
  with the reference's as compare checks them.
- Every thread count gives the same bits: a row is never split between threads.
- float64 keeps OpenBLAS's products, so the ports' float64 agreement stays bit for bit.

Where: a float32 input of up to LOOP_ROWS rows (a decode step, a small batch's) against a float32
weight. The loop reads each weight row contiguously, so while it is installed layout.py keeps every
float32 matrix in its (out, in) order. Up to FEW_ROWS rows (a short prompt) then run as OpenBLAS's
weight @ x.T, the order it is fast in for weights laid out so; longer prompts and float64 run the
lesson's product.

numba is optional (`pip install 'kvports[fast]'`; `kvports[all]` has it): without it, or with a
numba that does not import beside this NumPy, nothing is installed and OpenBLAS runs every product.
`kvports.threads.use_threads` installs it at any count --threads gives; without --threads NumPy
runs the lesson's products.
"""

from __future__ import annotations

import math
import os
import platform
import sys
import threading
from collections.abc import Callable

import numpy as np

from kvports.numpy_impl import functional
from kvports.shared import cpu

INSTALLED: list[RowProducts] = []  # the installed kernel, if any (one per process: the thread count is the process's)
KERNELS: list[Callable[..., None]] = []  # the compiled loop, once a process has compiled or loaded it
# Rows of input a product runs in the loop: each weight row, once read, meets every input row while it
# is in cache. Each product alone, at 1 and 2 threads, the loop took 0.3-1.2x OpenBLAS's time up to 5
# rows and 0.9-1.3x at 8. In a run it did better than that: a 5-token prompt's first token took 47-49 ms
# at 1 thread and 35 ms at 2 with 8 rows here, 77-81 and 56-62 with 4 (75-88 and 47-53 on OpenBLAS
# alone, numba hidden; docs/BENCH.md). Presumably OpenBLAS's threads, run right after a decode step,
# wait on the loop's threads, still spinning: one pool for a short prompt avoids that.
LOOP_ROWS = 8
# Up to this many rows against a weight laid out by rows run as OpenBLAS's weight @ x.T, measured faster
# than the lesson's x @ weight.T there; a longer prompt's products took the same either way, and the
# transposed result's copy would cost more than the order saves.
FEW_ROWS = 64
NUMBA_CPU_VARIABLE = "NUMBA_CPU_NAME"  # the CPU numba compiles for (unset: this one)
NUMBA_FEATURES_VARIABLE = "NUMBA_CPU_FEATURES"  # instructions added to that CPU's (unset: this CPU's own)
AVX2_CPU = "haswell"  # LLVM's name for the first x86-64 CPU with AVX2 and FMA, and no AVX-512
X86 = ("x86_64", "amd64")  # platform.machine(), lowered, where that name means anything


def compiled_loop() -> Callable[..., None] | None:
    """The loop, compiled on first use (or loaded from numba's cache beside this file); None without numba."""
    if KERNELS:
        return KERNELS[0]
    if cpu.forced() == "avx2" and platform.machine().lower() in X86 and "numba" not in sys.modules:
        # numba compiles for this CPU's own instructions; an AVX2-only CPU's loop (KVPORTS_CPU, shared/cpu.py)
        # is compiled for Haswell's alone, read when numba is imported (its cache keeps each target apart).
        # Without the empty feature list, numba adds this CPU's own features (AVX-512) to the name's.
        os.environ.setdefault(NUMBA_CPU_VARIABLE, AVX2_CPU)
        os.environ.setdefault(NUMBA_FEATURES_VARIABLE, "")
    try:
        import numba
    except Exception:  # not installed, or built against another NumPy: OpenBLAS runs the products
        return None

    # weight [out, in] C-contiguous, x [R, in], y [R, out]; rows_each: ceil(out / blocks)
    @numba.njit(
        "void(float32[:, ::1], float32[:, ::1], float32[:, ::1], int64)",
        parallel=True,
        fastmath={"reassoc", "contract"},
        cache=True,
        nogil=True,
    )
    def row_products(weight: np.ndarray, x: np.ndarray, y: np.ndarray, blocks: int) -> None:
        rows, width = weight.shape
        rows_each = -(-rows // blocks)
        for block in numba.prange(blocks):
            for row in range(block * rows_each, min(rows, (block + 1) * rows_each)):
                for r in range(x.shape[0]):  # every input row against this weight row, read once from memory
                    total = np.float32(0.0)
                    for k in range(width):
                        total += weight[row, k] * x[r, k]
                    y[r, row] = total

    KERNELS.append(row_products)
    return row_products


class RowProducts:
    """functional.linear with a float32 product of up to LOOP_ROWS rows run by the loop on `threads` threads."""

    def __init__(self, threads: int, loop: Callable[..., None], plain: Callable[..., np.ndarray]):
        import numba

        self.threads = threads
        self.loop = loop
        self.plain = plain  # the linear in place before: the lesson's
        self.numba_threads = min(threads, numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]  # its pool never grows
        self.set_threads = numba.set_num_threads
        self.get_threads = numba.get_num_threads
        # One call at a time: numba's fallback threading layer (workqueue, where neither OpenMP nor TBB
        # loads) aborts the process when two threads launch parallel loops at once.
        self.lock = threading.Lock()

    def linear(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        count = math.prod(x.shape[:-1])  # R: the rows of input
        if x.dtype != np.float32 or weight.dtype != np.float32 or not weight.flags.c_contiguous or count > FEW_ROWS:
            return self.plain(x, weight, bias)
        rows = x.reshape(count, x.shape[-1])  # [R, in]
        y = self.in_loop(rows, weight) if count <= LOOP_ROWS else self.weight_first(rows, weight)  # [R, out]
        if bias is not None:
            y += bias
        return y.reshape(*x.shape[:-1], weight.shape[0])  # [..., out]

    def in_loop(self, rows: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """rows [R, in] against weight [out, in] by the compiled loop -> [R, out]."""
        y = np.empty((rows.shape[0], weight.shape[0]), dtype=np.float32)  # [R, out]
        with self.lock:
            if self.get_threads() != self.numba_threads:  # numba's count is each calling thread's own
                self.set_threads(self.numba_threads)
            self.loop(weight, np.ascontiguousarray(rows), y, self.threads)
        return y

    def weight_first(self, rows: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """A short prompt's rows [R, in] against a weight laid out by rows, as OpenBLAS's product with
        the weight on the left, weight [out, in] @ rows.T [in, R] -> [R, out]. The lesson's
        x @ weight.T over these rows took up to 1.3x as long at 2-16 rows on SmolLM2's shapes
        (OpenBLAS's kernel for a transposed right operand at few rows; docs/BENCH.md)."""
        return np.ascontiguousarray((weight @ rows.T).T)  # [R, out]: the copy is R x out, small at R <= FEW_ROWS


def install_row_products(threads: int | None) -> RowProducts | None:
    """The compiled loop as every NumPy model's float32 product of up to FEW_ROWS rows, across `threads`
    blocks of rows (None, or no numba: the product in place before, and None)."""
    from kvports.numpy_impl.fast.cores import PLAIN_LINEAR

    INSTALLED.clear()
    if functional.linear is not PLAIN_LINEAR and not isinstance(
        getattr(functional.linear, "__self__", None), RowProducts
    ):
        return None  # another split (cores.split_products, a tool's or a test's) owns the products: left to it
    loop = compiled_loop() if threads is not None else None
    if threads is None or loop is None:
        functional.linear = PLAIN_LINEAR
        return None
    INSTALLED.append(RowProducts(threads, loop, PLAIN_LINEAR))
    functional.linear = INSTALLED[0].linear
    return INSTALLED[0]


def row_threads() -> int:
    """The blocks of rows a float32 decode step's product is dealt into (0: OpenBLAS runs it)."""
    return INSTALLED[0].threads if INSTALLED and functional.linear == INSTALLED[0].linear else 0


def use_numpy_threads(threads: int | None) -> None:
    """Everything --threads changes in the NumPy port, for every model in this process: a prompt's
    attention by causal blocks (cores.split_attention) and a float32 decode step's products as this
    loop; None: the lesson's attention and OpenBLAS's products."""
    from kvports.numpy_impl.fast.cores import split_attention

    split_attention(threads)
    install_row_products(threads)
