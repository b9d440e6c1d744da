"""What torch.nn.functional gives the reference, in NumPy: linear, the activations,
softmax and scaled_dot_product_attention. model.py imports this as `F`. NumPy has no
erf, and the seed's GELU is the exact erf form."""

from __future__ import annotations

import math
from typing import Optional

import numpy as np


# W. J. Cody's rational Chebyshev approximations (Math. Comp. 1969; SPECFUN CALERF),
# accurate to float64 rounding: NumPy has no erf and the seed's GELU is the exact form.
_ERF_A = (3.16112374387056560e00, 1.13864154151050156e02, 3.77485237685302021e02,
          3.20937758913846947e03, 1.85777706184603153e-1)
_ERF_B = (2.36012909523441209e01, 2.44024637934444173e02, 1.28261652607737228e03,
          2.84423683343917062e03)
_ERF_C = (5.64188496988670089e-1, 8.88314979438837594e00, 6.61191906371416295e01,
          2.98635138197400131e02, 8.81952221241769090e02, 1.71204761263407058e03,
          2.05107837782607147e03, 1.23033935479799725e03, 2.15311535474403846e-8)
_ERF_D = (1.57449261107098347e01, 1.17693950891312499e02, 5.37181101862009858e02,
          1.62138957456669019e03, 3.29079923573345963e03, 4.36261909014324716e03,
          3.43936767414372164e03, 1.23033935480374942e03)
_ERF_P = (3.05326634961232344e-1, 3.60344899949804439e-1, 1.25781726111229246e-1,
          1.60837851487422766e-2, 6.58749161529837803e-4, 1.63153871373020978e-2)
_ERF_Q = (2.56852019228982242e00, 1.87295284992346047e00, 5.27905102951428412e-1,
          6.05183413124413191e-2, 2.33520497626869185e-3)


# The helpers below work in place: on large activations, fresh temporaries cost more
# than the arithmetic itself.
def _ratio(t: np.ndarray, num_coef, den_coef) -> np.ndarray:
    # Cody's Horner form: num has one coefficient more than den, den's leading one is 1.
    num, den = num_coef[-1] * t, t.copy()
    for a, b in zip(num_coef[:-2], den_coef[:-1]):
        num += a
        num *= t
        den += b
        den *= t
    num += num_coef[-2]
    den += den_coef[-1]
    num /= den
    return num


def _times_exp_minus_square(y: np.ndarray, value: np.ndarray) -> np.ndarray:
    # value * exp(-y^2), with exp(-y^2) = exp(-r^2) * exp(-(y - r)(y + r)) and r = y cut to
    # 1/16: r^2 is exact, so the large exponent loses no bits.
    r = np.trunc(y * 16.0)
    r /= 16.0
    d = y - r
    d *= y + r
    value *= np.exp(np.negative(d, out=d), out=d)
    r *= r
    value *= np.exp(np.negative(r, out=r), out=r)
    return value


def erf(x: np.ndarray) -> np.ndarray:
    """erf in float64 whatever the input dtype; the caller casts back."""
    x = np.asarray(x, dtype=np.float64)
    shape, x = x.shape, x.reshape(-1)
    y = np.abs(x)
    out = np.empty_like(x)
    # Each interval is evaluated only on its own elements, picked by integer index: boolean
    # masks of random density gather and scatter several times slower.
    small = np.flatnonzero(y <= 0.46875)
    mid = np.flatnonzero((y > 0.46875) & (y <= 4.0))
    big = np.flatnonzero(~(y <= 4.0))  # also NaN, which the arithmetic below carries through
    xs = x[small]
    out[small] = xs * _ratio(xs * xs, _ERF_A, _ERF_B)  # erf directly; odd, so the sign comes free
    ym = y[mid]
    erfc = _times_exp_minus_square(ym, _ratio(ym, _ERF_C, _ERF_D))
    out[mid] = np.copysign(np.subtract(1.0, erfc, out=erfc), x[mid], out=erfc)
    # Past 27 erfc underflows to 0 anyway; the clip keeps inf out of y - r.
    yb = np.minimum(y[big], 27.0)
    z = 1.0 / (yb * yb)
    erfc = np.subtract(0.56418958354775628695, z * _ratio(z, _ERF_P, _ERF_Q)) / yb  # 1/sqrt(pi) - ...
    erfc = _times_exp_minus_square(yb, erfc)
    out[big] = np.copysign(np.subtract(1.0, erfc, out=erfc), x[big], out=erfc)
    return out.reshape(shape)


def gelu(x: np.ndarray) -> np.ndarray:
    # Exact erf form: the erf in float64, then back to the model's dtype.
    x64 = x.astype(np.float64)
    h = erf(x64 * 0.7071067811865476)  # 1 / sqrt(2)
    h += 1.0
    h *= x64
    h *= 0.5
    return h.astype(x.dtype, copy=False)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))  # sqrt(2 / pi)


def silu(x: np.ndarray) -> np.ndarray:
    # x * sigmoid(x) with exp of a non-positive number only: no overflow for large |x|.
    e = np.exp(-np.abs(x))
    return x * np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))  # every row sees itself, so max is finite
    e /= e.sum(axis=axis, keepdims=True)
    return e


def linear(x: np.ndarray, weight: np.ndarray, bias: Optional[np.ndarray] = None) -> np.ndarray:
    # One matrix product over every row, as torch's: x [B, T, in] @ weight.T would run B products of
    # [T, in], each reading the whole weight, and a decode step's T is 1.
    y = (x.reshape(-1, x.shape[-1]) @ weight.T).reshape(*x.shape[:-1], weight.shape[0])  # [..., out]: weight is (out, in)
    if bias is not None:
        y += bias
    return y


def scaled_dot_product_attention(query: np.ndarray, key: np.ndarray, value: np.ndarray,
                                 attn_mask: Optional[np.ndarray] = None, enable_gqa: bool = False) -> np.ndarray:
    """torch's F.scaled_dot_product_attention, as the model calls it: query [B, H, T, Dh] over key
    and value [B, Hkv, S, Dh]; attn_mask [B, 1, T, S] (one mask for every head), True = visible;
    Hkv < H only with enable_gqa."""
    B, H, T, Dh = query.shape
    Hkv = key.shape[1]
    if Hkv != H and not enable_gqa:
        raise ValueError(f"{H} query heads over {Hkv} key/value heads needs enable_gqa=True")
    # GQA by grouping: each group of G = H / Hkv query heads shares one k/v head, nothing is copied.
    q = query.reshape(B, Hkv, H // Hkv, T, Dh)  # [B, Hkv, G, T, Dh]
    scores = q @ key[:, :, None].swapaxes(-2, -1)  # [B, Hkv, G, T, S]
    scores *= 1.0 / math.sqrt(Dh)
    if attn_mask is not None:
        scores = np.where(attn_mask[:, :, None], scores, -np.inf)  # [B, Hkv, G, T, S]
    probs = softmax(scores, axis=-1)  # [B, Hkv, G, T, S]
    return (probs @ value[:, :, None]).reshape(B, H, T, Dh)  # [B, H, T, Dh]
