"""A decode step's float32 products as a C++ loop over the weight's rows, on XLA's own threads:
llama.cpp's way of using a second core, in JAX's idiom (an XLA custom call through jax.ffi, run on
the CPU client's intra-op pool). torch's row_loop.py is the same loop on torch's OpenMP threads, the
NumPy port's the same loop compiled by numba.

A decode step at batch 1 is one-row products, bound by how fast the weights stream from memory.
XLA:CPU's one-row dot splits itself over its threads, but SmolLM2's step still took 1.4x llama.cpp's
time at 2 threads (docs/BENCH.md). This loop (row_loop.cpp) deals each weight's output rows across the
threads in chunks, each row's dot product whole, in vector registers. It is built once per CPU and
jaxlib into KVPORTS_EXTENSIONS_DIR (by default ~/.cache/kvports_extensions) by the system's C++
compiler ($CXX, else c++) in a few seconds: without one, or where the build fails, nothing is
installed and XLA's dot runs the products as before.

Numerics: float32 outputs move from XLA's by rounding, ~1e-6 of their size (the sum is reassociated in
vector lanes); every thread count gives the same bits, since a row is never split between threads.
float64 keeps XLA's dot, so the ports' float64 agreement stays bit for bit.

Where: a float32 model on the CPU loaded while the loop is installed has every Linear (and a tied head)
swapped for a LoopLinear over its weight [out, in]: a product of up to LOOP_ROWS rows of input (a decode
step, a small batch's, a very short prompt) runs the loop, a longer prompt XLA's dot from that layout.
The thread count is the model's, fixed when it loads: a compiled program keeps the count it was
traced with. `kvports.threads.use_threads` installs it at any count --threads gives, as it does the
other ports' loops; without --threads XLA's dot runs every product, as before.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import subprocess
import tempfile
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from flax import nnx

import kvports.jax_impl.functional as F
from kvports.jax_impl.fast import untie_head
from kvports.jax_impl.fast.layout import RowLinear, lay_out, linear_layers
from kvports.shared import cpu
from kvports.shared.pages import in_huge_pages

INSTALLED: list[RowProducts] = []  # the installed loop, if any (one per process: the thread count is the process's)
KERNELS: list[str] = []  # the custom call's name, once a process has built (or found) and registered the loop
FAILED: list[str] = []  # why the build failed, once it has: not tried again in this process
SOURCE = Path(__file__).with_name("row_loop.cpp")
TARGET = "kvports_row_products"  # the custom call's name in XLA's registry
# Rows of input a product runs in the loop: each weight row, once read, meets every input row while it is in
# cache. NumPy's loop took 0.3-1.2x OpenBLAS's time up to 5 rows and 0.9-1.3x at 8 (docs/BENCH.md); the same count here.
LOOP_ROWS = 8
AVX2_CPU = "haswell"  # GCC's name for the first x86-64 CPU with AVX2 and FMA, and no AVX-512
X86 = ("x86_64", "amd64")  # platform.machine(), lowered, where -march names a CPU
EXTENSIONS_VARIABLE = "KVPORTS_EXTENSIONS_DIR"  # where the built library goes (a directory of its own)
BUILD_SECONDS = 300  # a compile of one file against the FFI headers: ~3 s here


def build_target() -> tuple[str, list[str]]:
    """The build's name and the flags naming its CPU. A build for this CPU's own instructions is named
    by them, so that a home directory shared by machines with other CPUs never loads another's; under
    KVPORTS_CPU=avx2 (shared/cpu.py) an x86-64 build is for Haswell's instructions alone."""
    x86 = platform.machine().lower() in X86
    if x86 and cpu.forced() == "avx2":
        return AVX2_CPU, [f"-march={AVX2_CPU}"]
    flags = hashlib.sha256(" ".join(sorted(cpu.native_flags())).encode()).hexdigest()[:12]
    return f"native_{flags}", ["-march=native" if x86 else "-mcpu=native"]


def extensions_dir() -> Path:
    value = os.environ.get(EXTENSIONS_VARIABLE)
    return Path(value) if value else Path.home() / ".cache" / "kvports_extensions"


def library_path() -> tuple[Path, list[str]]:
    """Where this CPU's build of this source for this jaxlib lives (the FFI's structs are jaxlib's), and its flags."""
    target, march = build_target()
    tag = hashlib.sha256(SOURCE.read_bytes() + jaxlib.__version__.encode()).hexdigest()[:12]
    return extensions_dir() / f"kvports_jax_row_loop_{target}_{tag}.so", march


