"""A decode step's float32 products as a C++ loop over the weight's rows, on torch's own threads:
llama.cpp's way of using a second core, in torch's idiom (a C++ extension that torch's cpp_extension
builds, run on torch's OpenMP pool). The NumPy port's row_loop.py is the same loop, compiled by numba.

A decode step at batch 1 is one-row products, bound by how fast the weights stream from memory.
MKL's one-row sgemm ran each product on one thread, and the bmm split (cores.py) streamed SmolLM2's
weights at 11-30 GB/s on 2 threads. This loop (row_loop.cpp) deals each weight's output rows across
the threads in contiguous blocks, each row's dot product whole, in vector registers: on the same
shapes at 2 threads it took 0.3-0.7x the split's time (docs/BENCH.md, "torch's products as a C++
loop"). It is built once per CPU into torch's extensions directory (TORCH_EXTENSIONS_DIR, by default
~/.cache/torch_extensions) in under a second, and needs a C++ compiler with OpenMP and ninja (the
`fast` extra installs ninja): without them, or where the build fails, nothing is installed and the
products run as before.

Numerics: float32 outputs move from MKL's by rounding, ~1e-6 of their size (the sum is reassociated
in vector lanes); every thread count gives the same bits, since a row is never split between threads.
float64 keeps MKL's products, so the ports' float64 agreement stays bit for bit.

Where: an eager float32 input of up to LOOP_ROWS rows (a decode step, a small batch's, a very short
prompt) against a float32 weight laid out by rows. While the loop is installed onednn.transpose_weights
lays every float32 matrix out so; longer prompts run MKL's product from that layout (cores.linear).
`kvports.threads.use_threads` installs it at any count --threads gives, as it does the NumPy port's
loop; without --threads the products run MKL's and the bmm split, as before.

The norms too: once the products stream at the memory's speed, what is left of an eager step is
operator calls (~4.7 ms of a ~16 ms SmolLM2 step at 2 threads), and model.py's RMSNorm is six of them:
16 us a norm of one row of 576, 61 norms a step. `LoopNorm`, swapped in by `use_loop_layers` (port.load_model)
while the loop is installed, runs the same float32 norm of up to LOOP_ROWS rows as one C++ call (row_loop.cpp's
rms_norm), 5 us, to float32 rounding of the lesson's; anything else runs the lesson's own forward.

And the attention: between a layer's qkv product and its output product, model.py's Block.attention is
~40 operator calls (the heads' views, RoPE's halves, the cache's writes and views, scaled_dot_product_attention),
~2.5 ms of a SmolLM2 step. `LoopBlock`, swapped in with the norms, runs them for one new token a row over a
KVCache whose every filled slot is visible (no row padded, no window cut) as one C++ call (row_loop.cpp's
decode_attention), to float32 rounding of the lesson's; a prompt, a padded batch, qk_norm, float64,
another cache (compiled, paged) run the lesson's own attention. The step's operators left: 5.2 -> 2.6 ms.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn

from kvports.shared import cpu
from kvports.torch_impl.fast import cores
from kvports.torch_impl.model import Block, KVCache, RMSNorm, Rope

INSTALLED: list[RowProducts] = []  # the installed loop, if any (one per process: the thread count is the process's)
KERNELS: list[Callable[..., None]] = []  # the built loop, once a process has built or loaded it
NORMS: list[Callable[..., None]] = []  # the same library's rms_norm, beside it
ATTENTIONS: list[Callable[..., None]] = []  # and its decode_attention
FAILED: list[str] = []  # why the build failed, once it has: not tried again in this process
SOURCE = Path(__file__).with_name("row_loop.cpp")
# Rows of input a product runs in the loop: each weight row, once read, meets every input row while it is in
# cache. NumPy's loop took 0.3-1.2x OpenBLAS's time up to 5 rows and 0.9-1.3x at 8 (docs/BENCH.md); the same count here.
LOOP_ROWS = 8
AVX2_CPU = "haswell"  # GCC's name for the first x86-64 CPU with AVX2 and FMA, and no AVX-512
X86 = ("x86_64", "amd64")  # platform.machine(), lowered, where -march names a CPU


def build_target() -> tuple[str, list[str]]:
    """The build's name and the flags naming its CPU. A build for this CPU's own instructions is named
    by them, so that a home directory shared by machines with other CPUs never loads another's; under
    KVPORTS_CPU=avx2 (shared/cpu.py) an x86-64 build is for Haswell's instructions alone."""
    x86 = platform.machine().lower() in X86
    if x86 and cpu.forced() == "avx2":
        return AVX2_CPU, [f"-march={AVX2_CPU}"]
    flags = hashlib.sha256(" ".join(sorted(cpu.native_flags())).encode()).hexdigest()[:12]
    return f"native_{flags}", ["-march=native" if x86 else "-mcpu=native"]


