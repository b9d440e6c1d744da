"""Token comparison with the diagnostics float32 needs.

Two frameworks compute float32 logits that differ in the last bits; where the
reference's top two logits are closer than that noise, argmax may pick either and
the continuations part. That is a near-tie, not a bug, and is reported as one:
the first divergent step and the reference's top-2 margin there. A sampled step has
its own near-ties: a draw that lands within that noise of the edge between two tokens'
probability intervals (or a logit that close to the top-k or top-p cut).

Beyond agreement, how close: `logit_difference` gives the largest and the mean
|logit - reference logit| over the steps both ran on the same history (or, teacher-forced,
over every step), and the step where it peaks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from kvports.shared.generation import PAD, GenerationConfig, uniforms

NEAR_TIE = 1e-4  # far above float32 noise between frameworks (~1e-6), far below typical margins


@dataclass
class Agreement:
    agree: bool  # every token equal
    first_divergent_step: int | None  # 0-based index among the generated tokens
    divergent_row: int | None  # which prompt of the batch
    reference_margin: float | None  # greedy: the reference's top-1 minus top-2 logit there; sampled: see draw_margin
    explained: bool  # agree, or diverged at a near-tie (margin below NEAR_TIE)

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        if self.agree:
            return "agrees"
        return (
            f"diverges at step {self.first_divergent_step} (row {self.divergent_row}), reference margin "
            f"{self.reference_margin:.2e}: " + ("a float near-tie" if self.explained else "NOT a near-tie")
        )


def top2_margin(logits: np.ndarray) -> float:
    """Top-1 minus top-2 logit of one row [V]."""
    top2 = np.partition(np.asarray(logits, dtype=np.float64), -2)[-2:]  # [2]
    return float(top2[1] - top2[0])


def draw_margin(logits: np.ndarray, generation: GenerationConfig, uniform: float) -> float:
    """How close one sampled step [V] came to another token: the smallest of the draw's distance
    to the edges of the probability intervals, the gap at the top-k cut (in logits over the
    temperature) and the distance of the top-p cut from top_p. The ports' rule, in NumPy float64."""
    scaled = np.asarray(logits, dtype=np.float64) / generation.temperature  # [V]
    margins = [np.inf]
    descending = np.sort(scaled)[::-1]  # [V]
    if 0 < generation.top_k < len(scaled):
        margins.append(descending[generation.top_k - 1] - descending[generation.top_k])
        scaled = np.where(scaled < descending[generation.top_k - 1], -np.inf, scaled)
    if generation.top_p < 1:
        kept = np.sort(scaled)[::-1]
        cumulative = np.cumsum(np.exp(kept - kept[0]) / np.exp(kept - kept[0]).sum())  # [V], most likely first
        margins.append(float(np.min(np.abs(cumulative[:-1] - generation.top_p))) if len(kept) > 1 else np.inf)
        cut = kept[int(np.searchsorted(cumulative, generation.top_p))]  # the least likely token kept
        scaled = np.where(scaled < cut, -np.inf, scaled)
    probs = np.exp(scaled - scaled.max())
    cumulative = np.cumsum(probs / probs.sum())  # [V], in vocabulary order, as the ports draw
    margins.append(float(np.min(np.abs(cumulative - uniform))))
    return float(min(margins))


def compare_tokens(
    reference_tokens: np.ndarray,
    tokens: np.ndarray,
    prompt_len: int,
    reference_logits: np.ndarray | None,
    generation: GenerationConfig | None = None,
) -> Agreement:
    """reference_tokens, tokens: [B, P + N] (PAD after a stopped row); reference_logits: [B, steps, V],
    the reference's step logits (None: a divergence cannot be explained); generation: the settings
    both ran with (None: greedy)."""
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
    if reference_logits is None or step >= reference_logits.shape[1]:
        return Agreement(False, step, row, None, False)
    if generation is None or generation.greedy:
        margin = top2_margin(reference_logits[row, step])
    else:
        draws = uniforms(generation.row_seeds(generated.shape[0]), generation.max_new_tokens)  # [B, N]
        margin = draw_margin(reference_logits[row, step], generation, float(draws[row, step]))
    return Agreement(False, step, row, margin, margin < NEAR_TIE)


@dataclass
class LogitDifference:
    """|logits - reference logits| over the (row, step) pairs compared: how close two ports are."""

    max_abs_diff: float
    mean_abs_diff: float  # over every logit of every compared step
    peak_step: int  # 0-based generated step where the largest difference sits
    peak_row: int
    steps_compared: int  # (row, step) pairs
    teacher_forced: bool  # both fed the reference's tokens, so every step is comparable

    def as_dict(self) -> dict:
        return asdict(self)


def comparable_steps(reference_tokens: np.ndarray, tokens: np.ndarray, prompt_len: int) -> np.ndarray:
    """[B, N] bool: the steps where both ran on the same history and the reference row was still
    generating: each row up to and including its own first divergent step (the step's logits
    came from equal histories; only the choice between them differed)."""
    generated_ref = np.asarray(reference_tokens)[:, prompt_len:]  # [B, N]
    differs = generated_ref != np.asarray(tokens)[:, prompt_len:]  # [B, N]
    diverged_before = np.cumsum(differs, axis=1) - differs > 0  # [B, N]: a divergence at an earlier step
    return (generated_ref != PAD) & ~diverged_before


def logit_difference(
    reference_logits: np.ndarray, logits: np.ndarray, compared: np.ndarray, teacher_forced: bool
) -> LogitDifference | None:
    """reference_logits, logits: [B, steps, V] (steps may stop short of N when every row stopped);
    compared: [B, N] bool, which (row, step) pairs to take. None when nothing is comparable."""
    steps = min(reference_logits.shape[1], logits.shape[1], compared.shape[1])
    compared = compared[:, :steps]  # [B, steps]
    if not compared.any():
        return None
    difference = np.abs(
        np.asarray(logits[:, :steps], dtype=np.float64) - np.asarray(reference_logits[:, :steps], dtype=np.float64)
    )  # [B, steps, V]
    largest = np.where(compared, difference.max(axis=2), -1.0)  # [B, steps]: -1 where not compared
    row, step = np.unravel_index(int(np.argmax(largest)), largest.shape)
    return LogitDifference(
        max_abs_diff=float(largest[row, step]),
        mean_abs_diff=float(difference[compared].mean()),
        peak_step=int(step),
        peak_row=int(row),
        steps_compared=int(compared.sum()),
        teacher_forced=teacher_forced,
    )
