"""Assertions shared by the test files."""

from __future__ import annotations

import warnings

import numpy as np

from kvports.shared.compare import NEAR_TIE, compare_tokens


def assert_tokens_agree(reference_tokens, reference_logits, tokens, prompt_len, label=""):
    """Equal tokens, or a divergence at a float near-tie of the reference (margin < NEAR_TIE),
    which is reported, not failed: two frameworks' float32 logits differ in the last bits."""
    agreement = compare_tokens(reference_tokens, tokens, prompt_len, reference_logits)
    if agreement.agree:
        return agreement
    assert agreement.explained, f"{label}: {agreement.describe()}"
    warnings.warn(f"{label}: {agreement.describe()}")
    return agreement


def assert_logits_close(reference_logits, logits, atol, agreement=None, label=""):
    """Step logits allclose up to the first divergent step (after it the histories differ)."""
    steps = reference_logits.shape[1] if agreement is None or agreement.agree else agreement.first_divergent_step + 1
    np.testing.assert_allclose(logits[:, :steps], reference_logits[:, :steps], atol=atol, rtol=0, err_msg=label)