def compiled_loop() -> Callable[..., None] | None:
    """The loop, built on first use (or loaded from an earlier build); None where it cannot be built."""
    if KERNELS:
        return KERNELS[0]
    if FAILED:
        return None
    target, march = build_target()
    path_before = os.environ.get("PATH")
    try:
        from torch.utils.cpp_extension import load

        try:  # pip's ninja (the `fast` extra): its binary is on PATH only in an activated virtualenv
            import ninja

            os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path_before or os.defpath])
        except ImportError:  # a ninja of the system's, if any
            pass
        with warnings.catch_warnings():  # cpp_extension's notes on the compiler's version are not the user's concern
            warnings.simplefilter("ignore")
            path = load(
                name=f"kvports_row_loop_{target}",
                sources=[str(SOURCE)],
                extra_cflags=["-O3", *march, "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
        library = ctypes.CDLL(str(path))
        function, norm, attention = library.row_products, library.rms_norm, library.decode_attention
    except Exception as error:  # no compiler, no ninja, no OpenMP, no setuptools: the products stay MKL's
        FAILED.append(f"{type(error).__name__}: {error}".splitlines()[0])
        return None
    finally:  # PATH as it was, unset if it was
        if path_before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = path_before
    function.restype = None
    # weight, x, y pointers; rows, width, count, blocks
    function.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4
    norm.restype = None
    norm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float]  # x, weight, y; count, width; eps
    attention.restype = None
    # qkv, cos, sin, keys, values, out; B, H, Hkv, Dh, S, slot, filled; scale; threads
    attention.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 7
    attention.argtypes += [ctypes.c_float, ctypes.c_int64]
    KERNELS.append(function)
    NORMS.append(norm)
    ATTENTIONS.append(attention)
    return function


def in_reach(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the library may run an operation of x [..., D] with weight: both eager float32 CPU
    tensors, x of up to LOOP_ROWS rows, nothing recording gradients, inductor not tracing."""
    count = x.numel() // max(1, x.shape[-1])  # R: the rows of input
    return (
        x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.is_cpu
        and weight.is_cpu
        and count <= LOOP_ROWS
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
    )


class RowProducts:
    """onednn.linear's float32 product of up to LOOP_ROWS rows run by the loop on `threads` threads,
    LoopNorm's norm by `norm` and LoopBlock's decode attention by `attention`."""

    def __init__(
        self, threads: int, loop: Callable[..., None], norm: Callable[..., None], attention: Callable[..., None]
    ):
        self.threads = threads
        self.loop = loop
        self.norm = norm
        self.attention = attention

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        plain = (
            not in_reach(x, weight)
            or weight.dim() != 2
            or weight.shape[1] != x.shape[-1]  # F.linear names the mismatch; the loop would read past the weight
            or not weight.is_contiguous()
        )
        if plain:
            return cores.linear(x, weight, bias)  # [..., out]
        y = self.in_loop(x.contiguous(), weight)  # [..., out]
        if bias is not None:
            y += bias
        return y

    def in_loop(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [..., in] (contiguous: its R rows one after another) against weight [out, in] by the loop
        -> [..., out]. No reshape on either side: each costs a microsecond, and a step makes ~150 products."""
        y = torch.empty(*x.shape[:-1], weight.shape[0], dtype=torch.float32)  # [..., out], R rows of out
        rows, width = weight.shape
        self.loop(weight.data_ptr(), x.data_ptr(), y.data_ptr(), rows, width, y.numel() // max(1, rows), self.threads)
        return y


def install_row_products(threads: int | None) -> RowProducts | None:
    """The loop as every torch model's eager float32 product of up to LOOP_ROWS rows, across `threads`
    blocks of rows (None, or no loop built: the products in place before, and None)."""
    INSTALLED.clear()
    loop = compiled_loop() if threads is not None else None
    if threads is None or loop is None:
        return None
    INSTALLED.append(RowProducts(threads, loop, NORMS[0], ATTENTIONS[0]))
    return INSTALLED[0]


def row_threads() -> int:
    """The blocks of rows a float32 decode step's product is dealt into (0: MKL and the bmm split run it)."""
    return INSTALLED[0].threads if INSTALLED else 0


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for float32: x [..., in], weight [out, in] -> [..., out], by the loop where installed."""
    return INSTALLED[0].linear(x, weight, bias) if INSTALLED else cores.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """model.py's RMSNorm of x [..., D] by weight [D] as one C++ call -> [..., D], where the loop is
    installed and x is an eager float32 CPU input of up to LOOP_ROWS rows; None where it is not."""
    width = x.shape[-1]
    plain = (
        not INSTALLED
        or not in_reach(x, weight)
        or weight.shape != (width,)
        or not (x.is_contiguous() and weight.is_contiguous())
    )
    if plain:
        return None
    y = torch.empty_like(x)  # [..., D]
    INSTALLED[0].norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // max(1, width), width, eps)
    return y


class LoopNorm(RMSNorm):
    """model.py's RMSNorm (the same parameter and eps), by rms_norm above where it runs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = rms_norm(x, self.weight, self.eps)  # [..., D]
        return super().forward(x) if y is None else y


def decode_attention(
    block: Block, x: torch.Tensor, rope: Rope | None, mask: torch.Tensor | None, cache: KVCache | None, layer: int
) -> torch.Tensor | None:
    """model.py's Block.attention of one new token a row, x [B, 1, D], with every filled slot visible
    (mask None) over a float32 KVCache: its two products, and between them one C++ call (row_loop.cpp's
    decode_attention) -> [B, 1, D]. None where it does not run: a prompt, more than LOOP_ROWS rows, a
    mask, another cache or one of other shapes than this step's, the queries' and keys' own norms
    (qk_norm), float64, gradients, inductor's tracing, no loop installed. The C++ reads and writes
    through pointers, so every shape it relies on is checked here; the lesson's attention names a mismatch."""
    B, T, _ = x.shape
    config = block.config
    H, Hkv, Dh = config.n_heads, config.kv_heads, config.head_dim
    plain = (
        not INSTALLED
        or T != 1
        or mask is not None
        or type(cache) is not KVCache
        or config.qk_norm
        or not in_reach(x, cache.keys)
        or not (cache.keys.is_contiguous() and cache.values.is_contiguous())
        or cache.values.dtype != torch.float32
        or cache.values.shape != cache.keys.shape
        or not (0 <= layer < cache.keys.shape[0])
        or (cache.keys.shape[1], cache.keys.shape[2], cache.keys.shape[4]) != (B, Hkv, Dh)
        or not all(t.dtype == torch.float32 and t.shape == (1, 1, 1, Dh) and t.is_contiguous() for t in rope or ())
    )
    if plain:
        return None
    assert cache is not None
    qkv = block.qkv(x).contiguous()  # [B, 1, (H + 2 Hkv) Dh]: q heads, k heads, v heads
    if qkv.shape != (B, 1, (H + 2 * Hkv) * Dh) or qkv.dtype != torch.float32:
        return None  # not this config's heads: the lesson's attention computes it again and names what is wrong
    # cos, sin [1, 1, 1, Dh]: no row is padded, so every row's position is the same
    cos, sin = (0, 0) if rope is None else (rope[0].data_ptr(), rope[1].data_ptr())
    slots = cache.keys.shape[3]
    at = layer * cache.keys.stride(0) * cache.keys.element_size()  # bytes to keys[layer], values[layer]
    scale = Dh**-0.5 if config.attn_scale is None else config.attn_scale  # scaled_dot_product_attention's default
    out = torch.empty(B, 1, H * Dh, dtype=torch.float32)  # [B, 1, H Dh]: the heads side by side
    pointers = (qkv.data_ptr(), cos, sin, cache.keys.data_ptr() + at, cache.values.data_ptr() + at, out.data_ptr())
    # the new token goes to slot length mod S; the slots filled then, this one included, are attended
    sizes = (B, H, Hkv, Dh, slots, cache.length % slots, cache.filled(1))
    INSTALLED[0].attention(*pointers, *sizes, scale, INSTALLED[0].threads)
    return block.proj(out)  # [B, 1, D]


class LoopBlock(Block):
    """model.py's Block (the same modules), its attention by decode_attention above where that runs."""

    def attention(
        self, x: torch.Tensor, rope: Rope | None, mask: torch.Tensor | None, cache: KVCache | None, layer: int
    ) -> torch.Tensor:
        y = decode_attention(self, x, rope, mask, cache, layer)  # [B, 1, D]
        return super().attention(x, rope, mask, cache, layer) if y is None else y


def use_loop_layers(model: nn.Module) -> nn.Module:
    """Every float32 CPU RMSNorm of a loaded model a LoopNorm, and every Block a LoopBlock, while the loop
    is installed (row_threads() > 0)."""
    if not INSTALLED:
        return model
    for module in model.modules():
        if type(module) is RMSNorm and module.weight.dtype == torch.float32 and module.weight.is_cpu:
            module.__class__ = LoopNorm
        if type(module) is Block and module.ln1.weight.dtype == torch.float32 and module.ln1.weight.is_cpu:
            module.__class__ = LoopBlock
    return model
