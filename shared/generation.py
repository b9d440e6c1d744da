"""How to generate, framework-neutral: the settings every port's generators take, the
random numbers their sampling draws, prompts of different lengths, and stop tokens.

Sampling agrees across frameworks because nothing random happens inside a framework:
each row's uniforms come from NumPy's counter-based Philox generator, keyed by the seed
and the row, one number per step, and every port turns the same logits and the same
uniform into the same token by the same rule (temperature, top-k, top-p, then the draw:
the first token whose cumulative probability passes the uniform).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvports.shared.checks import check_generation

PAD = -1  # in a token array: left padding of a short prompt, or a slot after a row stopped


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy, the argmax (bit for bit the path without sampling)
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1: no nucleus filter
    seed: int = 0
    stop_ids: tuple[int, ...] = ()  # a row ends after it emits any of these (kept as its last token)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int) -> GenerationConfig:
        """The same one-line errors for every port, before any framework code runs (`checks.check_generation`)."""
        check_generation(self, vocab_size)
        return self


def as_generation(generation: int | GenerationConfig) -> GenerationConfig:
    """An int means that many greedy tokens with no stop tokens: the common case in tests and timings."""
    if isinstance(generation, GenerationConfig):
        return generation
    return GenerationConfig(max_new_tokens=generation)


def uniforms(seed: int, batch: int, steps: int) -> np.ndarray:
    """The draws of a sampled generation, [B, N] float64 in [0, 1): row b's stream is Philox
    keyed by (seed, b), one number per step, so a row's draws depend on nothing else."""
    rows = [
        np.random.Generator(np.random.Philox(key=np.array([seed, row], dtype=np.uint64))).random(steps)
        for row in range(batch)
    ]
    return np.stack(rows) if rows else np.zeros((0, steps))  # [B, N]


def speculative_uniforms(seed: int, batch: int, steps: int, draft_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """The draws of speculative sampling from the same per-row streams: one for the token after
    the prompt [B], then 2K + 1 per round [B, N, 2K + 1] (K for the draft's proposals, K to
    accept them, one for the token after them), whether or not a round uses them all."""
    width = 2 * draft_tokens + 1
    draws = uniforms(seed, batch, 1 + steps * width)  # [B, 1 + N (2K + 1)]
    return draws[:, 0], draws[:, 1:].reshape(batch, steps, width)


def pad_prompts(prompts: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Prompts of different lengths as one left-padded batch [B, P] (PAD where a row is
    shorter) and each row's padding [B]: every row's last prompt token sits in column P - 1,
    so one decode step serves them all."""
    P = max(len(prompt) for prompt in prompts)
    tokens = np.full((len(prompts), P), PAD, dtype=np.int64)  # [B, P]
    for row, prompt in enumerate(prompts):
        tokens[row, P - len(prompt) :] = prompt
    return tokens, (tokens == PAD).sum(axis=1).astype(np.int64)  # [B, P], [B]


def row_tokens(tokens: np.ndarray) -> list[list[int]]:
    """Each row's prompt and generated tokens, padding dropped: rows of different lengths."""
    return [[int(token) for token in row if token != PAD] for row in np.asarray(tokens)]


def finish_reasons(tokens: np.ndarray, prompt_len: int, stop_ids: Sequence[int]) -> list[str]:
    """'stop' for a row whose last generated token is a stop id, else 'length'."""
    reasons = []
    for row in np.asarray(tokens)[:, prompt_len:]:
        generated = row[row != PAD]
        reasons.append("stop" if len(generated) and int(generated[-1]) in set(stop_ids) else "length")
    return reasons
