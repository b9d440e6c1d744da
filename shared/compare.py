"""Token comparison with the diagnostics float32 needs.

Two frameworks compute float32 logits that differ in the last bits; where the
reference's top two logits are closer than that noise, argmax may pick either and
the continuations part. That is a near-tie, not a bug, and is reported as one:
the first divergent step and the reference's top-2 margin there. A sampled step has
its own near-ties: a draw that lands within that noise of the edge between two tokens'
probability intervals (or a logit that close to the top-k or top-p cut).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from kvports.shared.generation import GenerationConfig, uniforms

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
        draws = uniforms(generation.seed, generated.shape[0], generation.max_new_tokens)  # [B, N]
        margin = draw_margin(reference_logits[row, step], generation, float(draws[row, step]))
    return Agreement(False, step, row, margin, margin < NEAR_TIE)
