"""The sampling rule in JAX: how a row of logits becomes the next token.

Greedy at temperature 0; else temperature, top-k and top-p as transformers' warpers apply them,
softmax in float64 and a draw by a uniform each row brings with it (shared.generation.uniforms),
so every port draws the same token from the same logits. Read it beside torch_impl/sampling.py:
the same names in the same order. Every function here traces into the compiled loops.

Shapes: B batch, V vocabulary.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp
from jax import lax

from kvports.shared.generation import PAD, GenerationConfig


def greedy(logits: jax.Array) -> jax.Array:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, V] -> [B]


def filter_logits(logits: jax.Array, top_k: Union[int, jax.Array], top_p: Union[float, jax.Array]) -> jax.Array:
    """Top-k, then top-p (the smallest set of most likely tokens whose probability reaches
    top_p, the most likely always kept), as transformers' warpers do; the rest -inf. top_k and
    top_p: one value for every row, or one per row, [B, 1] (0 and 1: no filter), which filter
    exactly as the same values given one row at a time (traced: one program for any values)."""
    V = logits.shape[-1]
    if isinstance(top_k, jax.Array):  # lax.top_k takes one static k: one sort serves every row's
        filtering = (0 < top_k) & (top_k < V)  # [B, 1]: a row with k 0 (or V) keeps every token

        def keep_top_k(logits: jax.Array) -> jax.Array:
            descending = jnp.sort(logits, axis=-1, descending=True)  # [B, V]
            kth = jnp.take_along_axis(descending, jnp.clip(top_k - 1, 0, V - 1), axis=-1)  # [B, 1]
            return jnp.where(filtering & (logits < kth), -jnp.inf, logits)  # [B, V]

        # A step where no row filters skips the sort: a traced condition (torch and NumPy look at the host)
        logits = lax.cond(jnp.any(filtering), keep_top_k, lambda logits: logits, logits)
    elif 0 < top_k < V:
        kth = lax.top_k(logits, top_k)[0][:, -1:]  # [B, 1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)  # [B, V]; ties with the k-th stay

    def nucleus(logits: jax.Array) -> jax.Array:
        order = jnp.argsort(logits, axis=-1, stable=True)  # [B, V], ascending
        ascending = jnp.take_along_axis(logits, order, axis=-1)  # [B, V]
        remove = jnp.cumsum(jax.nn.softmax(ascending, axis=-1), axis=-1) <= 1 - top_p  # [B, V], in ascending order
        remove = remove.at[:, -1].set(False)
        in_vocab_order = jnp.zeros_like(remove).at[jnp.arange(logits.shape[0])[:, None], order].set(remove)  # [B, V]
        return jnp.where(in_vocab_order, -jnp.inf, logits)  # [B, V]

    # Per row, top_p 1 removes only what has probability 0 already: the same probabilities, so a
    # step where every row has it skips the sort
    if isinstance(top_p, jax.Array):
        logits = lax.cond(jnp.any(top_p < 1.0), nucleus, lambda logits: logits, logits)
    elif top_p < 1.0:
        logits = nucleus(logits)
    return logits


def probabilities(logits: jax.Array, generation: GenerationConfig) -> jax.Array:
    """logits [..., V] -> what sampling draws from [..., V]: the temperature, top-k and top-p,
    then softmax. In float64, so the ports' draws can differ only where their logits do."""
    logits = logits.astype(jnp.float64) / generation.temperature  # [..., V]
    shape = logits.shape
    return jax.nn.softmax(
        filter_logits(logits.reshape(-1, shape[-1]), generation.top_k, generation.top_p), axis=-1
    ).reshape(shape)


def draw(probs: jax.Array, uniform: jax.Array) -> jax.Array:
    """probs [B, V] (summing to any positive total), uniform [B] in [0, 1) -> tokens [B]: the
    first token whose cumulative probability exceeds the uniform's share of the total."""
    cumulative = jnp.cumsum(probs, axis=-1)  # [B, V]
    # [B]: tokens whose interval ends at or below it
    drawn = jnp.sum(cumulative <= uniform[:, None] * cumulative[:, -1:], axis=-1)
    return jnp.minimum(drawn, probs.shape[-1] - 1).astype(jnp.int32)


def sample(logits: jax.Array, generation: GenerationConfig, uniform: jax.Array) -> jax.Array:
    """logits [B, V], uniform [B] in [0, 1) -> tokens [B]: greedy at temperature 0, else a draw
    from the filtered probabilities."""
    if generation.greedy:
        return greedy(logits)
    return draw(probabilities(logits, generation), uniform)


def choose(
    logits: jax.Array, generation: GenerationConfig, uniform: jax.Array, done: jax.Array, stops: jax.Array
) -> Tuple[jax.Array, jax.Array]:
    """Each row's next token [B] and whether it has stopped [B]: a stopped row stays stopped (PAD)."""
    token = sample(logits, generation, uniform)  # [B]
    if generation.stop_ids:  # without stop ids no row can stop: no bookkeeping
        token = jnp.where(done, PAD, token)
        done = done | jnp.isin(token, stops)
    return token, done


def sample_rows(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    uniform: jax.Array,
    allowed: Optional[jax.Array] = None,
) -> jax.Array:
    """Each row's next token [B] from logits [B, V] by its own settings, arrays [B] (temperature 0:
    greedy), the token it gets alone: values, not shapes, so one program serves any mix of them
    (traced: one compile). A row whose logits hold an inf or a NaN gets PAD: the engine stops there.
    allowed [B, V]: the tokens each row may take (a grammar's, from the host); the others -inf first."""
    finite = jnp.all(jnp.isfinite(logits), axis=-1)  # [B]: the model's own logits, before any mask
    if allowed is not None:  # None or not is the program's shape: a masked step compiles its own
        logits = jnp.where(allowed, logits, -jnp.inf)  # [B, V]
    sampled = temperature > 0  # [B]

    def draw_rows(tokens: jax.Array) -> jax.Array:
        scaled = logits.astype(jnp.float64) / jnp.where(sampled, temperature, 1.0)[:, None]  # [B, V]
        probs = jax.nn.softmax(filter_logits(scaled, top_k[:, None], top_p[:, None]), axis=-1)  # [B, V]
        return jnp.where(sampled, draw(probs, uniform), tokens)  # [B]

    # A greedy step skips the sort: a traced condition, not a Python one (torch and NumPy look at the host)
    tokens = lax.cond(jnp.any(sampled), draw_rows, lambda tokens: tokens, greedy(logits))  # [B]
    return jnp.where(finite, tokens, PAD)
