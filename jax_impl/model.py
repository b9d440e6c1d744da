"""The JAX/Flax port: the seed's TinyModel in flax.nnx, with a preallocated KV cache.

Read it beside torch_impl/model.py: the same names in the same order. What JAX forces
to differ: the cache is an immutable pytree passed into and out of compiled calls
(donated, so XLA writes it in place), writes return a new cache instead of mutating,
shapes are static under jit (every slot is attended, the empty ones masked), and the decode
loop is one compiled `lax.while_loop` over a named state (`DecodeState`), whose one jitted
step also serves the streamed loop. float64 needs JAX's x64 mode, which port.py turns on
around its calls (not for the process): every dtype below is pinned, so no array's dtype
depends on it.

Shapes: B batch, T tokens in this call, P prompt, N new tokens, S cache slots, S' keys a
query attends over, D d_model, H query heads, Hkv key/value heads, G = H / Hkv, Dh head
dim, V vocabulary, L layers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.typing import DTypeLike

import kvports.jax_impl.functional as F
from kvports.jax_impl.split import Static, merge_model, split_model  # the model as jit takes it
from kvports.shared.config import ModelConfig, cache_slots
from kvports.shared.generation import PAD, GenerationConfig, check_finite, dtype_name, uniforms


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVCache:
    # JAX arrays are immutable: a write returns a new cache. As a pytree it goes into and
    # out of jitted calls, where donation lets XLA reuse the same buffers in place.
    keys: jax.Array  # [L, B, Hkv, S, Dh], S = slots (prompt + new tokens, or a ring for the window)
    values: jax.Array  # [L, B, Hkv, S, Dh]
    slot_positions: jax.Array  # [B, S] int32: the position each slot holds in each row, -1 while empty or padding
    length: jax.Array  # [] int32: columns written so far; an array, so a new length is not a new compile
    window: Optional[int] = dataclasses.field(metadata=dict(static=True))  # the sliding window, or None
    # No filled(): shapes are static under jit, so the keys always span every slot, the empty ones masked.

    def writes_first(self, T: int) -> bool:
        # A chunk is written first and attended from the buffer: no copy of the history. Only a chunk
        # wider than a ring's spare slots would overwrite keys its own first queries still need.
        slots = self.keys.shape[3]
        return self.window is None or slots < self.window or T <= slots - self.window + 1

    def slot_index(self, column: Union[int, jax.Array], count: int) -> jax.Array:
        """The slots of columns [column, column + count), slot = column mod S. Always an index
        array: under jit the column is traced, so whether they wrap is not known."""
        return (column + jnp.arange(count, dtype=jnp.int32)) % self.keys.shape[3]  # [count]

    def mask(self, positions: jax.Array, padded: bool) -> jax.Array:
        """Which keys each of this chunk's queries sees: [B, 1, T, S'], over every slot (shapes are
        static under jit), the empty ones masked."""
        B, T = positions.shape
        if not self.writes_first(T):
            key_positions = jnp.concatenate(
                [self.slot_positions, jnp.broadcast_to(positions, (self.slot_positions.shape[0], T))], axis=1
            )
            return attention_mask(positions, key_positions, self.window)  # [B, 1, T, S']
        # [B, S]: as this chunk's write leaves them
        key_positions = self.slot_positions.at[:, self.slot_index(self.length, T)].set(positions)
        return attention_mask(positions, key_positions, self.window)  # [B, 1, T, S']

    def update(self, layer: int, k: jax.Array, v: jax.Array) -> Tuple[jax.Array, jax.Array, KVCache]:
        """Write this chunk's k and v at their slots; the keys and values to attend over, and the
        new cache (JAX cannot write in place: the donated buffers let XLA do it)."""
        T, slots = k.shape[2], self.keys.shape[3]
        if self.writes_first(T):
            cache = self.write(layer, k, v, self.slot_index(self.length, T))
            return cache.keys[layer], cache.values[layer], cache  # [B, Hkv, S', Dh]
        keep = min(T, slots)  # a chunk wider than the ring keeps its newest
        keys = jnp.concatenate([self.keys[layer], k], axis=2)  # [B, Hkv, S', Dh]
        values = jnp.concatenate([self.values[layer], v], axis=2)  # [B, Hkv, S', Dh]
        return (
            keys,
            values,
            self.write(layer, k[:, :, -keep:], v[:, :, -keep:], self.slot_index(self.length + T - keep, keep)),
        )

    def write(self, layer: int, k: jax.Array, v: jax.Array, slot_index: jax.Array) -> KVCache:
        # One scatter into the whole buffer, in place when the cache is donated. NumPy's indexing rule puts
        # the indexed axes (layer, slot) first, so the chunk's T axis leads.
        keys = self.keys.at[layer, :, :, slot_index].set(jnp.moveaxis(k, 2, 0))  # [L, B, Hkv, S, Dh]
        values = self.values.at[layer, :, :, slot_index].set(jnp.moveaxis(v, 2, 0))  # [L, B, Hkv, S, Dh]
        return dataclasses.replace(self, keys=keys, values=values)

    def advance(self, positions: jax.Array) -> KVCache:
        # After every layer has read the old slot positions: they change once per forward.
        T, slots = positions.shape[1], self.keys.shape[3]
        keep = min(T, slots)
        index = self.slot_index(self.length + T - keep, keep)  # [keep]
        slot_positions = self.slot_positions.at[:, index].set(positions[:, -keep:])  # [B, S]
        return dataclasses.replace(self, slot_positions=slot_positions, length=self.length + T)

    def crop(self, length: Union[int, jax.Array]) -> KVCache:
        """Take back every column from `length` on (rejected speculative tokens): their slots read
        as empty again, as if never written. A ring sized with spare slots lost nothing still needed."""
        slots = self.keys.shape[3]
        # [S]: the last column each slot took
        newest = self.length - 1 - (self.length - 1 - jnp.arange(slots, dtype=jnp.int32)) % slots
        slot_positions = jnp.where(newest >= length, -1, self.slot_positions)  # [B, S]
        return dataclasses.replace(self, slot_positions=slot_positions, length=jnp.asarray(length, dtype=jnp.int32))


def init_cache(config: ModelConfig, batch: int, total_len: int, dtype: DTypeLike, chunk: int = 1) -> KVCache:
    slots = cache_slots(config, total_len, chunk)
    shape = (config.n_layers, batch, config.kv_heads, slots, config.head_dim)
    return KVCache(
        keys=jnp.zeros(shape, dtype=dtype),
        values=jnp.zeros(shape, dtype=dtype),
        slot_positions=jnp.full((batch, slots), -1, dtype=jnp.int32),
        length=jnp.zeros((), dtype=jnp.int32),
        window=config.sliding_window,
    )


def token_positions(start: Union[int, jax.Array], length: int, pad: Optional[jax.Array]) -> jax.Array:
    # Pitfall 1: in cache mode the new tokens' positions start at the cache length, not 0.
    # start: the cache's length (traced, or per row, [B, 1], in a paged cache), so shift a
    # static-length range by it.
    positions = start + jnp.arange(length, dtype=jnp.int32)[None, :]  # [1, T]; [B, T] where start is per row
    if pad is None:
        return positions
    # [B, T]: a left-padded row counts from its first token; -1 on padding
    return jnp.maximum(positions - pad[:, None], -1)


def attention_mask(query_positions: jax.Array, key_positions: jax.Array, window: Optional[int]) -> jax.Array:
    # Built from positions, not indices: the same rule serves a full prompt, a cached step, a
    # ring buffer and left padding. With keys 0..S-1 and queries S-T..S-1 it is the seed's
    # triu(ones(T, S), diagonal=S - T + 1), inverted (True here means visible).
    query, key = query_positions[:, None, :, None], key_positions[:, None, None, :]  # [B, 1, T, 1], [B, 1, 1, S]
    visible = (key <= query) & ((key >= 0) | (query < 0))  # [B, 1, T, S]: padding sees only padding, never nothing
    if window is not None:
        visible = visible & (key > query - window)  # [B, 1, T, S]
    return visible


# cos and sin, [B, 1, T, Dh] each: what every layer rotates q and k by
Rope = Tuple[jax.Array, jax.Array]


def rope_tables(positions: jax.Array, head_dim: int, theta: float, dtype: DTypeLike) -> Rope:
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float64) / head_dim))  # [Dh/2]
    angles = positions.astype(jnp.float64)[:, None, :, None] * inv_freq  # [B, 1, T, Dh/2]: one table for every head
    angles = jnp.concatenate([angles, angles], axis=-1)  # [B, 1, T, Dh]
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    # Half-split rotation, the layout Hugging Face's Llama checkpoints use.
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)  # [B, H, T, Dh]
    return x * cos + rotated * sin  # [B, H, T, Dh]


class RMSNorm(nnx.Module):
    # nnx creates parameters at construction, so every module takes their dtype.
    def __init__(self, dim: int, eps: float, *, dtype: DTypeLike):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype=dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.astype(jnp.promote_types(x.dtype, jnp.float32))  # [B, T, D]: bfloat16 accumulates in float32
        return (h * lax.rsqrt(jnp.mean(h**2, axis=-1, keepdims=True) + self.eps)).astype(x.dtype) * self.weight[...]


def make_norm(config: ModelConfig, dtype: DTypeLike, rngs: nnx.Rngs) -> nnx.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(config.d_model, config.norm_eps, dtype=dtype)
    # Flax's default "fast variance" is E[x^2] - E[x]^2; torch computes E[(x - mean)^2].
    return nnx.LayerNorm(
        config.d_model, epsilon=config.norm_eps, use_fast_variance=False, dtype=dtype, param_dtype=dtype, rngs=rngs
    )


class FeedForward(nnx.Module):
    """Seed: Sequential(Linear(d, 4d), GELU(), Linear(4d, d)); `0` and `2` keep its names.
    SwiGLU fuses gate and up into `0` (gate first), as qkv fuses q, k and v."""

    def __init__(self, config: ModelConfig, *, dtype: DTypeLike, rngs: nnx.Rngs, shards: int = 1):
        self.activation = config.activation
        self.shards = shards
        gated = 2 if config.activation == "swiglu" else 1
        setattr(
            self,
            "0",
            nnx.Linear(
                config.d_model,
                gated * config.ffn_dim,
                use_bias=config.ffn_bias,
                dtype=dtype,
                param_dtype=dtype,
                rngs=rngs,
            ),
        )
        setattr(
            self,
            "2",
            nnx.Linear(
                config.ffn_dim, config.d_model, use_bias=config.ffn_bias, dtype=dtype, param_dtype=dtype, rngs=rngs
            ),
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        h = getattr(self, "0")(x)  # [B, T, ffn_dim] (swiglu: [B, T, 2 * ffn_dim])
        if self.activation == "swiglu":
            B, T, width = h.shape
            groups = h.reshape(B, T, self.shards, 2, width // (2 * self.shards))  # [B, T, shards, 2, ffn_dim / shards]
            gate = groups[:, :, :, 0].reshape(B, T, -1)  # [B, T, ffn_dim]
            up = groups[:, :, :, 1].reshape(B, T, -1)  # [B, T, ffn_dim]
            h = jax.nn.silu(gate) * up
        elif self.activation == "gelu_tanh":
            h = jax.nn.gelu(h, approximate=True)
        else:
            h = jax.nn.gelu(h, approximate=False)  # exact erf form, as the seed's nn.GELU()
        return getattr(self, "2")(h)  # [B, T, D]


class Block(nnx.Module):
    # JAX only: `shards` groups of columns in the fused qkv (and SwiGLU's gate and up), each a whole
    # set of heads, so that tensor parallelism (parallel.py) gives each device one contiguous block
    # under jit's global shapes; 1 is torch's layout, q then k then v.
    def __init__(self, config: ModelConfig, *, dtype: DTypeLike, rngs: nnx.Rngs, shards: int = 1):
        self.config = config
        self.shards = shards
        self.ln1, self.ln2 = make_norm(config, dtype, rngs), make_norm(config, dtype, rngs)
        self.qkv = nnx.Linear(
            config.d_model, config.qkv_dim, use_bias=config.attn_bias, dtype=dtype, param_dtype=dtype, rngs=rngs
        )
        self.proj = nnx.Linear(
            config.d_model, config.d_model, use_bias=config.attn_bias, dtype=dtype, param_dtype=dtype, rngs=rngs
        )
        self.ffn = FeedForward(config, dtype=dtype, rngs=rngs, shards=shards)
        self.dropout = nnx.Dropout(config.dropout, rngs=rngs)  # pitfall 3: active only in train mode

    def attention(
        self, x: jax.Array, rope: Optional[Rope], mask: Optional[jax.Array], cache: Optional[KVCache], layer: int
    ) -> Tuple[jax.Array, Optional[KVCache]]:
        # Returns (out, cache): the cache cannot be written in place, so the new one comes back.
        config = self.config
        B, T, D = x.shape
        H, Hkv, Dh, n = config.n_heads, config.kv_heads, config.head_dim, self.shards
        qkv = self.qkv(x).reshape(B, T, n, (H + 2 * Hkv) // n, Dh)  # [B, T, n, (H + 2 Hkv) / n, Dh]
        q, k, v = jnp.split(qkv, [H // n, (H + Hkv) // n], axis=3)  # [B, T, n, H / n, Dh], [B, T, n, Hkv / n, Dh] x 2
        # [B, H, T, Dh], [B, Hkv, T, Dh], [B, Hkv, T, Dh]
        q, k, v = (part.reshape(B, T, -1, Dh).transpose(0, 2, 1, 3) for part in (q, k, v))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:
            k, v, cache = cache.update(layer, k, v)  # [B, Hkv, S', Dh]: the cache, this chunk written in
        # GQA: each group of G = H / Hkv query heads shares one k/v head, without copying k and v.
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=H != Hkv)  # [B, H, T, Dh]
        out = out.transpose(0, 2, 1, 3).reshape(B, T, D)  # [B, T, D]
        return self.proj(out), cache  # [B, T, D]

    def __call__(
        self, x: jax.Array, rope: Optional[Rope], mask: Optional[jax.Array], cache: Optional[KVCache], layer: int
    ) -> Tuple[jax.Array, Optional[KVCache]]:
        attended, cache = self.attention(self.ln1(x), rope, mask, cache, layer)
        x = x + self.dropout(attended)  # [B, T, D]
        return x + self.dropout(self.ffn(self.ln2(x))), cache  # [B, T, D]


class TinyModel(nnx.Module):
    # nnx builds parameters eagerly, so it needs their dtype and a random source here;
    # port.load_model then overwrites every parameter with the file's.
    def __init__(
        self, config: ModelConfig = ModelConfig(), *, dtype: DTypeLike = jnp.float32, rngs: nnx.Rngs, shards: int = 1
    ):
        self.config = config
        self.emb = nnx.Embed(config.vocab_size, config.d_model, dtype=dtype, param_dtype=dtype, rngs=rngs)
        if config.positions == "learned":
            self.pos = nnx.Embed(config.max_seq_len, config.d_model, dtype=dtype, param_dtype=dtype, rngs=rngs)
        # nnx.List, not a list: nnx refuses a plain list of modules as an attribute.
        self.blocks = nnx.List([Block(config, dtype=dtype, rngs=rngs, shards=shards) for _ in range(config.n_layers)])
        self.ln = make_norm(config, dtype, rngs)
        if not config.tie_embeddings:
            self.head = nnx.Linear(
                config.d_model, config.vocab_size, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs
            )

    def __call__(
        self, tokens: jax.Array, cache: Optional[KVCache] = None, pad: Optional[jax.Array] = None
    ) -> Tuple[jax.Array, Optional[KVCache]]:
        """tokens [B, T] -> logits [B, T, V]; pad [B]: each row's left padding (None: no row is padded)."""
        config = self.config
        B, T = tokens.shape
        start = 0 if cache is None else cache.length
        positions = token_positions(start, T, pad)  # [B, T] ([1, T] without padding)
        x = self.emb(tokens)  # [B, T, D]
        rope = None
        if config.positions == "learned":
            x = x + self.pos(jnp.maximum(positions, 0))  # [B, T, D]; padding borrows position 0, its outputs unused
        else:
            rope = rope_tables(positions, config.head_dim, config.rope_theta, x.dtype)  # 2 x [B, 1, T, Dh]
        mask: Optional[jax.Array]
        if cache is None:
            mask = attention_mask(positions, positions, config.sliding_window)  # [B, 1, T, T]
        else:
            mask = cache.mask(positions, pad is not None)  # [B, 1, T, S']
        for layer, block in enumerate(self.blocks):
            x, cache = block(x, rope, mask, cache, layer)  # [B, T, D]
        if cache is not None:
            cache = cache.advance(positions)
        x = self.ln(x)  # [B, T, D]
        if hasattr(self, "head"):  # a tied model has one only when quantized (quant.py): the lookup stays float
            return self.head(x), cache  # [B, T, V]
        return F.linear(x, self.emb.embedding[...]), cache  # [B, T, V]: the tied head


