"""A decode step's large products split across torch's threads, set from outside the model.

Given two threads, torch's one-row F.linear (MKL's sgemm at M = 1) still runs on one: on SmolLM2's
shapes it took the same time at torch.set_num_threads(1) and (2), so a second core did nothing for
decode (issue 46). llama.cpp splits each product's OUTPUT rows across its threads; so does this,
in torch's own idiom: the weight [out, in] viewed as `threads` pieces of its rows, [P, in, out / P]
(a view, no copy), and one torch.bmm over them, which runs the pieces on torch's own OpenMP threads
at once (each piece an M = 1 gemm streaming its share of the weight).

Measured on an idle 2-core AMD EPYC (SmolLM2 float32, 2 threads, `python tools/profile_cores.py
torch`, docs/BENCH.md "Every thread a decode step is given"), a decode step went from ~40 ms unsplit
to ~31 ms split. An earlier version handed each piece to a pool of Python threads: at ~150 products a
step, each handoff (~10-20 us) cost more than half a product saves, and it was slower than unsplit.

On by default: every one-row product of at least MIN_SPLIT_BYTES is split across
torch.get_num_threads() pieces (one thread: none; `--threads` sets the count, kvports/threads.py).
`split_products(n)` fixes the count (1: unsplit), as tools/profile_cores.py and the tests do.

Splitting the output rows keeps each output's dot product whole. MKL still treats the last columns
of a product apart when its width is no multiple of its vector blocks, so a piece's width must be a
multiple of ROW_ALIGN; then a split product equals the unsplit one bit for bit at float32 and float64
(tests/test_split_products.py; by measurement in MKL 2024 on AVX-512: piece widths of 8, 16, 24 and
up split exactly, 4 and 150 did not). A product whose rows cannot be cut so runs unsplit. Only
float32 and float64 products without a bias are split (addmm adds a bias inside the kernel), never
under torch.compile (inductor plans its own loops) nor with gradients on. A many-row product is
MKL's sgemm, which divides itself across torch's threads: it runs as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MIN_SPLIT_BYTES = 1 << 20  # smaller weights: the bmm's setup is a larger share than the second core saves
ROW_ALIGN = 16  # each piece's width a multiple of this: MKL's kernels sum such columns as the whole does
MAX_ROWS = 1  # more rows: MKL's gemm, threaded by MKL itself
SPLIT_DTYPES = (torch.float32, torch.float64)

COUNT: list[int] = []  # a count set by split_products; empty: torch's own thread count (the default)


def split_products(threads: int | None) -> None:
    """One-row products split into `threads` pieces whatever torch's thread count (1: unsplit;
    None: as many as torch's threads, the default)."""
    COUNT[:] = [] if threads is None else [threads]


def split_threads() -> int:
    """The pieces a large one-row product is split into (1: unsplit)."""
    return COUNT[0] if COUNT else torch.get_num_threads()


def pieces(weight: torch.Tensor, threads: int) -> torch.Tensor | None:
    """weight [out, in] as [P, in, out / P], P = threads (a view, kept on the tensor, so each step
    reuses it: an inference tensor cannot change in place, any other is viewed again after it
    does); None where its rows cannot be cut into P pieces of a multiple of ROW_ALIGN."""
    rows, width = weight.shape[0], weight.shape[0] // threads
    if rows % threads or width % ROW_ALIGN:
        return None
    version = 0 if weight.is_inference() else weight._version
    cached = getattr(weight, "_row_pieces", None)
    if cached is None or cached[:2] != (threads, version):
        view = weight.detach().t().unflatten(1, (threads, width)).permute(1, 0, 2)  # [P, in, out / P]
        cached = (threads, version, view)
        weight._row_pieces = cached
    return cached[2]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear: x [..., in], weight [out, in] -> [..., out], a one-row product's output rows split
    across torch's threads."""
    # Asked first: under torch.compile, torch.get_num_threads() (split_threads) would break the graph.
    if torch.compiler.is_compiling() or torch.is_grad_enabled():
        return F.linear(x, weight, bias)  # [..., out]
    threads = split_threads()
    small = weight.numel() * weight.element_size() < MIN_SPLIT_BYTES
    plain = threads == 1 or small or bias is not None or not x.is_cpu or x.dtype not in SPLIT_DTYPES
    split = None if plain or x.numel() > MAX_ROWS * x.shape[-1] else pieces(weight, threads)
    if split is None:
        return F.linear(x, weight, bias)  # [..., out]
    inputs = x.reshape(1, 1, -1).expand(threads, 1, x.shape[-1])  # [P, 1, in]: one row, every piece's
    y = torch.bmm(inputs, split)  # [P, 1, out / P]: piece p holds output rows p * out / P ...
    return y.reshape(*x.shape[:-1], weight.shape[0])  # [..., out]
