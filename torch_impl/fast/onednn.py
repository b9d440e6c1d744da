"""The CPU's fastest route for each linear at batch 1, swapped into a loaded model (`use_onednn`):
model.py's nn.Linear and F.linear stay the lesson; this is what port.load_model makes of them.

Torch only: a matrix-vector product streams its weight from memory, and how fast depends on the
kernel and on the weight's layout (measured at 1 and 2 threads, tools/profile_decode.py):
- float32: F.linear is MKL's sgemm, which streams a weight with at least as many outputs as inputs
  ~1.1-1.3x faster stored [in, out] (`x @ w.T` with w.T contiguous), and a down projection ~1.1x
  faster stored [out, in]: `transpose_weights` lays a loaded model's weights out by that rule
  (shared.shapes.stored_transposed, which NumPy's layout and the load cache follow too).
  oneDNN's linear on a plain float32 weight ran 1.1-1.4x slower than either at every SmolLM2 shape.
- bfloat16: F.linear at one row is a slow fallback, and oneDNN's linear reorders a plain weight
  at every call; reordered once into oneDNN's own blocked layout (`packed`) it runs ~2-4x faster.
  That layout needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT: where the CPU lacks them (or
  KVPORTS_CPU=avx2 says so, shared/cpu.py), the model keeps F.linear (`packed_bfloat16`).
The tied head is the largest matrix of a small model (SmolLM2's 49152 x 576): it gets a Linear of
its own over the embedding's weight, so that it takes the same route.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from kvports.shared import cpu
from kvports.shared.pages import in_huge_pages
from kvports.shared.shapes import stored_transposed
from kvports.torch_impl.fast import row_loop, untie_head

ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_onednn_linear = torch.ops.mkldnn._linear_pointwise if ONEDNN else None
PACKED_ROWS = 1  # the row count oneDNN picks its blocked layout for: a decode step's; more rows run as well
# The instructions oneDNN's packed bfloat16 kernel is built for, either set (its own error names them).
BFLOAT16_PACKED_NEEDS = (("avx512bw", "avx512vl", "avx512dq"), ("avx_ne_convert",))


def packed_bfloat16() -> bool:
    """Whether this machine runs oneDNN's packed bfloat16 linear: the CPU has the instructions
    (shared.cpu, which KVPORTS_CPU can narrow) and this torch's oneDNN agrees."""
    if _onednn_linear is None or not cpu.has_any(*BFLOAT16_PACKED_NEEDS):
        return False
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def packed(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] in oneDNN's blocked layout: reordered at the first call and kept on the
    tensor itself (again if the tensor has changed in place since), so the model holds no copy."""
    version = 0 if weight.is_inference() else weight._version  # an inference tensor cannot change
    cached = getattr(weight, "_onednn_packed", None)
    if cached is None or cached[0] != version:
        cached = (version, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_ROWS))
        weight._onednn_packed = cached
    return cached[1]  # an opaque oneDNN tensor: only _linear_pointwise reads it


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, packs: bool = True) -> torch.Tensor:
    """F.linear: x [..., in], weight [out, in] -> [..., out]; `packs`: bfloat16 may take oneDNN's packed route."""
    # Not under torch.compile: inductor lowers F.linear itself (and cannot lower this op unfrozen).
    eager_cpu = x.is_cpu and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
    if packs and _onednn_linear is not None and eager_cpu and x.dtype == torch.bfloat16:
        return _onednn_linear(x, packed(weight), bias, "none", [], "")  # [..., out]: no fused activation
    # float32: the row loop where --threads installed it (row_loop.py); else MKL's sgemm, in either layout
    # without a copy, a large one-row product split across torch's threads (cores.py)
    return row_loop.linear(x, weight, bias)  # [..., out]


def transpose_weights(model: nn.Module) -> nn.Module:
    """Each Linear's float32 weight in the layout MKL streams faster (`stored_transposed`): the same
    [out, in] tensor, laid out [in, out] or kept as its rows; a copy only where the loaded layout is
    the other one (none from the load cache, which stores them so). A head over the embedding's
    weight is laid out with it: the lookup then reads a strided row, one token's cost. While the row
    loop is installed (--threads, row_loop.py), every float32 matrix keeps its rows, in 2 MB pages (in_pages):
    the loop streams them."""
    by_rows = row_loop.row_threads() > 0
    for module in model.modules():
        weight = module.weight if isinstance(module, nn.Linear) else None
        if weight is not None and weight.dtype == torch.float32 and weight.is_cpu:
            if stored_transposed(tuple(weight.shape)) and not by_rows:
                weight.data = weight.data.t().contiguous().t()  # [out, in], laid out [in, out]
            else:
                weight.data = weight.data.contiguous()  # [out, in] rows
    return in_pages(model) if by_rows else model


def in_pages(model: nn.Module) -> nn.Module:
    """Every Linear's float32 CPU weight copied into one mapping of 2 MB pages (shared/pages.py), which
    the loop streams faster than 4 KB pages: one copy of a weight two Linears share (a tied head)."""
    weights = {}
    for module in model.modules():
        weight = module.weight if isinstance(module, nn.Linear) else None
        if weight is not None and weight.dtype == torch.float32 and weight.is_cpu and weight.dim() == 2:
            weights[str(id(weight))] = weight
    copies = in_huge_pages({key: weight.detach().numpy() for key, weight in weights.items()})  # [out, in] rows
    for key, weight in weights.items():
        weight.data = torch.from_numpy(copies[key])  # the same Parameter, its storage in the mapping
    return model


class Linear(nn.Linear):
    """nn.Linear (the same parameters, names and initialisation), through linear() above."""

    packs = True  # set by use_onednn from packed_bfloat16(): False keeps bfloat16 on F.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packs)


def use_onednn(model: nn.Module) -> nn.Module:
    """A loaded model (at its dtype and device) with every nn.Linear a Linear, the tied head one of
    them over the embedding's weight (the same tensor, not a copy), and its weights laid out for MKL.
    bfloat16 takes oneDNN's packed route only where `packed_bfloat16()` says the CPU runs it."""
    packs = packed_bfloat16()
    if model.config.tie_embeddings:
        emb = model.get_submodule("emb")
        head = Linear(emb.embedding_dim, emb.num_embeddings, bias=False, device="meta")
        head.weight = emb.weight  # [V, D]: shared, so the state and the lookup see one tensor
        untie_head(model, head)
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = Linear  # the same parameters, through linear()
        if isinstance(module, Linear):
            module.packs = packs
    return transpose_weights(model)


def linear_route(dtype: str, quant: str, device: str) -> str:
    """The kernel a loaded model's linears take, in one word for the header and the bench row."""
    if device != "cpu":
        return "cublas"
    if quant != "none":
        return {"int8": "int8pack", "q4": "int4pack"}[quant]  # fast/quant.py's kernels (any x86 CPU)
    if dtype == "bfloat16":
        return "onednn" if packed_bfloat16() else "plain"  # plain: F.linear's own bfloat16 loop
    blas = "mkl" if torch.backends.mkl.is_available() else "blas"  # F.linear's gemm
    # at --threads, a float32 decode step's products run row_loop.py's loop
    return f"loop+{blas}" if dtype == "float32" and row_loop.row_threads() else blas
