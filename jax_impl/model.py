"""The JAX/Flax port: the seed's TinyModel in flax.nnx, with a preallocated KV cache.

Read it beside torch_impl/model.py: the same names in the same order. What JAX forces
to differ: the cache is an immutable pytree passed into and out of compiled calls
(donated, so XLA writes it in place), writes return a new cache instead of mutating,
and each generation is one compiled call with the decode loop inside (`lax.fori_loop`).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from kvports.shared.config import ModelConfig
from kvports.shared.config import cache_slots

# float64 must be real float64 (JAX silently truncates to float32 otherwise), and a GPU
# must compute float32 matmuls in float32, not TF32. Every dtype below is pinned.
jax.config.update("jax_enable_x64", True)
jax.config.update("jax_default_matmul_precision", "highest")

# Python code under jax.jit runs only while tracing, i.e. once per compilation, so a
# counter bumped there counts compilations: trace_counts["generate_cached"] and friends.
trace_counts: Counter = Counter()


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVCache:
    # JAX arrays are immutable: a write returns a new cache. As a pytree it goes into and
    # out of jitted calls, where donation lets XLA reuse the same buffers in place.
    keys: jax.Array  # [L, B, Hkv, S, Dh], S = slots (prompt + new tokens, or the window)
    values: jax.Array  # [L, B, Hkv, S, Dh]
    slot_positions: jax.Array  # [S] int32: the position each slot holds, -1 while empty
    length: jax.Array  # [] int32: tokens seen so far; an array, so a new length is not a new compile


def init_cache(config: ModelConfig, batch: int, total_len: int, dtype) -> KVCache:
    slots = cache_slots(config, total_len)
    shape = (config.n_layers, batch, config.kv_heads, slots, config.head_dim)
    return KVCache(
        keys=jnp.zeros(shape, dtype=dtype),
        values=jnp.zeros(shape, dtype=dtype),
        slot_positions=jnp.full((slots,), -1, dtype=jnp.int32),
        length=jnp.zeros((), dtype=jnp.int32),
    )


def token_positions(start, length: int) -> jax.Array:
    # Pitfall 1: in cache mode the new tokens' positions start at the cache length, not 0.
    # start may be traced (the cache length), so shift a static-length range by it.
    return start + jnp.arange(length, dtype=jnp.int32)  # [T]


def attention_mask(query_positions: jax.Array, key_positions: jax.Array, window: Optional[int]) -> jax.Array:
    # Built from positions, not indices: the same rule serves a full prompt, a cached step
    # and a ring buffer. With keys 0..S-1 and queries S-T..S-1 it is the seed's
    # triu(ones(T, S), diagonal=S - T + 1), inverted (True here means visible).
    visible = (key_positions[None, :] <= query_positions[:, None]) & (key_positions[None, :] >= 0)  # [T, S]
    if window is not None:
        visible = visible & (key_positions[None, :] > query_positions[:, None] - window)  # [T, S]
    return visible


def rope_tables(positions: jax.Array, head_dim: int, theta: float, dtype):
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float64) / head_dim))  # [Dh/2]
    angles = positions.astype(jnp.float64)[:, None] * inv_freq[None, :]  # [T, Dh/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [T, Dh]
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    # Half-split rotation, the layout Hugging Face's Llama checkpoints use.
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)  # [B, H, T, Dh]
    return x * cos + rotated * sin  # [B, H, T, Dh]


class RMSNorm(nnx.Module):
    # nnx creates parameters at construction, so every module takes their dtype.
    def __init__(self, dim: int, eps: float, *, dtype):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype=dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x * lax.rsqrt(jnp.mean(x**2, axis=-1, keepdims=True) + self.eps) * self.weight[...]  # [B, T, D]


def make_norm(config: ModelConfig, dtype, rngs: nnx.Rngs) -> nnx.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(config.d_model, config.norm_eps, dtype=dtype)
    # Flax's default "fast variance" is E[x^2] - E[x]^2; torch computes E[(x - mean)^2].
    return nnx.LayerNorm(config.d_model, epsilon=config.norm_eps, use_fast_variance=False,
                         dtype=dtype, param_dtype=dtype, rngs=rngs)


class FeedForward(nnx.Module):
    """Seed: Sequential(Linear(d, 4d), GELU(), Linear(4d, d)); `0` and `2` keep its names.
    SwiGLU fuses gate and up into `0` (gate first), as qkv fuses q, k and v."""

    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.activation = config.activation
        gated = 2 if config.activation == "swiglu" else 1
        setattr(self, "0", nnx.Linear(config.d_model, gated * config.ffn_dim, use_bias=config.ffn_bias,
                                      dtype=dtype, param_dtype=dtype, rngs=rngs))
        setattr(self, "2", nnx.Linear(config.ffn_dim, config.d_model, use_bias=config.ffn_bias,
                                      dtype=dtype, param_dtype=dtype, rngs=rngs))

    def __call__(self, x: jax.Array) -> jax.Array:
        h = getattr(self, "0")(x)  # [B, T, hidden] (swiglu: [B, T, 2 * hidden])
        if self.activation == "swiglu":
            gate, up = jnp.split(h, 2, axis=-1)  # [B, T, hidden] each
            h = jax.nn.silu(gate) * up
        elif self.activation == "gelu_tanh":
            h = jax.nn.gelu(h, approximate=True)
        else:
            h = jax.nn.gelu(h, approximate=False)  # exact erf form, as the seed's nn.GELU()
        return getattr(self, "2")(h)  # [B, T, D]


class Block(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.config = config
        self.ln1, self.ln2 = make_norm(config, dtype, rngs), make_norm(config, dtype, rngs)
        self.qkv = nnx.Linear(config.d_model, config.qkv_dim, use_bias=config.attn_bias,
                              dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.proj = nnx.Linear(config.d_model, config.d_model, use_bias=config.attn_bias,
                               dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.ffn = FeedForward(config, dtype=dtype, rngs=rngs)
        self.dropout = nnx.Dropout(config.dropout, rngs=rngs)  # pitfall 3: active only in train mode

    def attention(self, x, positions, rope, cache: Optional[KVCache], layer: int):
        # Returns (out, cache): the cache cannot be written in place, so the new one comes back.
        config = self.config
        B, T, D = x.shape
        H, Hkv, Dh = config.n_heads, config.kv_heads, config.head_dim
        q, k, v = jnp.split(self.qkv(x), [H * Dh, (H + Hkv) * Dh], axis=-1)
        q = q.reshape(B, T, H, Dh).transpose(0, 2, 1, 3)  # [B, H, T, Dh]
        k = k.reshape(B, T, Hkv, Dh).transpose(0, 2, 1, 3)  # [B, Hkv, T, Dh]
        v = v.reshape(B, T, Hkv, Dh).transpose(0, 2, 1, 3)  # [B, Hkv, T, Dh]
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is None:
            keys, values, key_positions = k, v, positions  # [B, Hkv, T, Dh], [T]
        else:
            # Attend over the slots as they were plus this chunk, then write the chunk:
            # a ring buffer may overwrite slots that this chunk's first queries still need.
            filled = cache.keys.shape[3]  # every slot: shapes must be static under jit; empty ones are masked
            keys = jnp.concatenate([cache.keys[layer][:, :, :filled], k], axis=2)  # [B, Hkv, F + T, Dh]
            values = jnp.concatenate([cache.values[layer][:, :, :filled], v], axis=2)  # [B, Hkv, F + T, Dh]
            key_positions = jnp.concatenate([cache.slot_positions[:filled], positions])  # [F + T]
            cache = write_cache(cache, layer, k, v, positions)
        visible = attention_mask(positions, key_positions, config.sliding_window)  # [T, S']
        # GQA: each group of H / Hkv query heads shares one k/v head; grouping avoids a copy.
        q = q.reshape(B, Hkv, H // Hkv, T, Dh)  # [B, Hkv, G, T, Dh]
        scores = q @ jnp.swapaxes(keys[:, :, None], -2, -1) / math.sqrt(Dh)  # [B, Hkv, G, T, S']
        probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)  # [B, Hkv, G, T, S']
        out = probs @ values[:, :, None]  # [B, Hkv, G, T, Dh]
        out = out.reshape(B, H, T, Dh).transpose(0, 2, 1, 3).reshape(B, T, D)  # [B, T, D]
        return self.proj(out), cache  # [B, T, D]

    def __call__(self, x, positions, rope, cache: Optional[KVCache], layer: int):
        attended, cache = self.attention(self.ln1(x), positions, rope, cache, layer)
        x = x + self.dropout(attended)  # [B, T, D]
        return x + self.dropout(self.ffn(self.ln2(x))), cache  # [B, T, D]


def write_cache(cache: KVCache, layer: int, k: jax.Array, v: jax.Array, positions: jax.Array) -> KVCache:
    slots = cache.keys.shape[3]
    keep = min(k.shape[2], slots)  # a chunk longer than a ring keeps only its newest tokens
    slot_index = positions[-keep:] % slots  # [keep]; without a window, slot == position
    # One scatter into the whole buffer, in place when the cache is donated. NumPy's
    # indexing rule puts the indexed axes (layer, slot) first, so the chunk's T axis leads.
    keys = cache.keys.at[layer, :, :, slot_index].set(jnp.moveaxis(k[:, :, -keep:], 2, 0))  # [L, B, Hkv, S, Dh]
    values = cache.values.at[layer, :, :, slot_index].set(jnp.moveaxis(v[:, :, -keep:], 2, 0))  # [L, B, Hkv, S, Dh]
    return dataclasses.replace(cache, keys=keys, values=values)


class CallCounter:
    # A static attribute of the model: the copy jit rebuilds inside a trace holds this
    # same object, so forward calls made while tracing land on the caller's model.
    def __init__(self):
        self.count = 0

    # All counters compare equal, so two models of one config share compiled programs
    # instead of each new model object forcing a fresh compile.
    def __eq__(self, other) -> bool:
        return isinstance(other, CallCounter)

    def __hash__(self) -> int:
        return hash(CallCounter)


class TinyModel(nnx.Module):
    # nnx builds parameters eagerly, so it needs their dtype and a random source here;
    # port.load_model then overwrites every parameter with the file's.
    def __init__(self, config: ModelConfig = ModelConfig(), *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.emb = nnx.Embed(config.vocab_size, config.d_model, dtype=dtype, param_dtype=dtype, rngs=rngs)
        if config.positions == "learned":
            self.pos = nnx.Embed(config.max_seq_len, config.d_model, dtype=dtype, param_dtype=dtype, rngs=rngs)
        # nnx.List, not a list: nnx refuses a plain list of modules as an attribute.
        self.blocks = nnx.List([Block(config, dtype=dtype, rngs=rngs) for _ in range(config.n_layers)])
        self.ln = make_norm(config, dtype, rngs)
        if not config.tie_embeddings:
            self.head = nnx.Linear(config.d_model, config.vocab_size, use_bias=False,
                                   dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.forward_counter = CallCounter()  # counted so a test can see prefill is one call

    # Forward calls happen while tracing: one per call site in a compiled program, counted
    # at its first compilation. A property, so tests read and reset it as in torch.
    @property
    def forward_calls(self) -> int:
        return self.forward_counter.count

    @forward_calls.setter
    def forward_calls(self, value: int) -> None:
        self.forward_counter.count = value

    def __call__(self, tokens: jax.Array, cache: Optional[KVCache] = None):
        # Not `self.forward_calls += 1`: nnx forbids setting a module's attributes inside a
        # loop body (another trace level); bumping the shared counter object is allowed.
        self.forward_counter.count += 1
        config = self.config
        B, T = tokens.shape
        start = 0 if cache is None else cache.length
        positions = token_positions(start, T)  # [T]
        x = self.emb(tokens)  # [B, T, D]
        rope = None
        if config.positions == "learned":
            x = x + self.pos.embedding[positions]  # [B, T, D]
        else:
            rope = rope_tables(positions, config.head_dim, config.rope_theta, x.dtype)  # 2 x [T, Dh]
        for layer, block in enumerate(self.blocks):
            x, cache = block(x, positions, rope, cache, layer)  # [B, T, D]
        if cache is not None:
            # Slot positions change only after every layer has read the old ones.
            slots = cache.slot_positions.shape[0]
            keep = min(T, slots)
            cache = dataclasses.replace(
                cache,
                slot_positions=cache.slot_positions.at[positions[-keep:] % slots].set(positions[-keep:]),
                length=start + T,
            )
        x = self.ln(x)  # [B, T, D]
        # nnx.Linear stores (in, out), the transpose of torch's weight: flip it back to [V, D].
        head_weight = self.emb.embedding[...] if config.tie_embeddings else self.head.kernel[...].T  # [V, D]
        return x @ head_weight.T, cache  # [B, T, V]


def greedy(logits: jax.Array) -> jax.Array:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, V] -> [B]


# Each generation is one compiled call; shapes must be static, so new_tokens is a
# compile-time argument and a new (batch, prompt length, new tokens) means a new compile.
@partial(jax.jit, static_argnames=("new_tokens", "return_logits"))
def generate_naive(model: TinyModel, prompt: jax.Array, new_tokens: int, return_logits: bool = False):
    """Recompute the whole history every step: O(n^2) work per token.
    One fixed-shape buffer [B, P + N] is recomputed whole each step (causal masking keeps
    the unfilled tail from reaching earlier positions), so one compile serves every step."""
    trace_counts["generate_naive"] += 1
    model.eval()  # pitfall 3: dropout off, or the two paths disagree (inside jit: the traced copy)
    B, P = prompt.shape
    tokens = jnp.zeros((B, P + new_tokens), dtype=prompt.dtype).at[:, :P].set(prompt)  # [B, P + N]
    step_logits = jnp.zeros((B, new_tokens, model.config.vocab_size), dtype=model.emb.embedding.dtype)  # [B, N, V]

    def recompute(step, carry):
        tokens, step_logits = carry
        logits, _ = model(tokens)  # [B, P + N, V]
        last = logits[:, P + step - 1]  # [B, V]
        return tokens.at[:, P + step].set(greedy(last)), step_logits.at[:, step].set(last)

    tokens, step_logits = lax.fori_loop(0, new_tokens, recompute, (tokens, step_logits))
    return (tokens, step_logits) if return_logits else tokens  # [B, P + N], [B, N, V]


@partial(jax.jit, static_argnames=("new_tokens", "return_logits", "prefill"))
def generate_cached(model: TinyModel, prompt: jax.Array, new_tokens: int, return_logits: bool = False, prefill: bool = True):
    """Prefill the prompt in one forward, then one token per step against the cache.
    prefill=False is pitfall 2 on purpose: the same tokens from P forwards instead of one."""
    trace_counts["generate_cached"] += 1
    model.eval()  # pitfall 3: dropout off, or the two paths disagree (inside jit: the traced copy)
    B, P = prompt.shape
    cache = init_cache(model.config, B, P + new_tokens, model.emb.embedding.dtype)
    if prefill:
        logits, cache = model(prompt, cache)  # [B, P, V]
    else:
        for i in range(P):
            logits, cache = model(prompt[:, i : i + 1], cache)  # [B, 1, V]
    tokens = jnp.zeros((B, P + new_tokens), dtype=prompt.dtype).at[:, :P].set(prompt)  # [B, P + N]
    step_logits = jnp.zeros((B, new_tokens, model.config.vocab_size), dtype=logits.dtype)  # [B, N, V]
    tokens = tokens.at[:, P].set(greedy(logits[:, -1]))
    step_logits = step_logits.at[:, 0].set(logits[:, -1])

    # Step 0 used the prefill's logits above; the loop body is traced once and runs N - 1 times.
    def decode(step, carry):
        tokens, step_logits, cache = carry
        logits, cache = model(lax.dynamic_slice_in_dim(tokens, P + step - 1, 1, axis=1), cache)  # [B, 1, V]
        return tokens.at[:, P + step].set(greedy(logits[:, -1])), step_logits.at[:, step].set(logits[:, -1]), cache

    tokens, step_logits, cache = lax.fori_loop(1, new_tokens, decode, (tokens, step_logits, cache))
    return (tokens, step_logits) if return_logits else tokens  # [B, P + N], [B, N, V]


# The two halves of generate_cached as separate compiled calls, so a benchmark can time
# one step at a time. The cache is donated: XLA updates it in place, and the caller must
# use the returned cache (the one passed in is deleted).
@partial(jax.jit, donate_argnames="cache")
def prefill(model: TinyModel, prompt: jax.Array, cache: KVCache):
    trace_counts["prefill"] += 1
    model.eval()
    return model(prompt, cache)  # [B, P, V], cache


@partial(jax.jit, donate_argnames="cache")
def decode_step(model: TinyModel, token: jax.Array, cache: KVCache):
    trace_counts["decode_step"] += 1
    model.eval()
    return model(token, cache)  # token [B, 1] -> [B, 1, V], cache
