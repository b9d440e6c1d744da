"""The NumPy port: the seed's TinyModel in plain NumPy, with a preallocated KV cache.

The model and its cache, nothing else: the loops are generate.py's (the sampling rule
sampling.py's), and the weights' memory layout for OpenBLAS is fast/'s, applied to a loaded
model from outside. Read it beside torch_impl/model.py: the same names in the same order.
NumPy has no torch.nn, so numpy_impl/nn.py and numpy_impl/functional.py stand in for it,
imported as `nn` and `F`: the model's lines then read as the reference's. NumPy also defaults
to float64, so every array made here takes the model's dtype.

Shapes: B batch, T tokens in this call, P prompt, N new tokens, S cache slots, S' keys a
query attends over, D d_model, H query heads, Hkv key/value heads, G = H / Hkv, Dh head
dim, V vocabulary, L layers, K positions whose logits are kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import numpy as np
from numpy.typing import DTypeLike

import kvports.numpy_impl.functional as F
import kvports.numpy_impl.nn as nn
from kvports.shared.config import ModelConfig, cache_slots
from kvports.shared.rope import rope_frequencies


@dataclass
class KVCache:
    # Written in place by position; NumPy arrays are mutable, as torch's buffers are.
    keys: np.ndarray  # [L, B, Hkv, S, Dh], S = slots (prompt + new tokens, or a ring for the window)
    values: np.ndarray  # [L, B, Hkv, S, Dh]
    slot_positions: np.ndarray  # [B, S] int64: the position each slot holds in each row, -1 while empty or padding
    length: int  # columns written so far; a column is one step of every row (rows differ by their left padding)
    window: Optional[int]  # the sliding window, or None

    def writes_first(self, T: int) -> bool:
        # A chunk is written first and attended from the buffer: no copy of the history. Only a chunk
        # wider than a ring's spare slots would overwrite keys its own first queries still need.
        slots = self.keys.shape[3]
        return self.window is None or slots < self.window or T <= slots - self.window + 1

    def filled(self, count: int) -> int:
        """How many slots the keys span once `count` more columns are written: a shape that grows is
        free in eager mode."""
        return min(self.length + count, self.keys.shape[3])

    def slot_index(self, column: int, count: int) -> Union[slice, np.ndarray]:
        """The slots of columns [column, column + count), slot = column mod S: a slice while they do
        not wrap around a ring, so writes and reads are views rather than gathers."""
        slots = self.keys.shape[3]
        if column % slots + count <= slots:
            return slice(column % slots, column % slots + count)
        return np.arange(column, column + count) % slots  # [count]

    def mask(self, positions: np.ndarray, padded: bool, window: Optional[int]) -> Optional[np.ndarray]:
        """Which keys each of this chunk's queries sees through `window` (a layer's; the ring's is
        self.window): [B, 1, T, S'], or None when all of them do."""
        B, T = positions.shape
        if not self.writes_first(T):
            filled = self.filled(0)
            key_positions = np.concatenate(
                [self.slot_positions[:, :filled], np.broadcast_to(positions, (self.slot_positions.shape[0], T))], axis=1
            )
            return attention_mask(positions, key_positions, window)  # [B, 1, T, S']
        filled = self.filled(T)
        if T == 1 and not padded and (window is None or filled <= window):
            return None  # one new token over the slots filled so far: every one is visible
        key_positions = self.slot_positions.copy()  # [B, S]: as this chunk's write leaves them
        key_positions[:, self.slot_index(self.length, T)] = positions
        return attention_mask(positions, key_positions[:, :filled], window)  # [B, 1, T, S']

    def update(self, layer: int, k: np.ndarray, v: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """Write this chunk's k and v at their slots; the keys and values to attend over."""
        T, slots = k.shape[2], self.keys.shape[3]
        if self.writes_first(T):
            index = self.slot_index(self.length, T)
            self.keys[layer][:, :, index] = k
            self.values[layer][:, :, index] = v
            filled = self.filled(T)
            return self.keys[layer, :, :, :filled], self.values[layer, :, :, :filled]  # [B, Hkv, S', Dh] views
        filled, keep = self.filled(0), min(T, slots)  # a chunk wider than the ring keeps its newest
        keys = np.concatenate([self.keys[layer, :, :, :filled], k], axis=2)  # [B, Hkv, S', Dh]
        values = np.concatenate([self.values[layer, :, :, :filled], v], axis=2)  # [B, Hkv, S', Dh]
        index = self.slot_index(self.length + T - keep, keep)
        self.keys[layer][:, :, index] = k[:, :, -keep:]
        self.values[layer][:, :, index] = v[:, :, -keep:]
        return keys, values

    def advance(self, positions: np.ndarray) -> KVCache:
        # After every layer has read the old slot positions: they change once per forward.
        T, slots = positions.shape[1], self.keys.shape[3]
        keep = min(T, slots)
        self.slot_positions[:, self.slot_index(self.length + T - keep, keep)] = positions[:, -keep:]
        self.length += T
        return self

    def crop(self, length: int) -> KVCache:
        """Take back every column from `length` on (rejected speculative tokens): their slots read
        as empty again, as if never written. A ring sized with spare slots lost nothing still needed."""
        slots = self.keys.shape[3]
        newest = self.length - 1 - (self.length - 1 - np.arange(slots)) % slots  # [S]: the last column each slot took
        self.slot_positions[:, newest >= length] = -1
        self.length = length
        return self


def init_cache(config: ModelConfig, batch: int, total_len: int, dtype: DTypeLike, chunk: int = 1) -> KVCache:
    slots = cache_slots(config, total_len, chunk)
    shape = (config.n_layers, batch, config.kv_heads, slots, config.head_dim)
    return KVCache(
        keys=np.zeros(shape, dtype=dtype),
        values=np.zeros(shape, dtype=dtype),
        slot_positions=np.full((batch, slots), -1, dtype=np.int64),
        length=0,
        window=config.ring_window,
    )


def token_positions(start: Union[int, np.ndarray], length: int, pad: Optional[np.ndarray]) -> np.ndarray:
    # Pitfall 1: in cache mode the new tokens' positions start at the cache length, not 0.
    # start: the cache's length (an int; per row, [B, 1], in a paged cache).
    positions = start + np.arange(length, dtype=np.int64)[None, :]  # [1, T]; [B, T] where start is per row, [B, 1]
    if pad is None:
        return positions
    # [B, T]: a left-padded row counts from its first token; -1 on padding
    return np.maximum(positions - pad[:, None], -1)


def attention_mask(query_positions: np.ndarray, key_positions: np.ndarray, window: Optional[int]) -> np.ndarray:
    # Built from positions, not indices: the same rule serves a full prompt, a cached step, a
    # ring buffer and left padding. With keys 0..S-1 and queries S-T..S-1 it is the seed's
    # triu(ones(T, S), diagonal=S - T + 1), inverted (True here means visible).
    query, key = query_positions[:, None, :, None], key_positions[:, None, None, :]  # [B, 1, T, 1], [B, 1, 1, S]
    visible = (key <= query) & ((key >= 0) | (query < 0))  # [B, 1, T, S]: padding sees only padding, never nothing
    if window is not None:
        visible = visible & (key > query - window)  # [B, 1, T, S]
    return visible


# cos and sin, [B, 1, T, Dh] each: what every layer rotates q and k by
Rope = Tuple[np.ndarray, np.ndarray]


def rope_tables(positions: np.ndarray, frequencies: np.ndarray, dtype: DTypeLike) -> Rope:
    # frequencies [Dh/2] float64, shared.rope's: plain, or Llama 3's scaled ones
    angles = positions.astype(np.float64)[:, None, :, None] * frequencies  # [B, 1, T, Dh/2]: one table for every head
    angles = np.concatenate([angles, angles], axis=-1)  # [B, 1, T, Dh]
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    # Half-split rotation, the layout Hugging Face's Llama checkpoints use.
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)  # [B, H, T, Dh]
    return x * cos + rotated * sin  # [B, H, T, Dh]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        self.eps = eps
        self.weight = np.ones((dim,), dtype=np.float32)

    def forward(self, x: np.ndarray) -> np.ndarray:
        # NumPy has no rsqrt. sum / D, not mean: the same float, without ndarray.mean's Python bookkeeping.
        mean_square = np.square(x).sum(-1, keepdims=True) / x.shape[-1]  # [B, T, 1]
        return x * (1.0 / np.sqrt(mean_square + self.eps)) * self.weight  # [B, T, D]


def make_norm(config: ModelConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(config.d_model, config.norm_eps)
    return nn.LayerNorm(config.d_model, eps=config.norm_eps)


class FeedForward(nn.Module):
    """Seed: Sequential(Linear(d, 4d), GELU(), Linear(4d, d)); `0` and `2` keep its names.
    SwiGLU and Gemma's GELU-gated MLP fuse gate and up into `0` (gate first), as qkv fuses q, k and v."""

    def __init__(self, config: ModelConfig):
        self.activation = config.activation
        gated = 2 if config.gated else 1
        setattr(self, "0", nn.Linear(config.d_model, gated * config.ffn_dim, bias=config.ffn_bias))
        setattr(self, "2", nn.Linear(config.ffn_dim, config.d_model, bias=config.ffn_bias))

    def forward(self, x: np.ndarray) -> np.ndarray:
        h = getattr(self, "0")(x)  # [B, T, ffn_dim] (gated: [B, T, 2 * ffn_dim])
        if self.activation in ("swiglu", "geglu_tanh"):
            gate, up = F.split(h, [h.shape[-1] // 2] * 2)  # [B, T, ffn_dim] each
            h = (F.silu(gate) if self.activation == "swiglu" else F.gelu_tanh(gate)) * up
        elif self.activation == "gelu_tanh":
            h = F.gelu_tanh(h)
        else:
            h = F.gelu(h)  # exact erf form, as the seed's nn.GELU()
        return getattr(self, "2")(h)  # [B, T, D]


class Block(nn.Module):
    def __init__(self, config: ModelConfig, rng: np.random.Generator):
        self.config = config
        # Construction order is the seed's, so named_parameters lists the state_dict order.
        self.ln1, self.ln2 = make_norm(config), make_norm(config)
        self.qkv = nn.Linear(config.d_model, config.qkv_dim, bias=config.attn_bias or config.qkv_bias)
        self.proj = nn.Linear(config.n_heads * config.head_dim, config.d_model, bias=config.attn_bias)
        self.ffn = FeedForward(config)
        if config.qk_norm:  # Qwen3, Gemma 3: each head's queries and keys normalised over Dh
            self.q_norm = RMSNorm(config.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.norm_eps)
        if config.post_norms:  # Gemma 3: attention's output and the MLP's normalised too
            self.ln1_post, self.ln2_post = make_norm(config), make_norm(config)
        self.dropout = nn.Dropout(config.dropout, rng)  # pitfall 3: active only in train mode

    def attention(
        self, x: np.ndarray, rope: Optional[Rope], mask: Optional[np.ndarray], cache: Optional[KVCache], layer: int
    ) -> np.ndarray:
        config = self.config
        B, T, D = x.shape
        H, Hkv, Dh = config.n_heads, config.kv_heads, config.head_dim
        q, k, v = F.split(self.qkv(x), [H * Dh, Hkv * Dh, Hkv * Dh])  # [B, T, H Dh], [B, T, Hkv Dh] x 2
        q = q.reshape(B, T, H, Dh).transpose(0, 2, 1, 3)  # [B, H, T, Dh]
        k = k.reshape(B, T, Hkv, Dh).transpose(0, 2, 1, 3)  # [B, Hkv, T, Dh]
        v = v.reshape(B, T, Hkv, Dh).transpose(0, 2, 1, 3)  # [B, Hkv, T, Dh]
        if config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)  # [B, H, T, Dh], [B, Hkv, T, Dh]
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:
            k, v = cache.update(layer, k, v)  # [B, Hkv, S', Dh]: the cache, this chunk written in
        # GQA: each group of G = H / Hkv query heads shares one k/v head, without copying k and v.
        # [B, H, T, Dh]; scale None: 1 / sqrt(Dh)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=H != Hkv, scale=config.attn_scale)
        out = out.transpose(0, 2, 1, 3).reshape(B, T, H * Dh)  # [B, T, H Dh]: the heads side by side
        return self.proj(out)  # [B, T, D]

    def forward(
        self, x: np.ndarray, rope: Optional[Rope], mask: Optional[np.ndarray], cache: Optional[KVCache], layer: int
    ) -> np.ndarray:
        h = self.attention(self.ln1(x), rope, mask, cache, layer)  # [B, T, D]
        x = x + self.dropout(self.ln1_post(h) if self.config.post_norms else h)  # [B, T, D]
        h = self.ffn(self.ln2(x))  # [B, T, D]
        return x + self.dropout(self.ln2_post(h) if self.config.post_norms else h)  # [B, T, D]


class TinyModel(nn.Module):
    def __init__(self, config: ModelConfig = ModelConfig(), seed: int = 0):
        self.config = config
        self.rng = np.random.default_rng(seed)  # dropout's randomness, shared by every block
        self.emb = nn.Embedding(config.vocab_size, config.d_model)
        if config.positions == "learned":
            self.pos = nn.Embedding(config.max_seq_len, config.d_model)
        self.blocks = [Block(config, self.rng) for _ in range(config.n_layers)]
        self.ln = make_norm(config)
        if not config.tie_embeddings:
            self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(
        self,
        tokens: np.ndarray,
        cache: Optional[KVCache] = None,
        pad: Optional[np.ndarray] = None,
        logits_to_keep: int = 0,
    ) -> Tuple[np.ndarray, Optional[KVCache]]:
        """tokens [B, T] -> logits [B, T, V]; pad [B]: each row's left padding (None: no row is padded);
        logits_to_keep K > 0: the last K positions' logits only, [B, K, V] (a prefill needs its last)."""
        config = self.config
        B, T = tokens.shape
        start = 0 if cache is None else cache.length
        positions = token_positions(start, T, pad)  # [B, T] ([1, T] without padding)
        x = self.emb(tokens)  # [B, T, D]
        x = x * np.asarray(
            config.embed_scale, dtype=x.dtype
        )  # [B, T, D]: Gemma 3's sqrt(D), rounded as transformers does
        if config.positions == "learned":
            x = x + self.pos(np.maximum(positions, 0))  # [B, T, D]; padding borrows position 0, its outputs unused
        windows = [config.layer_window(layer) for layer in range(config.n_layers)]  # None: the layer sees every key
        rope: dict[Optional[int], Rope] = {}  # by window: Gemma 3's two kinds of layer have two RoPE bases
        mask: dict[Optional[int], Optional[np.ndarray]] = {}
        for window in set(windows):
            if config.positions == "rope":
                rope[window] = rope_tables(positions, rope_frequencies(config, window), x.dtype)  # 2 x [B, 1, T, Dh]
            if cache is None:
                mask[window] = attention_mask(positions, positions, window)  # [B, 1, T, T]
            else:
                mask[window] = cache.mask(positions, pad is not None, window)  # [B, 1, T, S'], or None
        for layer, block in enumerate(self.blocks):
            x = block(x, rope.get(windows[layer]), mask[windows[layer]], cache, layer)  # [B, T, D]
        if cache is not None:
            cache = cache.advance(positions)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]  # [B, K, D]: the head (V x D a position) is a model's largest product
        x = self.ln(x)  # [B, T, D] ([B, K, D] where logits_to_keep is set)
        if config.tie_embeddings:
            return F.linear(x, self.emb.weight), cache  # [B, T, V]: the head is the embedding, read as a matrix
        return self.head(x), cache  # [B, T, V]
