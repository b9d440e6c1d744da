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
