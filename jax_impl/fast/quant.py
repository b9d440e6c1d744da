"""Weight-only quantized Linear layers, swapped into a loaded model from outside (model.py stays float).

JAX has no int8 or 4-bit weight kernel on the CPU; what XLA does instead is fuse: an elementwise
producer of a dot's operand (a convert, a scale, a shift) runs inside the dot's own loop, when the
dot contracts the operand's contiguous axis. So the codes are kept [out, in], as torch keeps a
weight, and each token streams one byte per weight with no float copy made: int8 as
(x @ codes^T) * scale, per output channel; q4 as x @ (scale * code + min)^T, per group of 32.
Measured with jax 0.10.2, one row, one thread, a SwiGLU FFN's two matrices (3072 x 576 and
576 x 1536) in each of 30 layers: float32 18-20 ms, int8 10.6 ms, q4 9.8-10.5 ms, bfloat16 9.1 ms.
Stored [in, out] instead, the same int8 and bfloat16 dots take 210-220 ms. A q4 code is held one
per byte: unpacking two nibbles inside the dot breaks the fusion (60 ms), so JAX's 4-bit reads a
byte per weight, as int8 does, and keeps the file's exact values (no second rounding).
The same layout serves unquantized bfloat16 (layout.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

import kvports.jax_impl.functional as F
from kvports.jax_impl.fast import untie_head
from kvports.jax_impl.fast.layout import linear_layers
from kvports.shared.quantization import Q4_GROUP, q4_blocks, quantize_int8


class Int8Linear(nnx.Module):
    """x [..., in] -> [..., out] through int8 codes [out, in] and per-channel scales [out]."""

    def __init__(self, weight: np.ndarray, bias: jax.Array | None, dtype: DTypeLike):
        codes, scales = quantize_int8(weight)
        self.codes = nnx.Variable(jnp.asarray(codes))  # [out, in] int8
        self.scales = nnx.Variable(jnp.asarray(scales, dtype=dtype))  # [out]
        self.bias = None if bias is None else nnx.Param(bias)  # [out]

    def __call__(self, x: jax.Array) -> jax.Array:
        # The scale is per output channel, so it leaves the sum: the convert alone fuses into the dot.
        out = F.linear(x, self.codes[...].astype(x.dtype)) * self.scales[...]  # [..., out]
        return out if self.bias is None else out + self.bias[...]


class Int4Linear(nnx.Module):
    """x [..., in] -> [..., out] through a GGUF file's own 4-bit codes [out, in] (one per byte),
    with a scale and a min per group of 32 [out, in / 32]."""

    def __init__(
        self, codes: np.ndarray, scales: np.ndarray, mins: np.ndarray, bias: jax.Array | None, dtype: DTypeLike
    ):
        self.codes = nnx.Variable(jnp.asarray(codes, dtype=jnp.uint8))  # [out, in], 0..15
        # float32 even for bfloat16 activations: each weight is made at float32 and rounded once, as torch's kernel does
        self.scales = nnx.Variable(jnp.asarray(scales, dtype=jnp.promote_types(dtype, jnp.float32)))  # [out, in / 32]
        self.mins = nnx.Variable(jnp.asarray(mins, dtype=jnp.promote_types(dtype, jnp.float32)))  # [out, in / 32]
        self.bias = None if bias is None else nnx.Param(bias)  # [out]

    def __call__(self, x: jax.Array) -> jax.Array:
        codes = self.codes[...]
        out_features, in_features = codes.shape
        scales, mins = self.scales[...], self.mins[...]
        groups = codes.reshape(out_features, -1, Q4_GROUP).astype(scales.dtype)  # [out, in / 32, 32]
        # w = scale * code + min, made inside the dot's loop (XLA fuses it): never a float copy of the weight
        weight = groups * scales[..., None] + mins[..., None]  # [out, in / 32, 32]
        out = F.linear(x, weight.reshape(out_features, in_features).astype(x.dtype))  # [..., out]
        return out if self.bias is None else out + self.bias[...]


def quantized(
    name: str, weight: np.ndarray, bias: jax.Array | None, tensors: dict[str, np.ndarray], dtype: DTypeLike
) -> nnx.Module:
    """Matrix `name`'s quantized Linear: its file's 4-bit blocks where it has them, else int8 codes
    quantized now from its float32 weight."""
    blocks = q4_blocks(tensors, name)
    if blocks is not None:
        return Int4Linear(*blocks, bias, dtype)
    return Int8Linear(weight, bias, dtype)


def quantize_model(model: nnx.Module, tensors: dict[str, np.ndarray], quant: str, dtype: DTypeLike) -> nnx.Module:
    """Every Linear of `model` swapped for its quantized twin ("int8", "q4"), and the head of a tied
    model given its own, quantized from the embedding (whose lookup stays float). tensors: the file's,
    float32 weights [out, in] by torch name."""
    assert quant in ("int8", "q4")
    wanted = tensors if quant == "q4" else {}
    for prefix, parent, attribute in linear_layers(model):
        bias = getattr(parent, attribute).bias
        bias = None if bias is None else bias[...]
        weight = np.asarray(tensors[f"{prefix}.weight"], dtype=np.float32)  # [out, in]
        setattr(parent, attribute, quantized(f"{prefix}.weight", weight, bias, wanted, dtype))
    if model.config.tie_embeddings:
        head = quantized("emb.weight", np.asarray(tensors["emb.weight"], np.float32), None, wanted, dtype)
        untie_head(model, head)
    return model
