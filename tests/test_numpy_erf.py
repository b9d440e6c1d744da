"""NumPy has no erf; the port's own must be exact enough for float64 tokens to match torch."""

from __future__ import annotations

import math

import numpy as np

from kvports.numpy_impl.functional import erf, gelu


def test_erf_matches_math_erf_to_float64_rounding():
    x = np.concatenate([np.linspace(-30, 30, 200_001), [0.46875, 4.0, -4.0, 1e-300, -1e-12, 5e-324, 1e300, -1e300]])
    expected = np.array([math.erf(value) for value in x])
    relative = np.abs(erf(x) - expected) / np.maximum(np.abs(expected), np.finfo(np.float64).tiny)
    assert relative.max() < 1e-14


def test_erf_keeps_signed_zero_infinities_and_nan():
    result = erf(np.array([0.0, -0.0, np.inf, -np.inf, np.nan]))
    assert result[0] == 0.0 and math.copysign(1.0, result[1]) == -1.0
    assert result[2] == 1.0 and result[3] == -1.0 and np.isnan(result[4])


def test_gelu_keeps_float32_inputs_float32():
    assert gelu(np.linspace(-3, 3, 7, dtype=np.float32)).dtype == np.float32
