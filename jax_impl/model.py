"""The JAX/Flax port: the seed's TinyModel in flax.nnx, with a preallocated KV cache.

The model and its cache, nothing else: the loops are generate.py's (the sampling rule
sampling.py's), and whatever makes a loaded model faster, smaller or split across devices is
fast/'s, applied from outside. Read it beside torch_impl/model.py: the same names in the same
order. What JAX forces to differ: the cache is an immutable pytree passed into and out of
compiled calls (donated, so XLA writes it in place), writes return a new cache instead of
mutating, and shapes are static under jit (every slot is attended, the empty ones masked).
float64 needs JAX's x64 mode, which port.py turns on around its calls (not for the process):
every dtype below is pinned, so no array's dtype depends on it.

Shapes: B batch, T tokens in this call, P prompt, N new tokens, S cache slots, S' keys a
query attends over, D d_model, H query heads, Hkv key/value heads, G = H / Hkv, Dh head
dim, V vocabulary, L layers, K positions whose logits are kept.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.typing import DTypeLike

import kvports.jax_impl.functional as F
from kvports.shared.config import ModelConfig, cache_slots
from kvports.shared.rope import rope_frequencies


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

    def mask(self, positions: jax.Array, padded: bool, window: Optional[int]) -> jax.Array:
        """Which keys each of this chunk's queries sees through `window`: [B, 1, T, S'], over every
        slot (shapes are static under jit), the empty ones masked."""
        B, T = positions.shape
        if not self.writes_first(T):
            key_positions = jnp.concatenate(
                [self.slot_positions, jnp.broadcast_to(positions, (self.slot_positions.shape[0], T))], axis=1
            )
            return attention_mask(positions, key_positions, window)  # [B, 1, T, S']
        # [B, S]: as this chunk's write leaves them
        key_positions = self.slot_positions.at[:, self.slot_index(self.length, T)].set(positions)
        return attention_mask(positions, key_positions, window)  # [B, 1, T, S']

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
        window=config.ring_window,
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


def rope_tables(positions: jax.Array, frequencies: np.ndarray, dtype: DTypeLike) -> Rope:
    # frequencies [Dh/2] float64, shared.rope's: plain, or Llama 3's scaled ones
    angles = positions.astype(jnp.float64)[:, None, :, None] * frequencies  # [B, 1, T, Dh/2]: one table for every head
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
    SwiGLU and Gemma's GELU-gated MLP fuse gate and up into `0` (gate first), as qkv fuses q, k and v."""

    def __init__(self, config: ModelConfig, *, dtype: DTypeLike, rngs: nnx.Rngs):
        self.activation = config.activation
        gated = 2 if config.gated else 1
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
        h = getattr(self, "0")(x)  # [B, T, ffn_dim] (gated: [B, T, 2 * ffn_dim])
        if self.activation in ("swiglu", "geglu_tanh"):
            gate, up = jnp.split(h, 2, axis=-1)  # [B, T, ffn_dim] each
            h = (jax.nn.silu(gate) if self.activation == "swiglu" else jax.nn.gelu(gate, approximate=True)) * up
        elif self.activation == "gelu_tanh":
            h = jax.nn.gelu(h, approximate=True)
        else:
            h = jax.nn.gelu(h, approximate=False)  # exact erf form, as the seed's nn.GELU()
        return getattr(self, "2")(h)  # [B, T, D]


