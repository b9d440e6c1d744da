"""How to generate, framework-neutral: the settings every port's generators take, the
random numbers their sampling draws, prompts of different lengths, and stop tokens.

Sampling agrees across frameworks because nothing random happens inside a framework:
each row's uniforms come from NumPy's counter-based Philox generator, keyed by that row's
seed alone (not its place in the batch: a row gets the tokens it gets alone), one number
per step, and every port turns the same logits and the same uniform into the same token
by the same rule (temperature, top-k, top-p, then the draw: the first token whose
cumulative probability passes the uniform).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from kvports.shared.checks import check_generation, python_value
from kvports.shared.errors import NonFiniteLogits

PAD = -1  # in a token array: left padding of a short prompt, or a slot after a row stopped


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy, the argmax (bit for bit the path without sampling)
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1: no nucleus filter
    seed: int = 0
    stop_ids: tuple[int, ...] = ()  # a row ends after it emits any of these (kept as its last token)
    seeds: tuple[int, ...] = ()  # one seed per row; empty: every row uses `seed`

    def __post_init__(self) -> None:
        # NumPy scalars are taken as the Python values they hold (checks.python_value).
        for field in ("max_new_tokens", "temperature", "top_k", "top_p", "seed"):
            object.__setattr__(self, field, python_value(getattr(self, field)))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def row_seeds(self, batch: int) -> tuple[int, ...]:
        """Each row's seed: `seeds` (checked to have one per row, `checks.check_seeds`), else `seed` for every row."""
        return self.seeds if self.seeds else (self.seed,) * batch

    def validate(self, vocab_size: int) -> GenerationConfig:
        """The same one-line errors for every port, before any framework code runs (`checks.check_generation`)."""
        check_generation(self, vocab_size)
        return self


def as_generation(generation: int | GenerationConfig) -> GenerationConfig:
    """An int means that many greedy tokens with no stop tokens: the common case in tests and timings."""
    if isinstance(generation, GenerationConfig):
        return generation
    return GenerationConfig(max_new_tokens=generation)


def uniforms(seeds: Sequence[int], steps: int) -> np.ndarray:
    """The draws of a sampled generation, [B, N] float64 in [0, 1), one row per seed: a row's
    stream is Philox keyed by its seed alone, one number per step, so its draws depend on
    nothing else (not its place in the batch, nor how many steps are asked for)."""
    rows = [
        np.random.Generator(np.random.Philox(key=np.array([seed, 0], dtype=np.uint64))).random(steps) for seed in seeds
    ]
    return np.stack(rows) if rows else np.zeros((0, steps))  # [B, N]


