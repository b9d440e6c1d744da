"""The assertions that hold one run to another: tensors equal, tokens equal up to a float near-tie,
step logits close up to the first divergence."""

from __future__ import annotations

import warnings

import numpy as np

from kvports.agreement import Agreement, compare_tokens


def assert_same_tensors(expected: dict[str, np.ndarray], actual: dict[str, np.ndarray]) -> None:
    assert sorted(actual) == sorted(expected)
    for name in expected:
        np.testing.assert_array_equal(actual[name], expected[name], err_msg=name)


def assert_tokens_agree(
    reference_tokens: np.ndarray, reference_logits: np.ndarray, tokens: np.ndarray, prompt_len: int, label: str = ""
) -> Agreement:
    """Equal tokens, or a divergence at a float near-tie of the reference (margin < NEAR_TIE),
    which is reported, not failed: two frameworks' float32 logits differ in the last bits."""
    agreement = compare_tokens(reference_tokens, tokens, prompt_len, reference_logits)
    if agreement.agree:
        return agreement
    assert agreement.explained, f"{label}: {agreement.describe()}"
    warnings.warn(f"{label}: {agreement.describe()}", stacklevel=2)
    return agreement


def assert_logits_close(
    reference_logits: np.ndarray, logits: np.ndarray, atol: float, agreement: Agreement | None = None, label: str = ""
) -> None:
    """Step logits allclose up to the first divergent step (after it the histories differ)."""
    steps = reference_logits.shape[1] if agreement is None or agreement.agree else agreement.first_divergent_step + 1
    np.testing.assert_allclose(logits[:, :steps], reference_logits[:, :steps], atol=atol, rtol=0, err_msg=label)


# The largest |logit difference| from float32 each format may cost, relative to the largest |logit|:
# bfloat16 keeps 8 bits of mantissa (2**-8 = 0.4% a product, compounded over the layers; every port's
# RMSNorm rounds to bfloat16 before its gain, as transformers' does: 6% on the tiny Q4_1 file of
# tests/test_accepted.py, whose weights are large); int8 rounds
# each weight to 1/254 of its row's largest (on SmolLM2, whose file already rounded them to 4 bits, 1.6 of
# a largest logit of 32-35: docs/PRECISION.md); q4's kernels round its scales to bfloat16; float64 and
# another load path of float32 differ from float32 in the last bits only.
RELATIVE_COST = {"float32": 1e-4, "float64": 1e-4, "bfloat16": 0.08, "int8": 0.08, "q4": 0.05, "none": 0.0}


def format_cost(dtype: str, quant: str) -> float:
    return RELATIVE_COST[dtype] + RELATIVE_COST[quant]  # two roundings add up


def assert_within_format_distance(
    tokens32: np.ndarray,
    logits32: np.ndarray | None,
    tokens: np.ndarray,
    logits: np.ndarray | None,
    prompt_len: int,
    dtype: str,
    quant: str,
    label: str = "",
) -> None:
    """Tokens [B, P + N] and step logits [B, N, V] (None: tokens alone) of one format against float32's:
    the logits within the format's cost (RELATIVE_COST) up to the first divergence, and a divergence
    only where float32's top two are closer than what the format moved (or, without logits, than
    the format's cost)."""
    from kvports.agreement import comparable_steps, logit_difference, top2_margin

    assert tokens.shape == tokens32.shape, (label, tokens.shape, tokens32.shape)
    allowed = format_cost(dtype, quant) * (np.abs(logits32).max() if logits32 is not None else 1.0)
    if logits is not None and logits32 is not None:
        assert logits.dtype == np.float32 or logits.dtype == np.float64, (label, logits.dtype)
        difference = logit_difference(logits32, logits, comparable_steps(tokens32, tokens, prompt_len), False)
        assert difference is not None and difference.max_abs_diff <= allowed, (label, difference, allowed)
    agreement = compare_tokens(tokens32, tokens, prompt_len, logits32)
    if agreement.agree:
        return
    assert logits32 is not None, f"{label}: {agreement.describe()}"
    row, step = agreement.divergent_row, agreement.first_divergent_step
    moved = np.abs(logits[row, step] - logits32[row, step]).max() if logits is not None else allowed
    assert top2_margin(logits32[row, step]) <= 2 * moved, f"{label}: {agreement.describe()}"
