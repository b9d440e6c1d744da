"""NumPy has no erf: the port's exact GELU takes SciPy's, and must be exact enough for float64
tokens to match torch."""

from __future__ import annotations

import math

import numpy as np

from kvports.numpy_impl.functional import gelu


def test_gelu_is_the_exact_erf_form_to_float64_rounding():
    x = np.concatenate([np.linspace(-30, 30, 20_001), [0.46875, 4.0, -4.0, 1e-300, -1e-12, 5e-324]])
    expected = np.array([0.5 * value * (1.0 + math.erf(value / math.sqrt(2.0))) for value in x])
    # Far below zero, 1 + erf cancels to a few ulps in both: the bound is absolute there.
    np.testing.assert_allclose(gelu(x), expected, rtol=1e-14, atol=1e-15)


def test_gelu_keeps_float32_inputs_float32():
    assert gelu(np.linspace(-3, 3, 7, dtype=np.float32)).dtype == np.float32
