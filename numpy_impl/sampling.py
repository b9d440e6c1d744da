"""The sampling rule in NumPy: how a row of logits becomes the next token.

Greedy at temperature 0; else temperature, top-k and top-p as transformers' warpers apply them,
softmax in float64 and a draw by a uniform each row brings with it (shared.generation.uniforms),
so every port draws the same token from the same logits. Read it beside torch_impl/sampling.py:
the same names in the same order.

Shapes: B batch, V vocabulary.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import numpy as np

import kvports.numpy_impl.functional as F
from kvports.shared.generation import PAD, GenerationConfig


def greedy(logits: np.ndarray) -> np.ndarray:
    return logits.argmax(axis=-1).astype(np.int64)  # [B, V] -> [B]; argmax gives intp


def filter_logits(logits: np.ndarray, top_k: Union[int, np.ndarray], top_p: Union[float, np.ndarray]) -> np.ndarray:
    """Top-k, then top-p (the smallest set of most likely tokens whose probability reaches
    top_p, the most likely always kept), as transformers' warpers do; the rest -inf. top_k and
    top_p: one value for every row, or one per row, [B, 1] (0 and 1: no filter), which filter
    exactly as the same values given one row at a time."""
    V = logits.shape[-1]
    if isinstance(top_k, np.ndarray):
        filtering = (0 < top_k) & (top_k < V)  # [B, 1]: a row with k 0 (or V) keeps every token
        if filtering.any():  # a step where no row filters skips the sort (JAX: lax.cond)
            kth = np.take_along_axis(-np.sort(-logits, axis=-1), np.clip(top_k - 1, 0, V - 1), axis=-1)  # [B, 1]
            logits = np.where(filtering & (logits < kth), -np.inf, logits)  # [B, V]
    elif 0 < top_k < V:
        kth = -np.partition(-logits, top_k - 1, axis=-1)[:, top_k - 1 : top_k]  # [B, 1]
        logits = np.where(logits < kth, -np.inf, logits)  # [B, V]; ties with the k-th stay
    # Per row, top_p 1 removes only what has probability 0 already: the same probabilities, so a
    # step where every row has it skips the sort
    if bool((top_p < 1.0).any()) if isinstance(top_p, np.ndarray) else top_p < 1.0:
        order = np.argsort(logits, axis=-1, kind="stable")  # [B, V], ascending
        ascending = np.take_along_axis(logits, order, axis=-1)  # [B, V]
        remove = F.softmax(ascending, axis=-1).cumsum(axis=-1) <= 1 - top_p  # [B, V], in ascending order
        remove[:, -1] = False
        in_vocab_order = np.empty_like(remove)
        np.put_along_axis(in_vocab_order, order, remove, axis=-1)
        logits = np.where(in_vocab_order, -np.inf, logits)  # [B, V]
    return logits


def probabilities(logits: np.ndarray, generation: GenerationConfig) -> np.ndarray:
    """logits [..., V] -> what sampling draws from [..., V]: the temperature, top-k and top-p,
    then softmax. In float64, so the ports' draws can differ only where their logits do."""
    logits = logits.astype(np.float64) / generation.temperature  # [..., V]
    shape = logits.shape
    return F.softmax(filter_logits(logits.reshape(-1, shape[-1]), generation.top_k, generation.top_p), axis=-1).reshape(
        shape
    )


def draw(probs: np.ndarray, uniform: np.ndarray) -> np.ndarray:
    """probs [B, V] (summing to any positive total), uniform [B] in [0, 1) -> tokens [B]: the
    first token whose cumulative probability exceeds the uniform's share of the total."""
    cumulative = probs.cumsum(axis=-1)  # [B, V]
    # [B]: tokens whose interval ends at or below it
    drawn = (cumulative <= uniform[:, None] * cumulative[:, -1:]).sum(axis=-1)
    return np.minimum(drawn, probs.shape[-1] - 1)


def sample(logits: np.ndarray, generation: GenerationConfig, uniform: np.ndarray) -> np.ndarray:
    """logits [B, V], uniform [B] in [0, 1) -> tokens [B]: greedy at temperature 0, else a draw
    from the filtered probabilities."""
    if generation.greedy:
        return greedy(logits)
    return draw(probabilities(logits, generation), uniform)


def choose(
    logits: np.ndarray, generation: GenerationConfig, uniform: np.ndarray, done: np.ndarray, stops: np.ndarray
) -> Tuple[np.ndarray, np.ndarray]:
    """Each row's next token [B] and whether it has stopped [B]: a stopped row stays stopped (PAD)."""
    token = sample(logits, generation, uniform)  # [B]
    if generation.stop_ids:  # without stop ids no row can stop: no bookkeeping
        token = np.where(done, PAD, token)
        done = done | np.isin(token, stops)
    return token, done


def sample_rows(
    logits: np.ndarray,
    temperature: np.ndarray,
    top_k: np.ndarray,
    top_p: np.ndarray,
    uniform: np.ndarray,
    allowed: Optional[np.ndarray] = None,
) -> np.ndarray:
    """Each row's next token [B] from logits [B, V] by its own settings, arrays [B] (temperature 0:
    greedy), the token it gets alone: values, not shapes, so one program serves any mix of them
    (JAX's compiles once). A row whose logits hold an inf or a NaN gets PAD: the engine stops there.
    allowed [B, V]: the tokens each row may take (a grammar's, from the host); the others -inf first."""
    finite = np.isfinite(logits).all(axis=-1)  # [B]: the model's own logits, before any mask
    if allowed is not None:
        logits = np.where(allowed, logits, -np.inf)  # [B, V]
    sampled = temperature > 0  # [B]
    tokens = greedy(logits)  # [B]
    if sampled.any():  # a greedy step skips the sort (JAX: lax.cond)
        scaled = logits.astype(np.float64) / np.where(sampled, temperature, 1.0)[:, None]  # [B, V]
        probs = F.softmax(filter_logits(scaled, top_k[:, None], top_p[:, None]), axis=-1)  # [B, V]
        tokens = np.where(sampled, draw(probs, uniform), tokens)  # [B]
    return np.where(finite, tokens, PAD)
