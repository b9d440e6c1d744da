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

A prompt's attention is replaced too (`PromptAttention`, float32): its causal query blocks of 64
are computed alone, each over the keys before its last query's end, so the masked upper triangle's
scores, softmax and weighted sum are never computed, and the blocks are dealt across the threads
(NumPy's matmul and ufuncs release the GIL), OpenBLAS at one thread inside while they run. A
block's products are OpenBLAS's at the block's shapes, whose edge kernels and shorter weighted sum
round in other places than the whole product: float32 logits move by ~1e-6 of their size, the
tokens do not; float64 keeps the lesson's attention, bit for bit. An exact version (the lesson's two
products, only the softmax skipped) saved nothing: the skipped half's rows are strided, and a
ufunc's call per row cost what it saved. A decode step's attention (one query row) runs as the lesson's.

The splits are installed as `functional.linear` and `functional.scaled_dot_product_attention`, the
calls every Linear, the tied head and every block make, so the model and nn.py stay the lesson;
with one thread no product is split and no pool exists.

The product split is not on by default (`kvports.threads.use_threads` leaves the products to
OpenBLAS): measured on an idle 2-core machine (SmolLM2 float32, 2 threads, median of 3 interleaved;
docs/BENCH.md, "Every thread a decode step is given"), it decoded at 34.7 ms a token and prefilled
512 tokens at 531 tokens/s, OpenBLAS's own 2 threads at 22.8 ms and 578 tokens/s (1 thread: 31.6 ms,
330 tokens/s): a handoff to a pool thread and back at each of a step's ~150 products costs more than
OpenBLAS's threads lose. It won only on a machine oversubscribed several times over, where OpenBLAS's
threads spin for busy cores. `split_products(n)` turns it on (tools/profile_cores.py and
tests/test_split_products.py do). The prompt attention is on at any count `--threads` gives, one
included (`kvports.threads.use_threads` calls `split_attention`): one handoff a layer at 2 threads,
and at every count the attention's work cut by a third (docs/BENCH.md, "NumPy's prompt attention by
causal blocks"; a 512-token SmolLM2 prefill went from 313 to 516 tokens/s at 2 threads, and from 313
to 341 at 1). Without --threads NumPy runs the lesson's attention.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from threadpoolctl import ThreadpoolController

from kvports.numpy_impl import functional