def build(library: Path, march: list[str]) -> None:
    """row_loop.cpp compiled into `library`: written beside it under another name, then renamed, so a
    process that reads it meanwhile (or a build killed half-way) never meets half a file."""
    library.parent.mkdir(parents=True, exist_ok=True)
    compiler = os.environ.get("CXX") or "c++"
    descriptor, part = tempfile.mkstemp(dir=library.parent, prefix=library.stem, suffix=".part")
    os.close(descriptor)
    try:
        command = [compiler, "-O3", *march, "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC"]
        command += ["-I", jax.ffi.include_dir(), str(SOURCE), "-o", part]
        done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_SECONDS)
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines() or [""]
            raise RuntimeError(f"{compiler} exited {done.returncode}: {errors[0]}")
        os.replace(part, library)
    finally:
        if os.path.exists(part):
            os.unlink(part)


def compiled_loop() -> str | None:
    """The loop's custom call name, built on first use (or found from an earlier build) and registered
    with XLA; None where it cannot be built."""
    if KERNELS:
        return KERNELS[0]
    if FAILED:
        return None
    try:
        library, march = library_path()
        if not library.is_file():
            build(library, march)
        handler = ctypes.CDLL(str(library)).KvportsRowProducts
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handler), platform="cpu")
    except Exception as error:  # no compiler, no headers, a failed build: the products stay XLA's
        FAILED.append(f"{type(error).__name__}: {error}".splitlines()[0])
        return None
    KERNELS.append(TARGET)
    return TARGET


class RowProducts:
    """A float32 product of up to LOOP_ROWS rows run by the loop on `threads` threads."""

    def __init__(self, threads: int):
        self.threads = threads

    def linear(self, x: jax.Array, weight: jax.Array, bias: jax.Array | None = None) -> jax.Array:
        count = math.prod(x.shape[:-1])  # R: the rows of input (known when the step is traced)
        plain = (
            x.dtype != jnp.float32
            or weight.dtype != jnp.float32
            or weight.ndim != 2
            or weight.shape[1] != x.shape[-1]  # the dot names the mismatch; the loop would read past the weight
            or not 0 < count <= LOOP_ROWS
        )
        if plain:
            return F.linear(x, weight, bias)  # [..., out]
        y = self.in_loop(x, weight)  # [..., out]
        return y if bias is None else y + bias

    def in_loop(self, x: jax.Array, weight: jax.Array) -> jax.Array:
        """x [..., in] against weight [out, in] by the loop -> [..., out]."""
        rows, width = weight.shape
        call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((math.prod(x.shape[:-1]), rows), jnp.float32))
        y = call(x.reshape(-1, width), weight, blocks=np.int64(self.threads))  # [R, out]
        return y.reshape(*x.shape[:-1], rows)  # [..., out]


def install_row_products(threads: int | None) -> RowProducts | None:
    """The loop for every float32 CPU model loaded after this, across `threads` threads (None, or no
    loop built: XLA's dot, and None). A model loaded earlier keeps what it was loaded with."""
    INSTALLED.clear()
    loop = compiled_loop() if threads is not None else None
    if threads is None or loop is None:
        return None
    INSTALLED.append(RowProducts(threads))
    return INSTALLED[0]


def row_threads() -> int:
    """The threads a float32 decode step's product is dealt across (0: XLA's dot runs it)."""
    return INSTALLED[0].threads if INSTALLED else 0


def linear(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """F.linear for float32: x [..., in], weight [out, in] -> [..., out], by the loop where installed."""
    return INSTALLED[0].linear(x, weight, bias) if INSTALLED else F.linear(x, weight, bias)


class LoopLinear(RowLinear):
    """RowLinear (a weight [out, in]) whose products of a few rows run the loop on the threads it was loaded with."""

    def __init__(self, weight: np.ndarray, bias: jax.Array | None, dtype: jnp.dtype, threads: int):
        # on the CPU, an aligned float32 weight is wrapped where it is, not copied
        super().__init__(weight, bias, dtype)
        self.threads = threads  # static: a program traced at one count is not reused at another

    def __call__(self, x: jax.Array) -> jax.Array:
        return RowProducts(self.threads).linear(x, self.weight[...], None if self.bias is None else self.bias[...])


def by_rows(model: nnx.Module, tensors: dict[str, np.ndarray]) -> nnx.Module:
    """Every Linear of a float32 CPU model a LoopLinear over the file's weight [out, in], and a tied
    head one over the embedding [V, D] (one array for both), while the loop is installed. The weights
    are copied into one mapping of 2 MB pages first (shared/pages.py): the loop streams them faster."""
    threads = row_threads()
    names = [f"{prefix}.weight" for prefix, _, _ in linear_layers(model)]
    names += ["emb.weight"] if model.config.tie_embeddings else []
    weights = in_huge_pages({name: np.asarray(tensors[name], dtype=np.float32) for name in names})  # [out, in] each
    model = lay_out(model, weights, jnp.float32, partial(LoopLinear, threads=threads))
    if model.config.tie_embeddings:
        head = LoopLinear(weights["emb.weight"], None, jnp.float32, threads)  # [V, D]
        model.emb.embedding.set_value(head.weight[...])  # the lookup reads the head's array: one copy
        untie_head(model, head)
    return model
