"""Token comparison with the diagnostics float32 needs.

Two frameworks compute float32 logits that differ in the last bits; where the
reference's top two logits are closer than that noise, argmax may pick either and
the continuations part. That is a near-tie, not a bug, and is reported as one:
the first divergent step and the reference's top-2 margin there.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

NEAR_TIE = 1e-4  # far above float32 noise between frameworks (~1e-6), far below typical margins


@dataclass
class Agreement:
    agree: bool  # every token equal
    first_divergent_step: int | None  # 0-based index among the generated tokens
    divergent_row: int | None  # which prompt of the batch
    reference_margin: float | None  # top-1 minus top-2 logit of the reference at that step
    explained: bool  # agree, or diverged at a near-tie (margin below NEAR_TIE)

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        if self.agree:
            return "agrees"
        return (
            f"diverges at step {self.first_divergent_step} (row {self.divergent_row}), reference top-2 margin "
            f"{self.reference_margin:.2e}: " + ("a float near-tie" if self.explained else "NOT a near-tie")
        )


def top2_margin(logits: np.ndarray) -> float:
    """Top-1 minus top-2 logit of one row [V]."""
    top2 = np.partition(np.asarray(logits, dtype=np.float64), -2)[-2:]  # [2]
    return float(top2[1] - top2[0])


def compare_tokens(
    reference_tokens: np.ndarray, tokens: np.ndarray, prompt_len: int, reference_logits: np.ndarray
) -> Agreement:
    """reference_tokens, tokens: [B, P + N]; reference_logits: [B, N, V] (the reference's step logits)."""
    generated_ref = np.asarray(reference_tokens)[:, prompt_len:]  # [B, N]
    generated = np.asarray(tokens)[:, prompt_len:]  # [B, N]
    if generated.shape != generated_ref.shape:
        raise ValueError(f"token arrays differ in shape: {generated.shape} vs {generated_ref.shape}")
    differs = generated != generated_ref  # [B, N]
    if not differs.any():
        return Agreement(True, None, None, None, True)
    steps = np.where(differs.any(axis=0))[0]
    step = int(steps[0])
    row = int(np.where(differs[:, step])[0][0])
    margin = top2_margin(reference_logits[row, step])
    return Agreement(False, step, row, margin, margin < NEAR_TIE)
