"""Each weight matrix in the memory order OpenBLAS streams fastest at batch 1, set on a loaded model
from outside: its shape and values stay torch's (out, in), only where its bytes go changes.

x @ weight.T at one row is one OpenBLAS gemv, and which gemv streams the weight faster depends on
its shape (measured at batch 1, 1 thread, 30 weights per shape; tools/profile_numpy.py): with at
least as many outputs as inputs, weight.T contiguous ("F": ~1.3-2x on SmolLM2's qkv and gate/up,
~1.8x on its tied head, 49152 x 576); with more inputs than outputs (the down projection) the
(out, in) rows ("C": ~1.05-1.1x). The rule is shared.shapes.stored_transposed: the load cache
writes its matrices in the same order, so a model loaded from it copies nothing here. While numba's
one-row products are installed (--threads, row_loop.py), every float32 matrix is kept in (out, in) order
instead: its loop streams rows; a model loaded from the cache then copies its "F" matrices once.
Those matrices are then copied into one mapping of 2 MB pages (shared/pages.py), which the loop
streams faster than 4 KB pages.
"""

from __future__ import annotations

from typing import Literal, TypeVar

import numpy as np

from kvports.numpy_impl import nn
from kvports.numpy_impl.fast.row_loop import row_threads
from kvports.shared.pages import in_huge_pages
from kvports.shared.shapes import stored_transposed

M = TypeVar("M", bound=nn.Module)


def memory_order(weight: np.ndarray) -> Literal["C", "F"]:
    """ "F" (weight.T contiguous) or "C" (the (out, in) rows), by the matrix's shape; "C" for a float32
    matrix while numba's one-row products are installed (row_loop.py: its loop reads each row contiguously)."""
    if weight.dtype == np.float32 and row_threads():
        return "C"
    return "F" if stored_transposed(weight.shape) else "C"


def lay_out(model: M) -> M:
    """Every parameter of `model` in its memory order (a copy only where that order is not its own),
    and, while the loop is installed, its float32 matrices in 2 MB pages."""
    for _, owner, attr in model.named_parameters():
        array = getattr(owner, attr)
        setattr(owner, attr, np.asarray(array, order=memory_order(array)))
    if row_threads():
        in_pages(model)
    return model


def in_pages(model: M) -> M:
    """Every float32 matrix of `model` copied into one mapping of 2 MB pages: one copy of an array two
    parameters share (a tied head)."""
    places = [(owner, attr) for _, owner, attr in model.named_parameters()]
    matrices = {str(id(getattr(*place))): getattr(*place) for place in places}
    matrices = {key: array for key, array in matrices.items() if array.dtype == np.float32 and array.ndim == 2}
    copies = in_huge_pages(matrices)  # [out, in] rows each, as the loop reads them
    for owner, attr in places:
        setattr(owner, attr, copies.get(str(id(getattr(owner, attr))), getattr(owner, attr)))
    return model
