"""A step's large products split across the threads the process is given, set from outside the model.

A decode step is one-row products, and OpenBLAS runs a one-row product (gemv) on one thread or
splits it so finely that its threads wait for each other (docs/BENCH.md's profiles): given a
second core, NumPy's decode barely moved. llama.cpp splits each product's OUTPUT rows across its
threads; so does this. NumPy's matmul releases the GIL, so a thread pool runs the pieces at once,
each through OpenBLAS at one thread (`kvports.threads.use_threads` sets OpenBLAS to 1 while this
splits): the pieces are the parallelism, and two levels of threads would wait for each other.

Splitting the output rows keeps each output's dot product whole, summed in the order the unsplit
product sums it, so the tokens do not move (float64 bit-equal across ports). Splitting the
reduction axis would sum in another order; this never does. OpenBLAS's kernels still treat some
rows apart, by where they fall in the product, so a piece is cut only where its rows are summed as
in the whole (tests/test_split_products.py holds it, at float32 and float64; found by measurement on
OpenBLAS 0.3.31, Haswell kernels): float32's one-row kernel (gemv, the [in, out] layout) sums the
rows of each 4096-row block by the block's length, so a product of at most 4096 rows is split only
where its rows are a multiple of 64 and at multiples of 64, a longer one at multiples of 4096 (its
blocks); a many-row product (gemm) whose pieces would fall under OpenBLAS's small-matrix size
(M N K <= 100^3) takes another kernel there, so it is split only above that size.

A prompt's attention is split too, by key/value heads (`RowSplit.attention`): each head group's
scores, softmax and weighted sum are independent of the others' and its ufuncs release the GIL,
so the pool runs the groups at once, each computed exactly as unsplit (the same per-head products,
the same shapes). A decode step's attention (one query row) is too small to pay for a handoff.

The split is installed as `functional.linear` and `functional.scaled_dot_product_attention`, the
calls every Linear, the tied head and every block make, so the model and nn.py stay the lesson;
with one thread nothing is installed and no pool exists.

Not on by default (`kvports.threads.use_threads` leaves the threads to OpenBLAS): measured on an idle
2-core machine (SmolLM2 float32, 2 threads, median of 3 interleaved; docs/BENCH.md, "Every thread a
decode step is given"), the split decoded at 34.7 ms a token and prefilled 512 tokens at 531 tokens/s, OpenBLAS's
own 2 threads at 22.8 ms and 578 tokens/s (1 thread: 31.6 ms, 330 tokens/s): a handoff to a pool
thread and back at each of a step's ~150 products costs more than OpenBLAS's threads lose. The split
won only on a machine oversubscribed several times over, where OpenBLAS's threads spin for busy cores.
`split_products(n)` turns it on (tools/profile_cores.py and tests/test_split_products.py do).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvports.numpy_impl import functional

MIN_SPLIT_BYTES = 1 << 21  # smaller weights: a handoff (~10-20 us) costs more than half the product saves
ROW_ALIGN = 64  # pieces of a product of at most BLOCK_ROWS rows: multiples of 64, in a multiple of 64
BLOCK_ROWS = 4096  # OpenBLAS's one-row block: a longer product is cut at multiples of it
SMALL_GEMM = 100**3  # OpenBLAS's small-matrix kernel takes a many-row product of at most M N K this
MIN_SPLIT_QUERIES = 16  # fewer query rows (a decode step's one): attention runs unsplit
PLAIN_LINEAR = functional.linear  # the lesson's own, put back when the count returns to 1
PLAIN_ATTENTION = functional.scaled_dot_product_attention


def piece_bounds(rows: int, threads: int) -> list[tuple[int, int]]:
    """[start, stop) of each thread's output rows, near-equal, cut where the pieces sum as the
    whole does (above); one piece, [0, rows), where no such cut exists."""
    align = ROW_ALIGN if rows <= BLOCK_ROWS else BLOCK_ROWS
    if rows <= BLOCK_ROWS and rows % ROW_ALIGN:
        return [(0, rows)]
    step = -(-rows // threads // align) * align  # ceil(rows / threads), rounded up to the alignment
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


class RowSplit:
    """functional.linear with its output rows split across `threads` threads: the caller's thread
    runs the first piece, a pool of threads - 1 runs the rest."""

    def __init__(self, threads: int):
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="kvports-numpy")

    def linear(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        rows = weight.shape[0]
        x2 = x.reshape(-1, x.shape[-1])  # [N, in]
        bounds = piece_bounds(rows, self.threads)
        smallest = min(stop - start for start, stop in bounds) * x2.shape[0] * x2.shape[1]
        if weight.nbytes < MIN_SPLIT_BYTES or len(bounds) == 1 or (x2.shape[0] > 1 and smallest <= SMALL_GEMM):
            return PLAIN_LINEAR(x, weight, bias)
        y = np.empty((x2.shape[0], rows), dtype=np.result_type(x2, weight))  # [N, out]
        (first, *rest) = bounds
        # Each piece writes its own columns of y: [N, in] @ [in, stop - start], no copy of the weight.
        pending = [self.pool.submit(np.matmul, x2, weight[a:b].T, out=y[:, a:b]) for a, b in rest]
        np.matmul(x2, weight[first[0] : first[1]].T, out=y[:, first[0] : first[1]])
        for piece in pending:
            piece.result()
        if bias is not None:
            y += bias
        return y.reshape(*x.shape[:-1], rows)  # [..., out]

    def attention(
        self,
        query: np.ndarray,
        key: np.ndarray,
        value: np.ndarray,
        attn_mask: np.ndarray | None = None,
        enable_gqa: bool = False,
        scale: float | None = None,
    ) -> np.ndarray:
        """functional.scaled_dot_product_attention with its key/value heads split across the threads:
        query [B, H, T, Dh] over key and value [B, Hkv, S, Dh] -> [B, H, T, Dh]."""
        B, H, T, Dh = query.shape
        Hkv = key.shape[1]
        if T < MIN_SPLIT_QUERIES or Hkv < 2 or H % Hkv:
            return PLAIN_ATTENTION(query, key, value, attn_mask, enable_gqa, scale)
        G = H // Hkv  # query heads per key/value head: a group's rows stay together
        step = -(-Hkv // self.threads)  # key/value heads a piece
        groups = [(start, min(start + step, Hkv)) for start in range(0, Hkv, step)]
        out = np.empty(query.shape, dtype=query.dtype)  # [B, H, T, Dh]

        def group(a: int, b: int) -> None:
            out[:, a * G : b * G] = PLAIN_ATTENTION(
                query[:, a * G : b * G], key[:, a:b], value[:, a:b], attn_mask, enable_gqa, scale
            )

        (first, *rest) = groups
        pending = [self.pool.submit(group, a, b) for a, b in rest]
        group(*first)
        for piece in pending:
            piece.result()
        return out  # [B, H, T, Dh]

    def close(self) -> None:
        self.pool.shutdown(wait=True)


SPLIT: list[RowSplit] = []  # the installed split, if any (one per process: the thread count is the process's)


def split_products(threads: int | None) -> None:
    """Every large product of every NumPy model in this process split across `threads` threads
    (1 or None: the lesson's own functional.linear, no pool)."""
    for old in SPLIT:
        old.close()
    SPLIT.clear()
    functional.linear = PLAIN_LINEAR
    functional.scaled_dot_product_attention = PLAIN_ATTENTION
    if threads is not None and threads > 1:
        SPLIT.append(RowSplit(threads))
        functional.linear = SPLIT[0].linear
        functional.scaled_dot_product_attention = SPLIT[0].attention


def split_threads() -> int:
    """The threads the products are split across (1: unsplit)."""
    return SPLIT[0].threads if SPLIT else 1
