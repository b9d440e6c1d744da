"""The pieces of torch.nn.functional the JAX port writes itself, imported as `F` so model.py
reads as the reference: attention, because jax.nn.dot_product_attention takes its softmax in
float32 even in a float64 run, and float64 must agree with torch exactly; linear, for the layout
XLA's CPU dot is fast in."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def linear(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """torch's F.linear: x [..., in], weight [out, in] -> [..., out]."""
    # One matrix of rows: XLA's CPU runtime sends a bfloat16 dot over a 2-d operand to its fast
    # kernels, but one over [B, T, in] to a float32 dot on a converted copy of the whole weight,
    # each call (20x slower at one row; float32 runs the same either way).
    out = x.reshape(-1, x.shape[-1]) @ weight.T  # [B * T, out]
    out = out.reshape(*x.shape[:-1], weight.shape[0])  # [..., out]
    return out if bias is None else out + bias


def scaled_dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    attn_mask: jax.Array | None = None,
    enable_gqa: bool = False,
    scale: float | None = None,
) -> jax.Array:
    """torch's F.scaled_dot_product_attention, as the model calls it: query [B, H, T, Dh] over key
    and value [B, Hkv, S, Dh]; attn_mask [B, 1, T, S] (one mask for every head), True = visible;
    Hkv < H only with enable_gqa; scale None: 1 / sqrt(Dh)."""
    B, H, T, Dh = query.shape
    Hkv = key.shape[1]
    if Hkv != H and not enable_gqa:
        raise ValueError(f"{H} query heads over {Hkv} key/value heads needs enable_gqa=True")
    # GQA by grouping: each group of G = H / Hkv query heads shares one k/v head, nothing is copied.
    q = query.reshape(B, Hkv, H // Hkv, T, Dh)  # [B, Hkv, G, T, Dh]
    scores = jnp.einsum("bkgtd,bksd->bkgts", q, key)  # [B, Hkv, G, T, S]
    scores = scores / math.sqrt(Dh) if scale is None else scores * scale
    if attn_mask is not None:
        scores = jnp.where(attn_mask[:, :, None], scores, -jnp.inf)  # [B, Hkv, G, T, S]
    # [B, Hkv, G, T, S]: bfloat16 scores exponentiated and summed in float32
    probs = jax.nn.softmax(scores.astype(jnp.promote_types(scores.dtype, jnp.float32)), axis=-1).astype(value.dtype)
    return jnp.einsum("bkgts,bksd->bkgtd", probs, value).reshape(B, H, T, Dh)  # [B, H, T, Dh]
