"""bfloat16 weights in the layout XLA's CPU dot is fast in, swapped into a loaded model from outside.

nnx.Linear keeps its kernel (in, out). XLA's CPU runtime streams a bfloat16 product fast only
when the dot contracts the weight's contiguous axis, that is with the weight stored [out, in] as
torch stores it, and over a 2-d operand (functional.py's linear): measured with jax 0.10.2 at one
row, SmolLM2's FFN matrices take ~9 ms a step so and 210-220 ms stored [in, out]. float32 runs
the same either way and keeps nnx.Linear.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

import kvports.jax_impl.functional as F


class RowLinear(nnx.Module):
    """x [..., in] -> [..., out] through a float weight [out, in]: nnx.Linear, stored as torch stores it."""

    def __init__(self, weight: np.ndarray, bias: jax.Array | None, dtype: DTypeLike):
        self.weight = nnx.Param(jnp.asarray(weight, dtype=dtype))  # [out, in]
        self.bias = None if bias is None else nnx.Param(bias)  # [out]

    def __call__(self, x: jax.Array) -> jax.Array:
        return F.linear(x, self.weight[...], None if self.bias is None else self.bias[...])  # [..., out]


def linear_layers(model: nnx.Module) -> list[tuple[str, nnx.Module, str]]:
    """Every nnx.Linear as (its torch state_dict prefix, parent module, attribute name)."""
    layers = []
    for i, block in enumerate(model.blocks):
        layers += [(f"blocks.{i}.qkv", block, "qkv"), (f"blocks.{i}.proj", block, "proj")]
        layers += [(f"blocks.{i}.ffn.{j}", block.ffn, j) for j in ("0", "2")]
    if not model.config.tie_embeddings:
        layers.append(("head", model, "head"))
    return layers


def lay_out(
    model: nnx.Module, tensors: dict[str, np.ndarray], dtype: DTypeLike, linear: Callable[..., nnx.Module] = RowLinear
) -> nnx.Module:
    """Every nnx.Linear of `model` swapped for a RowLinear (or `linear`: row_loop.py's LoopLinear) over
    the file's weight [out, in] (tensors: float32 by torch name). A tied head already reads the
    embedding [V, D] so (model.py)."""
    for prefix, parent, attribute in linear_layers(model):
        bias = getattr(parent, attribute).bias
        weight = np.asarray(tensors[f"{prefix}.weight"], dtype=np.float32)  # [out, in]
        setattr(parent, attribute, linear(weight, None if bias is None else bias[...], dtype))
    return model
