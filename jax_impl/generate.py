"""Generation in JAX: the loops that run model.py's TinyModel, naive and cached.

One loop for both (gpt-fast's shape): `decode_one_token` makes the next token from the whole
history (naive) or from the last token through the KV cache (cached), and `decode_n_tokens`
repeats it; `generate_cached` fills the cache with the prompt in one forward first. What a
generation reads at every step is one `Decoding`, what the loop carries one `DecodeState`.
Read it beside torch_impl/generate.py: the same names in the same order. What JAX forces to
differ: the loop is one compiled `lax.while_loop` over the `DecodeState` pytree, whose one
jitted step also serves the streamed loop, and the compiled pieces (the `_`-prefixed functions
at the end) take the model as split.py's (static, leaves), the cache and state donated.

Shapes: B batch, T tokens in this call, P prompt, N new tokens, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike

from kvports.jax_impl.model import KVCache, TinyModel, init_cache
from kvports.jax_impl.sampling import choose
from kvports.jax_impl.split import Static, merge_model, split_model  # the model as jit takes it
from kvports.shared.generation import PAD, GenerationConfig, check_finite, dtype_name, uniforms

# on_token(token [B]) is called as each new token reaches the host (streaming, per-step timing).
OnToken = Optional[Callable[[np.ndarray], None]]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Decoding:
    """What a generation reads at every step and never changes, by name: built once by
    start_generation, passed whole to every step. A pytree whose arrays are traced and whose
    settings are static (jit's cache key, as a static argument's would be)."""

    pad: Optional[jax.Array]  # [B] int32: each row's left padding (None when no row is padded)
    draws: jax.Array  # [B, N]: each row's uniform for each new token
    stops: jax.Array  # [K] int32: the stop ids
    generation: GenerationConfig = dataclasses.field(metadata=dict(static=True))
    dtype: str = dataclasses.field(metadata=dict(static=True))  # the model's, named when a forward overflows it


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DecodeState:
    """What the decode loop carries from one token to the next, by name: a pytree, so the
    compiled loop carries it and the streamed loop passes it (donated) from step to step."""

    step: jax.Array  # [] int32: new tokens made so far; an array, so a new step is not a new compile
    tokens: jax.Array  # [B, P + N] int32: the prompt, then the new tokens (PAD after a row stops)
    done: jax.Array  # [B] bool: the rows that have stopped
    nonfinite: jax.Array  # [2] int32: (step, row) of the first logits with an inf or a NaN in a running row, or -1s
    # [B, N, V]: what each token was chosen from, when asked for (a buffer, not a list: the compiled loop keeps shapes)
    step_logits: Optional[jax.Array]
    cache: Optional[KVCache]  # None: naive, the whole history again at every step


def start_generation(prompt: jax.Array, generation: GenerationConfig, dtype: DTypeLike) -> Tuple[Decoding, jax.Array]:
    """What both loops need: the generation's constants (each row's left padding, its draws,
    the stop ids, the model's dtype) and the token buffer [B, P + N] with the prompt in it.
    Run before anything is compiled: whether there is padding shapes the program."""
    B, P = prompt.shape
    padding = jnp.sum(prompt == PAD, axis=1, dtype=jnp.int32)  # [B]
    pad = padding if bool(jnp.any(padding)) else None  # unpadded batches skip every mask they can
    # [B, N]: each row's stream, keyed by its seed
    draws = jnp.asarray(uniforms(generation.row_seeds(B), generation.max_new_tokens))
    stops = jnp.asarray(generation.stop_ids, dtype=jnp.int32)  # [K]
    tokens = jnp.full((B, P + generation.max_new_tokens), PAD, dtype=jnp.int32).at[:, :P].set(prompt)  # [B, P + N]
    return Decoding(pad, draws, stops, generation, dtype_name(np.dtype(dtype))), tokens


def no_nonfinite() -> jax.Array:
    return jnp.full(2, -1, dtype=jnp.int32)  # [2]: no step's logits have overflowed yet


def first_nonfinite(logits: jax.Array, done: jax.Array, step: jax.Array, nonfinite: jax.Array) -> jax.Array:
    """(step, row) of the first step whose logits [B, V] hold an inf or a NaN in a running row, kept
    from the first such step on [2]. Carried, not raised here: no host look per step."""
    bad = ~jnp.all(jnp.isfinite(logits), axis=-1) & ~done  # [B]
    found = jnp.stack([jnp.asarray(step, dtype=jnp.int32), jnp.argmax(bad).astype(jnp.int32)])  # [2]
    return jnp.where((nonfinite[0] < 0) & jnp.any(bad), found, nonfinite)


def check_logits(state: DecodeState, decoding: Decoding) -> None:
    """Stop the run at the first step whose logits were not finite: one line naming it (a host look at two numbers)."""
    check_finite(np.asarray(state.nonfinite).tolist(), decoding.dtype)


def next_token(
    state: DecodeState, logits: jax.Array, cache: Optional[KVCache], decoding: Decoding
) -> Tuple[DecodeState, jax.Array]:
    """The token [B] at state.step chosen from its logits [B, V] and written; the state one step on."""
    column = state.tokens.shape[1] - decoding.draws.shape[1] + state.step  # P + step
    uniform = lax.dynamic_index_in_dim(decoding.draws, state.step, axis=1, keepdims=False)  # [B]
    token, done = choose(logits, decoding.generation, uniform, state.done, decoding.stops)  # [B], [B]
    nonfinite = first_nonfinite(logits, state.done, state.step, state.nonfinite)  # [2]
    tokens = lax.dynamic_update_index_in_dim(state.tokens, token, column, axis=1)  # [B, P + N]
    step_logits = state.step_logits
    if step_logits is not None:
        step_logits = lax.dynamic_update_index_in_dim(step_logits, logits, state.step, axis=1)  # [B, N, V]
    return DecodeState(state.step + 1, tokens, done, nonfinite, step_logits, cache), token


def decode_one_token(model: TinyModel, state: DecodeState, decoding: Decoding) -> Tuple[DecodeState, jax.Array]:
    """One step of either loop: the logits of the token at state.step, then next_token."""
    column = state.tokens.shape[1] - decoding.draws.shape[1] + state.step  # P + step
    if state.cache is None:
        # The whole fixed-shape buffer [B, P + N] again (causal masking keeps its unfilled tail from
        # reaching earlier positions): one compile serves every step.
        logits, cache = model(jnp.maximum(state.tokens, 0), None, decoding.pad)  # [B, P + N, V]
        last = lax.dynamic_index_in_dim(logits, column - 1, axis=1, keepdims=False)  # [B, V]
    else:
        # A stopped row feeds PAD as token 0: its outputs are never used.
        token = jnp.maximum(lax.dynamic_slice_in_dim(state.tokens, column - 1, 1, axis=1), 0)  # [B, 1]
        logits, cache = model(token, state.cache, decoding.pad)  # [B, 1, V]
        last = logits[:, -1]  # [B, V]
    return next_token(state, last, cache, decoding)


# The model as (static, leaves), split once per generation: jit takes it so (split.py).
def decode_n_tokens(
    static: Static, leaves: list, state: DecodeState, decoding: Decoding, on_token: OnToken
) -> DecodeState:
    """The one loop: decode_one_token until N new tokens, or until every row has stopped;
    on_token(token [B]) after each. Without on_token, one compiled while_loop; with it, the
    same jitted step called from here, so each token reaches the host as it is made. Logits that
    overflowed stop it with an error: at once when streaming (no token made from them is heard),
    else after the loop, which carries the step and ends there (no host look per step)."""
    if on_token is None:
        state = _decode_n_tokens(static, leaves, state, decoding)
        check_logits(state, decoding)
        return state
    generation = decoding.generation
    for _ in range(int(state.step), generation.max_new_tokens):
        if generation.stop_ids and bool(jnp.all(state.done)):
            break  # every row has stopped
        state, token = _decode_one_token(static, leaves, state, decoding)
        check_logits(state, decoding)
        on_token(np.asarray(token))
    check_logits(state, decoding)
    return state


def finish(state: DecodeState) -> Tuple[jax.Array, Optional[jax.Array]]:
    """tokens [B, P + N] and, when asked for, the step logits [B, steps, V]."""
    return state.tokens, None if state.step_logits is None else state.step_logits[:, : int(state.step)]


def generate_naive(
    model: TinyModel,
    prompt: jax.Array,
    generation: GenerationConfig,
    return_logits: bool = False,
    on_token: OnToken = None,
) -> Tuple[jax.Array, Optional[jax.Array]]:
    """Recompute the whole history every step: O(n^2) work per token.
    prompt [B, P], PAD on the left of shorter rows -> tokens [B, P + N], PAD after a row stops."""
    model.eval()  # pitfall 3: dropout off, or the two paths disagree
    static, leaves = split_model(model)
    decoding, tokens = start_generation(prompt, generation, model.emb.embedding.dtype)
    B, N = prompt.shape[0], generation.max_new_tokens
    done = jnp.zeros(B, dtype=bool)  # [B]
    step_logits = jnp.zeros((B, N, model.config.vocab_size), model.emb.embedding.dtype) if return_logits else None
    state = DecodeState(jnp.zeros((), dtype=jnp.int32), tokens, done, no_nonfinite(), step_logits, None)
    return finish(decode_n_tokens(static, leaves, state, decoding, on_token))


def generate_cached(
    model: TinyModel,
    prompt: jax.Array,
    generation: GenerationConfig,
    return_logits: bool = False,
    prefill: bool = True,
    on_token: OnToken = None,
) -> Tuple[jax.Array, Optional[jax.Array]]:
    """Prefill the prompt in one forward, then one token per step against the cache.
    prefill=False is pitfall 2 on purpose: the same tokens from P forwards instead of one."""
    model.eval()  # pitfall 3: dropout off, or the two paths disagree
    static, leaves = split_model(model)
    decoding, tokens = start_generation(prompt, generation, model.emb.embedding.dtype)
    state, token = _start_cached(static, leaves, prompt, tokens, decoding, return_logits, prefill)
    if on_token is not None:
        check_logits(state, decoding)
        on_token(np.asarray(token))
    return finish(decode_n_tokens(static, leaves, state, decoding, on_token))


# A forward against the cache, as its own compiled call (port.forward_chunks feeds chunks
# through it). The cache is donated: XLA updates it in place, and the caller must use the
# returned cache (the one passed in is deleted).
def prefill(
    model: TinyModel, prompt: jax.Array, cache: KVCache, pad: Optional[jax.Array] = None
) -> Tuple[jax.Array, KVCache]:
    return _forward(*split_model(model), prompt, cache, pad)  # [B, P, V], cache


# What the functions above compile. Shapes must be static, so new_tokens and the sampling
# settings are compile-time: a new (batch, prompt length, new tokens) is a new compile, a
# new prompt is not.
@partial(jax.jit, static_argnums=0, donate_argnames="cache")
def _forward(
    static: Static, leaves: list, tokens: jax.Array, cache: KVCache, pad: Optional[jax.Array]
) -> Tuple[jax.Array, KVCache]:
    return merge_model(static, leaves)(tokens, cache, pad)  # [B, T, V], cache


@partial(jax.jit, static_argnums=(0, 5, 6))
def _start_cached(
    static: Static,
    leaves: list,
    prompt: jax.Array,
    tokens: jax.Array,
    decoding: Decoding,
    return_logits: bool,
    prefill: bool,
) -> Tuple[DecodeState, jax.Array]:
    """The prefill, and the first token chosen from its logits: the state the loop starts from."""
    model = merge_model(static, leaves)
    B, P = prompt.shape
    N = decoding.generation.max_new_tokens
    cache = init_cache(model.config, B, P + N, model.emb.embedding.dtype)
    if prefill:
        logits, cache = model(jnp.maximum(prompt, 0), cache, decoding.pad, logits_to_keep=1)  # [B, 1, V]
    else:
        for i in range(P):
            logits, cache = model(jnp.maximum(prompt[:, i : i + 1], 0), cache, decoding.pad)  # [B, 1, V]
    done = jnp.zeros(B, dtype=bool)  # [B]
    step_logits = jnp.zeros((B, N, logits.shape[-1]), logits.dtype) if return_logits else None  # [B, N, V]
    state = DecodeState(jnp.zeros((), dtype=jnp.int32), tokens, done, no_nonfinite(), step_logits, cache)
    return next_token(state, logits[:, -1], cache, decoding)  # the prefill's logits choose it


@partial(jax.jit, static_argnums=0, donate_argnames="state")
def _decode_one_token(
    static: Static, leaves: list, state: DecodeState, decoding: Decoding
) -> Tuple[DecodeState, jax.Array]:
    """decode_one_token, compiled: the streamed loop's step and the compiled loop's body."""
    return decode_one_token(merge_model(static, leaves), state, decoding)


@partial(jax.jit, static_argnums=0, donate_argnames="state")
def _decode_n_tokens(static: Static, leaves: list, state: DecodeState, decoding: Decoding) -> DecodeState:
    def running(state: DecodeState) -> jax.Array:
        # N tokens, or sooner when every row has stopped or a step's logits overflowed
        return (state.step < decoding.generation.max_new_tokens) & ~jnp.all(state.done) & (state.nonfinite[0] < 0)

    def step(state: DecodeState) -> DecodeState:
        return _decode_one_token(static, leaves, state, decoding)[0]

    return lax.while_loop(running, step, state)