def speculative_uniforms(seeds: Sequence[int], steps: int, draft_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """The draws of speculative sampling from the same per-row streams: one for the token after
    the prompt [B], then 2K + 1 per round [B, N, 2K + 1] (K for the draft's proposals, K to
    accept them, one for the token after them), whether or not a round uses them all."""
    width = 2 * draft_tokens + 1
    draws = uniforms(seeds, 1 + steps * width)  # [B, 1 + N (2K + 1)]
    return draws[:, 0], draws[:, 1:].reshape(len(draws), steps, width)


def repeat_samples(
    prompts: Sequence[Sequence[int]], generation: GenerationConfig, num_samples: int
) -> tuple[list[list[int]], GenerationConfig]:
    """Each prompt num_samples times in a row, prompt i's copies seeded s_i, s_i + 1, ...,
    s_i + num_samples - 1 (s_i its seed): several samples of one prompt in one batch, each the
    tokens that prompt gets alone with that seed. Checked first (`checks.check_samples`)."""
    seeds = generation.row_seeds(len(prompts))
    rows = [list(prompt) for prompt in prompts for _ in range(num_samples)]
    row_seeds = tuple(seed + sample for seed in seeds for sample in range(num_samples))
    return rows, replace(generation, seed=row_seeds[0], seeds=row_seeds if len(rows) > 1 else ())


@dataclass(frozen=True)
class RowSampling:
    """Each row's sampling settings as arrays [B], not as a setting per group of rows: values, not
    shapes, so one compiled program serves any mix of them (the batching engine's steps)."""

    temperature: np.ndarray  # [B] float64: 0 where greedy
    top_k: np.ndarray  # [B] int64: 0 for no top-k filter
    top_p: np.ndarray  # [B] float64: 1 for no nucleus filter
    uniform: np.ndarray  # [B] float64: each row's draw for the token it samples (0 where greedy)
    # [B, V] bool: the tokens each row may take next (a structured output's grammar, computed on the host
    # by kvports.batching.constraint), the rest set to -inf before the sampling rule; None: every token.
    allowed: np.ndarray | None = None

    @staticmethod
    def of(generations: Sequence[GenerationConfig], uniform: np.ndarray) -> RowSampling:
        return RowSampling(
            np.asarray([generation.temperature for generation in generations], dtype=np.float64).reshape(-1),
            np.asarray([generation.top_k for generation in generations], dtype=np.int64).reshape(-1),
            np.asarray([generation.top_p for generation in generations], dtype=np.float64).reshape(-1),
            np.asarray(uniform, dtype=np.float64).reshape(-1),
        )


def check_finite(nonfinite: Sequence[int], dtype: str) -> None:
    """nonfinite: (step, row) of the first step whose logits held an inf or a NaN in a running row,
    (-1, -1) while none did (what every port's loops carry): raise NonFiniteLogits for it."""
    step, row = (int(value) for value in nonfinite)
    if step >= 0:
        raise NonFiniteLogits(step, f"row {row}", dtype_name(dtype))


def dtype_name(dtype: object) -> str:
    """ "float32" for NumPy's and JAX's float32 and for torch.float32."""
    return str(dtype).removeprefix("torch.")


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


def token_logprobs(logits: np.ndarray, tokens: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What every front door reports of a step, from the model's own distribution (log-softmax in
    float64 of the raw logits [B, V], before temperature, top-k and top-p): the chosen tokens' [B]
    log-probabilities [B], and the `top` likeliest ids and their log-probabilities [B, top],
    likeliest first, ties broken by the lower id. One function on the host, so the command line,
    the API, batch files and the server report the same values, whichever port made the logits."""
    logits = np.asarray(logits, dtype=np.float64)  # [B, V]
    shifted = logits - logits.max(axis=-1, keepdims=True)  # [B, V]
    logprobs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))  # [B, V]
    chosen = np.take_along_axis(logprobs, np.maximum(tokens, 0)[:, None], axis=-1)[:, 0]  # [B]: PAD rows end anyway
    top = min(top, logprobs.shape[-1])
    top_ids = np.array([likeliest(row, top) for row in logprobs], dtype=np.int64).reshape(-1, top)  # [B, top]
    return chosen, top_ids, np.take_along_axis(logprobs, top_ids, axis=-1)  # [B], [B, top], [B, top]


def step_logprobs(
    logits: np.ndarray, tokens: np.ndarray, next_tokens: np.ndarray, top: int, every_position: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """token_logprobs of a batching step: the new tokens' from the last position's logits [B, V]
    ([B], [B, top] x 2), or, every_position, each position's from logits [B, T, V] (a prompt's own:
    position t scores tokens [B, T]'s token at t + 1, the last position the new token; [B, T],
    [B, T, top] x 2)."""
    if not every_position:
        return token_logprobs(logits, next_tokens, top)
    B, T = tokens.shape
    targets = np.concatenate([tokens[:, 1:], next_tokens[:, None]], axis=1)  # [B, T]: what each position predicts
    chosen, top_ids, top_logprobs = token_logprobs(logits.reshape(B * T, -1), targets.reshape(-1), top)
    return chosen.reshape(B, T), top_ids.reshape(B, T, -1), top_logprobs.reshape(B, T, -1)


def likeliest(logprobs: np.ndarray, top: int) -> np.ndarray:
    """The `top` likeliest ids of one step's logprobs [V], likeliest first, ties by the lower id.
    Every id as likely as the top-th is a candidate (a partition alone picks among ties in no set
    order), and only they are sorted: a step sorts a few ids, not the vocabulary."""
    if top == 0:
        return np.zeros(0, dtype=np.int64)
    kth = np.partition(logprobs, len(logprobs) - top)[len(logprobs) - top]
    candidates = np.flatnonzero(logprobs >= kth)  # [>= top]; fewer only where a NaN is: then every id
    if len(candidates) < top:
        candidates = np.arange(len(logprobs))
    return candidates[np.lexsort((candidates, -logprobs[candidates]))][:top]  # [top]