class Block(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype: DTypeLike, rngs: nnx.Rngs):
        self.config = config
        self.ln1, self.ln2 = make_norm(config, dtype, rngs), make_norm(config, dtype, rngs)
        bias = config.attn_bias or config.qkv_bias
        self.qkv = nnx.Linear(config.d_model, config.qkv_dim, use_bias=bias, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.proj = nnx.Linear(
            config.n_heads * config.head_dim,
            config.d_model,
            use_bias=config.attn_bias,
            dtype=dtype,
            param_dtype=dtype,
            rngs=rngs,
        )
        self.ffn = FeedForward(config, dtype=dtype, rngs=rngs)
        if config.qk_norm:  # Qwen3, Gemma 3: each head's queries and keys normalised over Dh
            self.q_norm = RMSNorm(config.head_dim, config.norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(config.head_dim, config.norm_eps, dtype=dtype)
        if config.post_norms:  # Gemma 3: attention's output and the MLP's normalised too
            self.ln1_post, self.ln2_post = make_norm(config, dtype, rngs), make_norm(config, dtype, rngs)
        self.dropout = nnx.Dropout(config.dropout, rngs=rngs)  # pitfall 3: active only in train mode

    def attention(
        self, x: jax.Array, rope: Optional[Rope], mask: Optional[jax.Array], cache: Optional[KVCache], layer: int
    ) -> Tuple[jax.Array, Optional[KVCache]]:
        # Returns (out, cache): the cache cannot be written in place, so the new one comes back.
        config = self.config
        B, T, D = x.shape
        H, Hkv, Dh = config.n_heads, config.kv_heads, config.head_dim
        q, k, v = jnp.split(self.qkv(x), [H * Dh, (H + Hkv) * Dh], axis=-1)  # [B, T, H Dh], [B, T, Hkv Dh] x 2
        q = q.reshape(B, T, H, Dh).transpose(0, 2, 1, 3)  # [B, H, T, Dh]
        k = k.reshape(B, T, Hkv, Dh).transpose(0, 2, 1, 3)  # [B, Hkv, T, Dh]
        v = v.reshape(B, T, Hkv, Dh).transpose(0, 2, 1, 3)  # [B, Hkv, T, Dh]
        if config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)  # [B, H, T, Dh], [B, Hkv, T, Dh]
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:
            k, v, cache = cache.update(layer, k, v)  # [B, Hkv, S', Dh]: the cache, this chunk written in
        # GQA: each group of G = H / Hkv query heads shares one k/v head, without copying k and v.
        # [B, H, T, Dh]; scale None: 1 / sqrt(Dh)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=H != Hkv, scale=config.attn_scale)
        out = out.transpose(0, 2, 1, 3).reshape(B, T, H * Dh)  # [B, T, H Dh]: the heads side by side
        return self.proj(out), cache  # [B, T, D]

    def __call__(
        self, x: jax.Array, rope: Optional[Rope], mask: Optional[jax.Array], cache: Optional[KVCache], layer: int
    ) -> Tuple[jax.Array, Optional[KVCache]]:
        h, cache = self.attention(self.ln1(x), rope, mask, cache, layer)  # [B, T, D]
        x = x + self.dropout(self.ln1_post(h) if self.config.post_norms else h)  # [B, T, D]
        h = self.ffn(self.ln2(x))  # [B, T, D]
        return x + self.dropout(self.ln2_post(h) if self.config.post_norms else h), cache  # [B, T, D]


class TinyModel(nnx.Module):
    # nnx builds parameters eagerly, so it needs their dtype and a random source here;
    # port.load_model then overwrites every parameter with the file's.
    def __init__(self, config: ModelConfig = ModelConfig(), *, dtype: DTypeLike = jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.emb = nnx.Embed(config.vocab_size, config.d_model, dtype=dtype, param_dtype=dtype, rngs=rngs)
        if config.positions == "learned":
            self.pos = nnx.Embed(config.max_seq_len, config.d_model, dtype=dtype, param_dtype=dtype, rngs=rngs)
        # nnx.List, not a list: nnx refuses a plain list of modules as an attribute.
        self.blocks = nnx.List([Block(config, dtype=dtype, rngs=rngs) for _ in range(config.n_layers)])
        self.ln = make_norm(config, dtype, rngs)
        if not config.tie_embeddings:
            self.head = nnx.Linear(
                config.d_model, config.vocab_size, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs
            )

    def __call__(
        self,
        tokens: jax.Array,
        cache: Optional[KVCache] = None,
        pad: Optional[jax.Array] = None,
        logits_to_keep: int = 0,
    ) -> Tuple[jax.Array, Optional[KVCache]]:
        """tokens [B, T] -> logits [B, T, V]; pad [B]: each row's left padding (None: no row is padded);
        logits_to_keep K > 0: the last K positions' logits only, [B, K, V] (a prefill needs its last)."""
        config = self.config
        B, T = tokens.shape
        start = 0 if cache is None else cache.length
        positions = token_positions(start, T, pad)  # [B, T] ([1, T] without padding)
        x = self.emb(tokens)  # [B, T, D]
        x = x * jnp.asarray(
            config.embed_scale, dtype=x.dtype
        )  # [B, T, D]: Gemma 3's sqrt(D), rounded as transformers does
        if config.positions == "learned":
            x = x + self.pos(jnp.maximum(positions, 0))  # [B, T, D]; padding borrows position 0, its outputs unused
        windows = [config.layer_window(layer) for layer in range(config.n_layers)]  # None: the layer sees every key
        rope: dict[Optional[int], Rope] = {}  # by window: Gemma 3's two kinds of layer have two RoPE bases
        mask: dict[Optional[int], Optional[jax.Array]] = {}
        for window in set(windows):
            if config.positions == "rope":
                rope[window] = rope_tables(positions, rope_frequencies(config, window), x.dtype)  # 2 x [B, 1, T, Dh]
            if cache is None:
                mask[window] = attention_mask(positions, positions, window)  # [B, 1, T, T]
            else:
                mask[window] = cache.mask(positions, pad is not None, window)  # [B, 1, T, S']
        for layer, block in enumerate(self.blocks):
            x, cache = block(x, rope.get(windows[layer]), mask[windows[layer]], cache, layer)  # [B, T, D]
        if cache is not None:
            cache = cache.advance(positions)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]  # [B, K, D]: the head (V x D a position) is a model's largest product
        x = self.ln(x)  # [B, T, D] ([B, K, D] where logits_to_keep is set)
        if config.tie_embeddings:
            return F.linear(x, self.emb.embedding[...]), cache  # [B, T, V]: the head is the embedding, read as a matrix
        return self.head(x), cache  # [B, T, V]
