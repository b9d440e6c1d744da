"""A decode step's large products split across torch's threads, set from outside the model.

Given two threads, torch's one-row F.linear (MKL's sgemv) still runs on one: on SmolLM2's shapes
it took the same time at torch.set_num_threads(1) and (2) (tools-free micro-run, load ~13, in the
issue 46 report), so a second core did nothing for decode. llama.cpp splits each product's OUTPUT
rows across its threads; so does this: the caller's thread runs the first piece, a pool the rest
(torch's ops release the GIL while they run). torch.bmm over the weight viewed as [pieces, in,
out / pieces] splits the same way through torch's own OpenMP threads; on the loaded machine it
stalled for ~28 ms on a 3072 x 576 product at 2 threads (its threads wait at a barrier), the pool
did not, so the pool it is.

Only one-row products (a decode step at batch 1) are split: a many-row product is MKL's sgemm,
which divides itself across torch's threads, and sums differently when cut into column pieces.
Splitting the output rows keeps each dot product whole, summed as unsplit (tests/
test_split_products.py: bit-identical at float32 and float64). Only float32 and float64 products
without a bias are split (addmm adds a bias inside the kernel), never under torch.compile (inductor
plans its own loops) nor with gradients on.

Not on by default: measured on an idle 2-core machine (SmolLM2 float32, `python tools/profile_cores.py
torch`, 33 tokens at 2 threads, median of 3 interleaved) the split took 1.73 s against 1.39 s unsplit:
a handoff to a pool thread and back at each of a step's ~150 products costs more than half a product
saves. Its one win was on a machine oversubscribed several times over, where MKL's and OpenMP's
threads wait for busy cores. `split_products(n)` turns it on (the tools and tests do).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

MIN_SPLIT_BYTES = 1 << 21  # smaller weights: a handoff (~10-20 us) costs more than half the product saves
ROW_ALIGN = 64  # each piece's rows a multiple of 64, as the NumPy port's (its kernels' blocks)
MAX_ROWS = 1  # more rows: MKL's gemm, threaded by MKL itself, and not summed as its column pieces are
SPLIT_DTYPES = (torch.float32, torch.float64)


def piece_bounds(rows: int, threads: int) -> list[tuple[int, int]]:
    """[start, stop) of each thread's output rows: near-equal, each start a multiple of ROW_ALIGN."""
    step = -(-rows // threads // ROW_ALIGN) * ROW_ALIGN  # ceil(rows / threads), rounded up to ROW_ALIGN
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


SPLIT: list[ThreadPoolExecutor] = []  # the pool of threads - 1, made at the first split product
COUNT: list[int] = []  # a count set by split_products; empty: unsplit (the default, see the module's docstring)


def split_products(threads: int | None) -> None:
    """Products split across `threads` threads whatever torch's count (1 or None: none, and no pool,
    as a loaded model runs)."""
    COUNT[:] = [] if threads is None else [threads]
    if split_threads() == 1:
        for old in SPLIT:
            old.shutdown(wait=True)
        SPLIT.clear()


def split_threads() -> int:
    """The threads one-row products are split across (1: unsplit)."""
    return COUNT[0] if COUNT else 1


def pool(threads: int) -> ThreadPoolExecutor:
    if not SPLIT or SPLIT[0]._max_workers != threads - 1:
        for old in SPLIT:
            old.shutdown(wait=True)
        SPLIT[:] = [ThreadPoolExecutor(threads - 1, thread_name_prefix="kvports-torch")]
    return SPLIT[0]


def piece(x: torch.Tensor, weight_t: torch.Tensor, out: torch.Tensor, inference: bool) -> None:
    """out = x [N, in] @ weight_t [in, n], in a pool thread, under the caller's inference mode."""
    with torch.inference_mode(inference):
        torch.mm(x, weight_t, out=out)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear: x [..., in], weight [out, in] -> [..., out], its output rows split across torch's threads."""
    threads = split_threads()
    rows = weight.shape[0]
    x2 = x.reshape(-1, x.shape[-1])  # [N, in]
    bounds = piece_bounds(rows, threads) if threads > 1 else [(0, rows)]
    small = weight.numel() * weight.element_size() < MIN_SPLIT_BYTES
    plain = bias is not None or not x.is_cpu or x.dtype not in SPLIT_DTYPES or torch.is_grad_enabled()
    plain = plain or torch.compiler.is_compiling()
    if plain or len(bounds) == 1 or small or x2.shape[0] > MAX_ROWS:
        return F.linear(x, weight, bias)  # [..., out]
    y = torch.empty(x2.shape[0], rows, dtype=x.dtype)  # [N, out]
    (first, *rest) = bounds
    weight = weight.detach()  # no_grad is the caller thread's alone: the pool's would see a Parameter
    # Each piece writes its own columns of y: [N, in] @ [in, stop - start], no copy of the weight.
    inference = torch.is_inference_mode_enabled()  # thread-local too: the pool writes y in the caller's mode
    pending = [pool(threads).submit(piece, x2, weight[a:b].t(), y[:, a:b], inference) for a, b in rest]
    torch.mm(x2, weight[first[0] : first[1]].t(), out=y[:, first[0] : first[1]])
    for running in pending:
        running.result()
    return y.reshape(*x.shape[:-1], rows)  # [..., out]