def greedy(logits: jax.Array) -> jax.Array:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, V] -> [B]


def filter_logits(logits: jax.Array, top_k: Union[int, jax.Array], top_p: Union[float, jax.Array]) -> jax.Array:
    """Top-k, then top-p (the smallest set of most likely tokens whose probability reaches
    top_p, the most likely always kept), as transformers' warpers do; the rest -inf. top_k and
    top_p: one value for every row, or one per row, [B, 1] (0 and 1: no filter), which filter
    exactly as the same values given one row at a time (traced: one program for any values)."""
    V = logits.shape[-1]
    if isinstance(top_k, jax.Array):  # lax.top_k takes one static k: one sort serves every row's
        kth = jnp.take_along_axis(jnp.sort(logits, axis=-1, descending=True), jnp.clip(top_k - 1, 0, V - 1), axis=-1)
        logits = jnp.where((0 < top_k) & (top_k < V) & (logits < kth), -jnp.inf, logits)  # [B, V]
    elif 0 < top_k < V:
        kth = lax.top_k(logits, top_k)[0][:, -1:]  # [B, 1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)  # [B, V]; ties with the k-th stay
    # Per row, top_p 1 removes only what has probability 0 already: the same probabilities
    if isinstance(top_p, jax.Array) or top_p < 1.0:
        order = jnp.argsort(logits, axis=-1, stable=True)  # [B, V], ascending
        ascending = jnp.take_along_axis(logits, order, axis=-1)  # [B, V]
        remove = jnp.cumsum(jax.nn.softmax(ascending, axis=-1), axis=-1) <= 1 - top_p  # [B, V], in ascending order
        remove = remove.at[:, -1].set(False)
        in_vocab_order = jnp.zeros_like(remove).at[jnp.arange(logits.shape[0])[:, None], order].set(remove)  # [B, V]
        logits = jnp.where(in_vocab_order, -jnp.inf, logits)  # [B, V]
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
        logits, cache = model(jnp.maximum(prompt, 0), cache, decoding.pad)  # [B, P, V]
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