MIN_SPLIT_BYTES = 1 << 21  # smaller weights: a handoff (~10-20 us) costs more than half the product saves
ROW_ALIGN = 64  # pieces of a product of at most BLOCK_ROWS rows: multiples of 64, in a multiple of 64
BLOCK_ROWS = 4096  # OpenBLAS's one-row block: a longer product is cut at multiples of it
SMALL_GEMM = 100**3  # OpenBLAS's small-matrix kernel takes a many-row product of at most M N K this
MIN_SPLIT_QUERIES = 16  # fewer query rows (a decode step's one): attention runs as the lesson's
QUERY_BLOCK = 64  # a prompt's queries a softmax block: its keys end at its last query's
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

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class PromptAttention:
    """functional.scaled_dot_product_attention for a float32 prompt's many queries: each causal query
    block [a, z) of each key/value head is computed alone over the keys before its last query's end, so
    the masked upper triangle's scores, softmax and weighted sum are never computed (about 45% of a
    512-token prompt's attention). The blocks are dealt across `threads` threads (the caller's and a
    pool of threads - 1), OpenBLAS at one thread inside each (its own threads would wait for ours).

    float32 only: a block's products sum as OpenBLAS's kernels sum a product of the block's shape,
    which differs from the whole product's in the last bits (its edge kernels, and the weighted sum's
    shorter reduction), so float32 logits move by ~1e-6 (within the ports' float32 tolerance). float64
    runs the lesson's own attention, bit for bit."""

    def __init__(self, threads: int):
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="kvports-numpy") if threads > 1 else None
        self.lock = threading.Lock()
        # NumPy's BLAS, its count set directly: threadpoolctl's set_num_threads obeys only the thread that
        # first limited OpenBLAS (use_threads, on the main thread), and the server's engine runs on another
        blas = ThreadpoolController().select(user_api="blas").lib_controllers
        self.blas = [(c.get_num_threads, getattr(c, "_real_set_num_threads", c.set_num_threads)) for c in blas]

    def attention(
        self,
        query: np.ndarray,
        key: np.ndarray,
        value: np.ndarray,
        attn_mask: np.ndarray | None = None,
        enable_gqa: bool = False,
        scale: float | None = None,
    ) -> np.ndarray:
        """query [B, H, T, Dh] over key and value [B, Hkv, S, Dh] -> [B, H, T, Dh]; attn_mask [B or 1, 1, T, S]."""
        B, H, T, Dh = query.shape
        Hkv, S = key.shape[1], key.shape[2]
        if (
            T < MIN_SPLIT_QUERIES
            or attn_mask is None
            or attn_mask.shape[1] != 1
            or H % Hkv
            or query.dtype != np.float32
        ):
            return PLAIN_ATTENTION(query, key, value, attn_mask, enable_gqa, scale)
        G = H // Hkv
        scale = 1.0 / math.sqrt(Dh) if scale is None else scale
        # [B, 1, T, S]: a batch with no padding shares one mask row ([1, 1, T, S]) that the lesson broadcasts
        attn_mask = np.broadcast_to(attn_mask, (B, 1, T, S))
        ends = S - np.argmax(attn_mask[:, 0, :, ::-1], axis=-1)  # [B, T]: 1 + each query's last visible key
        blocks = [
            (b, h, a, min(a + QUERY_BLOCK, T), int(ends[b, a : a + QUERY_BLOCK].max()))
            for b in range(B)
            for h in range(Hkv)
            for a in range(0, T, QUERY_BLOCK)
        ]
        out = np.empty(query.shape, dtype=query.dtype)  # [B, H, T, Dh]

        def attend(share: list[tuple[int, int, int, int, int]]) -> None:
            scores = np.empty(G * QUERY_BLOCK * S, dtype=query.dtype)  # one block's at a time, reused
            for b, h, a, z, end in share:
                # [G, z - a, end]: the keys any of the block's queries sees, contiguous (one ufunc call a step)
                seen = scores[: G * (z - a) * end].reshape(G, z - a, end)
                np.matmul(query[b, h * G : (h + 1) * G, a:z], key[b, h, :end].swapaxes(-2, -1), out=seen)
                seen *= scale
                np.copyto(seen, -np.inf, where=~attn_mask[b, 0, a:z, :end])  # [z - a, end] over the G heads
                probs = functional.softmax(seen, axis=-1, out=seen)  # [G, z - a, end]
                np.matmul(probs, value[b, h, :end], out=out[b, h * G : (h + 1) * G, a:z])  # [G, z - a, Dh]

        shares = balanced(blocks, self.threads, lambda block: (block[3] - block[2]) * block[4])
        with self.lock:  # OpenBLAS's count is the process's: two prompts at once would keep each other's 1
            before = [get() for get, _ in self.blas]
            for _, set_threads in self.blas:
                set_threads(1)
            try:
                pending = [self.pool.submit(attend, share) for share in shares[1:]] if self.pool else []
                attend(shares[0])
                for piece in pending:
                    piece.result()
            finally:
                for (_, set_threads), count in zip(self.blas, before, strict=True):
                    set_threads(count)
        return out  # [B, H, T, Dh]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)


def balanced(items: list[Any], parts: int, cost: Callable[[Any], int]) -> list[list[Any]]:
    """`items` dealt into `parts` shares of near-equal total cost (the costliest first, each to the
    lightest share so far)."""
    shares: list[list[Any]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for item in sorted(items, key=cost, reverse=True):
        lightest = loads.index(min(loads))
        shares[lightest].append(item)
        loads[lightest] += cost(item)
    return shares


SPLIT: list[RowSplit] = []  # the installed split, if any (one per process: the thread count is the process's)
ATTENTION: list[PromptAttention] = []  # the installed prompt attention, if any


def reinstall(installed: list[Any], threads: int | None, make: Callable[[int], Any], fewest: int = 2) -> Any:
    """`installed`'s split closed and replaced by `make(threads)` where threads >= fewest; None where not."""
    for old in installed:
        old.close()
    installed[:] = [make(threads)] if threads is not None and threads >= fewest else []
    return installed[0] if installed else None


def split_products(threads: int | None) -> None:
    """Every large product of every NumPy model in this process split across `threads` threads, and a
    prompt's attention with them (`split_attention`); 1 or None: the lesson's own for both, no pool."""
    split = reinstall(SPLIT, threads, RowSplit)
    functional.linear = PLAIN_LINEAR if split is None else split.linear
    split_attention(None if split is None else threads)


def split_attention(threads: int | None) -> None:
    """A prompt's attention in every NumPy model in this process as `PromptAttention` across `threads`
    threads (1: its causal blocks on the calling thread, no pool; None: the lesson's own).
    `kvports.threads.use_threads` calls it with the count --threads gives."""
    split = reinstall(ATTENTION, threads, PromptAttention, fewest=1)
    functional.scaled_dot_product_attention = PLAIN_ATTENTION if split is None else split.attention


def split_threads() -> int:
    """The threads the products are split across (1: unsplit)."""
    return SPLIT[0].threads if SPLIT else 1


def attention_threads() -> int:
    """The threads a prompt's attention runs on (0: the lesson's attention)."""
    return ATTENTION[0].threads if ATTENTION else 0
