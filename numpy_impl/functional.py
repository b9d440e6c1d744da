"""What torch.nn.functional gives the reference, in NumPy: linear, the activations,
softmax and scaled_dot_product_attention, and a tensor's split. model.py imports this as `F`.
NumPy has no erf (SciPy's stands in), and the seed's GELU is the exact erf form."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy.special import erf


def gelu(x: np.ndarray) -> np.ndarray:
    # The exact erf form, as torch's default GELU. NumPy has no erf; SciPy's is one ufunc call,
    # accurate to float64 rounding.
    h = erf(x * 0.7071067811865476)  # 1 / sqrt(2)
    h += 1.0
    h *= x
    h *= 0.5
    return h


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(0.7978845608028654 * (x + 0.044715 * x**3)))  # sqrt(2 / pi)


def silu(x: np.ndarray) -> np.ndarray:
    # x / (1 + exp(-x)), as torch's kernel: exp overflows to inf below about -88 (float32), where
    # x / inf = -0 is the limit, so the warning is silenced rather than the exponent clamped (3 ufuncs
    # where the two-branch stable form took 8: most of a decode step's cost is per call, not per element).
    # One buffer for the three steps: a prompt's [T, ffn_dim] temporaries are fresh pages each call.
    with np.errstate(over="ignore"):
        h = np.negative(x)
        np.exp(h, out=h)
        h += 1.0
        return np.divide(x, h, out=h)


def softmax(x: np.ndarray, axis: int = -1, out: np.ndarray | None = None) -> np.ndarray:
    """out=x overwrites x: attention's scores, [B, H, T, S], are not needed after."""
    e = np.subtract(x, x.max(axis=axis, keepdims=True), out=out)  # every row sees itself, so max is finite
    np.exp(e, out=e)
    e /= e.sum(axis=axis, keepdims=True)
    return e


def log_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    shifted = x - x.max(axis=axis, keepdims=True)  # the largest is 0: exp cannot overflow
    return shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True))


def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    # One matrix product over every row, as torch's: x [B, T, in] @ weight.T would run B products of
    # [T, in], each reading the whole weight, and a decode step's T is 1.
    y = (x.reshape(-1, x.shape[-1]) @ weight.T).reshape(*x.shape[:-1], weight.shape[0])  # [..., out]: (out, in) weight
    if bias is not None:
        y += bias
    return y


def split(x: np.ndarray, sizes: Sequence[int]) -> list[np.ndarray]:
    """torch's x.split(sizes, dim=-1): views of consecutive pieces of the last axis. Slices, not
    np.split, whose Python bookkeeping costs more than a decode step's views."""
    pieces, start = [], 0
    for size in sizes:
        pieces.append(x[..., start : start + size])  # [..., size]
        start += size
    return pieces


def scaled_dot_product_attention(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    attn_mask: np.ndarray | None = None,
    enable_gqa: bool = False,
    scale: float | None = None,
) -> np.ndarray:
    """torch's F.scaled_dot_product_attention, as the model calls it: query [B, H, T, Dh] over key
    and value [B, Hkv, S, Dh]; attn_mask [B, 1, T, S] (one mask for every head), True = visible;
    Hkv < H only with enable_gqa; scale None: 1 / sqrt(Dh)."""
    B, H, T, Dh = query.shape
    Hkv = key.shape[1]
    if Hkv != H and not enable_gqa:
        raise ValueError(f"{H} query heads over {Hkv} key/value heads needs enable_gqa=True")
    # GQA by grouping: the G = H / Hkv query heads that share a k/v head are one matrix of G T rows,
    # one product per k/v head (larger products: BLAS's threads get work), and k, v are not copied.
    G, S = H // Hkv, key.shape[2]
    q = query.reshape(B, Hkv, G * T, Dh)  # [B, Hkv, G T, Dh]
    scores = (q @ key.swapaxes(-2, -1)).reshape(B, Hkv, G, T, S)  # [B, Hkv, G, T, S]
    scores *= 1.0 / math.sqrt(Dh) if scale is None else scale
    if attn_mask is not None:
        np.copyto(scores, -np.inf, where=~attn_mask[:, :, None])  # [B, Hkv, G, T, S]: in place
    probs = softmax(scores, axis=-1, out=scores)  # [B, Hkv, G, T, S]
    return (probs.reshape(B, Hkv, G * T, S) @ value).reshape(B, H, T, Dh)  # [B, H, T, Dh]
