"""`--threads N`: one thread count for every framework in this process, set before any of them starts.

On a busy machine a framework's default (a thread per CPU) makes its threads wait for each
other: torch ran 10-90x slower than with one thread. Each library takes the count its own way:
- torch: `torch.set_num_threads` (intra-op) now, if it is loaded, and `set_num_interop_threads`,
  which torch accepts only before its first parallel work (later it raises; that count stays);
  OMP_NUM_THREADS for a torch not yet imported.
- NumPy: its BLAS (OpenBLAS, loaded with NumPy, long before any flag is read) through threadpoolctl,
  which changes a loaded BLAS's count. OPENBLAS/MKL/OMP_NUM_THREADS reach child processes.
- torch's decode products: MKL runs a one-row product on one thread. At any count --threads gives, once
  the torch port is loaded, a float32 product of up to 8 rows runs a C++ loop over the weight's rows on
  torch's OpenMP threads (torch_impl/fast/row_loop.py, where it builds); otherwise a large one is split
  by output rows across torch's own thread count (torch_impl/fast/cores.py, one torch.bmm a product).
  NumPy's product split (a pool of Python threads) is not used: on an idle machine OpenBLAS's own
  threads decoded faster (docs/BENCH.md). NumPy's prompt attention is switched here, once the
  NumPy port is loaded (numpy_impl/fast/cores.py's split_attention): at any count given, one included,
  a float32 prompt's attention runs by causal query blocks, skipping the keys a block never sees, on
  every thread (without --threads, the lesson's attention). So are its float32 decode products, where
  numba is installed (numpy_impl/fast/row_loop.py): a compiled loop over the weight's rows, dealt across
  the count given (without --threads, or without numba, OpenBLAS's).
- JAX: its CPU client sizes its intra-op pool from NPROC when it starts (XLA's
  DefaultThreadPoolSize; XLA_FLAGS' `intra_op_parallelism_threads` is TensorFlow's option and
  changes nothing here). Measured in jax 0.10.2 on 2 CPUs: NPROC=1 gives the process 15 threads,
  the default 17, NPROC=8 29. A JAX that has already started keeps its pool. At any count given, once
  the JAX port is loaded, a float32 CPU model loaded after that runs its products of up to 8 rows in a
  C++ loop over the weight's rows, an XLA custom call on that pool (jax_impl/fast/row_loop.py, where it
  builds); otherwise XLA's dot.
- The bench's peers (llama.cpp, CTranslate2) read OMP_NUM_THREADS (`bench.measure.peer_threads`).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from kvports.shared.checks import COMMAND_LINE, Names, check_range

THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NPROC")
NUMPY_PORT = "kvports.numpy_impl.port"  # registry.MODULES' NumPy port
TORCH_PORT = "kvports.torch_impl.port"  # its torch port
JAX_PORT = "kvports.jax_impl.port"  # and its JAX port
OVERSUBSCRIBE = 4  # more threads than CPUs only wait for each other; past a few times that is a typo


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def max_threads() -> int:
    return OVERSUBSCRIBE * max(usable_cpus(), os.cpu_count() or 1)


def check_threads(threads: object, names: Names = COMMAND_LINE) -> int | None:
    """None (each framework's own default), or a count in [1, 4 x the CPUs]."""
    if threads is None:
        return None
    return check_range("threads", threads, 1, names, max_threads())


REQUESTED: list[int] = []  # the count this process was given, for `settle_threads` after a port loads


def use_threads(threads: int | None) -> None:
    """Every framework's thread count set to `threads` (None: leave each its default): call it
    before any port loads, and `settle_threads` after one has (torch's pools exist only then)."""
    if threads is None:
        return
    threads = int(threads)  # a NumPy integer as its value: threadpoolctl takes an int only
    REQUESTED[:] = [threads]
    for name in THREAD_VARIABLES:
        os.environ[name] = str(threads)
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # NumPy's BLAS keeps its count; the variables above still reach child processes
        pass
    else:
        threadpool_limits(limits=threads)  # applied now, for the process (not used as a context)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)
        try:
            torch.set_num_interop_threads(threads)
        except RuntimeError:  # torch has already run parallel work: its inter-op pool is fixed
            pass
    if TORCH_PORT in sys.modules:  # a torch model loaded after this keeps its float32 rows for the loop
        from kvports.torch_impl.fast.row_loop import install_row_products

        install_row_products(threads)
    if JAX_PORT in sys.modules:  # a float32 JAX model loaded after this runs its decode products in the loop
        from kvports.jax_impl.fast.row_loop import install_row_products as install_jax_loop

        install_jax_loop(threads)
    if NUMPY_PORT in sys.modules:  # imported only with the port: its functional.py loads SciPy
        from kvports.numpy_impl.fast.row_loop import use_numpy_threads

        use_numpy_threads(threads)


def settle_threads() -> None:
    """The count given to `use_threads` applied again, now that a port (torch, say) has loaded."""
    if REQUESTED:
        use_threads(REQUESTED[0])


def thread_counts(threads: int | None) -> dict[str, Any]:
    """What a table prints: the count asked for ("default": each framework's own), and the CPUs."""
    return {"threads": "default" if threads is None else threads, "cpus": usable_cpus()}


def describe_threads(threads: int | None) -> str:
    return f"{'default threads' if threads is None else f'{threads} thread' + 's' * (threads != 1)}"
