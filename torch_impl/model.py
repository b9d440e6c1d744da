"""The reference port: the seed's TinyModel in PyTorch, with a preallocated KV cache.

The model and its cache, nothing else: the loops that generate with it are generate.py's
(the sampling rule sampling.py's), and whatever makes a loaded model faster, smaller or split
across devices is fast/'s, applied from outside. Read it beside jax_impl/model.py and
numpy_impl/model.py: the same names in the same order; only what the framework forces differs.

Shapes: B batch, T tokens in this call, P prompt, N new tokens, S cache slots, S' keys a
query attends over, D d_model, H query heads, Hkv key/value heads, G = H / Hkv, Dh head
dim, V vocabulary, L layers, K positions whose logits are kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from kvports.shared.config import ModelConfig, cache_slots
from kvports.shared.rope import rope_frequencies


@dataclass
class KVCache:
    # Written in place by position; PyTorch lets us mutate the buffers we preallocated.
    keys: torch.Tensor  # [L, B, Hkv, S, Dh], S = slots (prompt + new tokens, or a ring for the window)
    values: torch.Tensor  # [L, B, Hkv, S, Dh]
    slot_positions: torch.Tensor  # [B, S] int64: the position each slot holds in each row, -1 while empty or padding
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

    def slot_index(self, column: int, count: int) -> Union[slice, torch.Tensor]:
        """The slots of columns [column, column + count), slot = column mod S: a slice while they do
        not wrap around a ring, so writes and reads are views rather than gathers."""
        slots = self.keys.shape[3]
        if column % slots + count <= slots:
            return slice(column % slots, column % slots + count)
        return (column + torch.arange(count)) % slots  # [count]

    def mask(self, positions: torch.Tensor, padded: bool, window: Optional[int]) -> Optional[torch.Tensor]:
        """Which keys each of this chunk's queries sees through `window` (a layer's; the ring's is
        self.window): [B, 1, T, S'], or None when all of them do."""
        B, T = positions.shape
        if not self.writes_first(T):
            filled = self.filled(0)
            key_positions = torch.cat(
                [self.slot_positions[:, :filled], positions.expand(self.slot_positions.shape[0], T)], dim=1
            )
            return attention_mask(positions, key_positions, window)  # [B, 1, T, S']
        filled = self.filled(T)
        if T == 1 and not padded and (window is None or filled <= window):
            return None  # one new token over the slots filled so far: every one is visible
        key_positions = self.slot_positions.clone()  # [B, S]: as this chunk's write leaves them
        key_positions[:, self.slot_index(self.length, T)] = positions
        return attention_mask(positions, key_positions[:, :filled], window)  # [B, 1, T, S']

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Write this chunk's k and v at their slots; the keys and values to attend over."""
        T, slots = k.shape[2], self.keys.shape[3]
        if self.writes_first(T):
            index = self.slot_index(self.length, T)
            self.keys[layer][:, :, index] = k
            self.values[layer][:, :, index] = v
            filled = self.filled(T)
            return self.keys[layer, :, :, :filled], self.values[layer, :, :, :filled]  # [B, Hkv, S', Dh] views
        filled, keep = self.filled(0), min(T, slots)  # a chunk wider than the ring keeps its newest
        keys = torch.cat([self.keys[layer, :, :, :filled], k], dim=2)  # [B, Hkv, S', Dh]
        values = torch.cat([self.values[layer, :, :, :filled], v], dim=2)  # [B, Hkv, S', Dh]
        index = self.slot_index(self.length + T - keep, keep)
        self.keys[layer][:, :, index] = k[:, :, -keep:]
        self.values[layer][:, :, index] = v[:, :, -keep:]
        return keys, values

    def advance(self, positions: torch.Tensor) -> KVCache:
        # After every layer has read the old slot positions: they change once per forward.
        T, slots = positions.shape[1], self.keys.shape[3]
        keep = min(T, slots)
        self.slot_positions[:, self.slot_index(self.length + T - keep, keep)] = positions[:, -keep:]
        self.length = self.length + T
        return self

    def crop(self, length: int) -> KVCache:
        """Take back every column from `length` on (rejected speculative tokens): their slots read
        as empty again, as if never written. A ring sized with spare slots lost nothing still needed."""
        slots = self.keys.shape[3]
        # [S]: the last column each slot took
        newest = self.length - 1 - (self.length - 1 - torch.arange(slots)) % slots
        self.slot_positions[:, newest >= length] = -1
        self.length = length
        return self


def init_cache(config: ModelConfig, batch: int, total_len: int, dtype: torch.dtype, chunk: int = 1) -> KVCache:
    slots = cache_slots(config, total_len, chunk)
    shape = (config.n_layers, batch, config.kv_heads, slots, config.head_dim)
    return KVCache(
        keys=torch.zeros(shape, dtype=dtype),
        values=torch.zeros(shape, dtype=dtype),
        slot_positions=torch.full((batch, slots), -1, dtype=torch.int64),
        length=0,
        window=config.ring_window,
    )


def token_positions(start: Union[int, torch.Tensor], length: int, pad: Optional[torch.Tensor]) -> torch.Tensor:
    # Pitfall 1: in cache mode the new tokens' positions start at the cache length, not 0.
    # start: the cache's length (an int; per row, [B, 1], in a paged cache).
    positions = start + torch.arange(length)[None, :]  # [1, T]; [B, T] where start is per row, [B, 1]
    if pad is None:
        return positions
    # [B, T]: a left-padded row counts from its first token; -1 on padding
    return (positions - pad[:, None]).clamp(min=-1)


def attention_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, window: Optional[int]) -> torch.Tensor:
    # Built from positions, not indices: the same rule serves a full prompt, a cached step, a
    # ring buffer and left padding. With keys 0..S-1 and queries S-T..S-1 it is the seed's
    # triu(ones(T, S), diagonal=S - T + 1), inverted (True here means visible).
    query, key = query_positions[:, None, :, None], key_positions[:, None, None, :]  # [B, 1, T, 1], [B, 1, 1, S]
    visible = (key <= query) & ((key >= 0) | (query < 0))  # [B, 1, T, S]: padding sees only padding, never nothing
    if window is not None:
        visible = visible & (key > query - window)  # [B, 1, T, S]
    return visible


# cos and sin, [B, 1, T, Dh] each: what every layer rotates q and k by
Rope = Tuple[torch.Tensor, torch.Tensor]


def rope_tables(positions: torch.Tensor, frequencies: np.ndarray, dtype: torch.dtype) -> Rope:
    # frequencies [Dh/2] float64, shared.rope's: plain, or Llama 3's scaled ones
    angles = positions.to(torch.float64)[:, None, :, None] * torch.from_numpy(
        frequencies
    )  # [B, 1, T, Dh/2]: one table for every head
    angles = torch.cat([angles, angles], dim=-1)  # [B, 1, T, Dh]
    return torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Half-split rotation, the layout Hugging Face's Llama checkpoints use.
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # [B, H, T, Dh]
    return x * cos + rotated * sin  # [B, H, T, Dh]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.promote_types(x.dtype, torch.float32))  # [B, T, D]: bfloat16 accumulates in float32
        return (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight  # [B, T, D]


def make_norm(config: ModelConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(config.d_model, config.norm_eps)
    return nn.LayerNorm(config.d_model, eps=config.norm_eps)


class FeedForward(nn.Module):
    """Seed: Sequential(Linear(d, 4d), GELU(), Linear(4d, d)); `0` and `2` keep its names.
    SwiGLU and Gemma's GELU-gated MLP fuse gate and up into `0` (gate first), as qkv fuses q, k and v."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.activation = config.activation
        gated = 2 if config.gated else 1
        self.add_module("0", nn.Linear(config.d_model, gated * config.ffn_dim, bias=config.ffn_bias))
        self.add_module("2", nn.Linear(config.ffn_dim, config.d_model, bias=config.ffn_bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = getattr(self, "0")(x)  # [B, T, ffn_dim] (gated: [B, T, 2 * ffn_dim])
        if self.activation in ("swiglu", "geglu_tanh"):
            gate, up = h.chunk(2, dim=-1)  # [B, T, ffn_dim] each
            h = (F.silu(gate) if self.activation == "swiglu" else F.gelu(gate, approximate="tanh")) * up
        elif self.activation == "gelu_tanh":
            h = F.gelu(h, approximate="tanh")
        else:
            h = F.gelu(h)  # exact erf form, as the seed's nn.GELU()
        return getattr(self, "2")(h)  # [B, T, D]


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        # Construction order is the seed's: it fixes which random numbers each weight gets.
        self.ln1, self.ln2 = make_norm(config), make_norm(config)
        self.qkv = nn.Linear(config.d_model, config.qkv_dim, bias=config.attn_bias or config.qkv_bias)
        self.proj = nn.Linear(config.n_heads * config.head_dim, config.d_model, bias=config.attn_bias)
        self.ffn = FeedForward(config)
        if config.qk_norm:  # Qwen3, Gemma 3: each head's queries and keys normalised over Dh
            self.q_norm = RMSNorm(config.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.norm_eps)
        if config.post_norms:  # Gemma 3: attention's output and the MLP's normalised too
            self.ln1_post, self.ln2_post = make_norm(config), make_norm(config)
        self.dropout = nn.Dropout(config.dropout)  # pitfall 3: active only in train mode

    def attention(
        self, x: torch.Tensor, rope: Optional[Rope], mask: Optional[torch.Tensor], cache: Optional[KVCache], layer: int
    ) -> torch.Tensor:
        config = self.config
        B, T, D = x.shape
        H, Hkv, Dh = config.n_heads, config.kv_heads, config.head_dim
        q, k, v = self.qkv(x).split([H * Dh, Hkv * Dh, Hkv * Dh], dim=-1)  # [B, T, H Dh], [B, T, Hkv Dh] x 2
        q = q.view(B, T, H, Dh).transpose(1, 2)  # [B, H, T, Dh]
        k = k.view(B, T, Hkv, Dh).transpose(1, 2)  # [B, Hkv, T, Dh]
        v = v.view(B, T, Hkv, Dh).transpose(1, 2)  # [B, Hkv, T, Dh]
        if config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)  # [B, H, T, Dh], [B, Hkv, T, Dh]
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:
            k, v = cache.update(layer, k, v)  # [B, Hkv, S', Dh]: the cache, this chunk written in
        # GQA: each group of G = H / Hkv query heads shares one k/v head, without copying k and v.
        # [B, H, T, Dh]; scale None: 1 / sqrt(Dh)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=H != Hkv, scale=config.attn_scale)
        out = out.transpose(1, 2).reshape(B, T, H * Dh)  # [B, T, H Dh]: the heads side by side
        return self.proj(out)  # [B, T, D]

    def forward(
        self, x: torch.Tensor, rope: Optional[Rope], mask: Optional[torch.Tensor], cache: Optional[KVCache], layer: int
    ) -> torch.Tensor:
        h = self.attention(self.ln1(x), rope, mask, cache, layer)  # [B, T, D]
        x = x + self.dropout(self.ln1_post(h) if self.config.post_norms else h)  # [B, T, D]
        h = self.ffn(self.ln2(x))  # [B, T, D]
        return x + self.dropout(self.ln2_post(h) if self.config.post_norms else h)  # [B, T, D]


class TinyModel(nn.Module):
    def __init__(self, config: ModelConfig = ModelConfig()):
        super().__init__()
        self.config = config
        self.emb = nn.Embedding(config.vocab_size, config.d_model)
        if config.positions == "learned":
            self.pos = nn.Embedding(config.max_seq_len, config.d_model)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layers)])
        self.ln = make_norm(config)
        if not config.tie_embeddings:
            self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(
        self,
        tokens: torch.Tensor,
        cache: Optional[KVCache] = None,
        pad: Optional[torch.Tensor] = None,
        logits_to_keep: int = 0,
    ) -> Tuple[torch.Tensor, Optional[KVCache]]:
        """tokens [B, T] -> logits [B, T, V]; pad [B]: each row's left padding (None: no row is padded);
        logits_to_keep K > 0: the last K positions' logits only, [B, K, V] (a prefill needs its last)."""
        config = self.config
        B, T = tokens.shape
        start = 0 if cache is None else cache.length
        positions = token_positions(start, T, pad)  # [B, T] ([1, T] without padding)
        x = self.emb(tokens)  # [B, T, D]
        x = x * torch.tensor(
            config.embed_scale, dtype=x.dtype
        )  # [B, T, D]: Gemma 3's sqrt(D), rounded as transformers does
        if config.positions == "learned":
            x = x + self.pos(positions.clamp(min=0))  # [B, T, D]; padding borrows position 0, its outputs unused
        windows = [config.layer_window(layer) for layer in range(config.n_layers)]  # None: the layer sees every key
        rope: dict[Optional[int], Rope] = {}  # by window: Gemma 3's two kinds of layer have two RoPE bases
        mask: dict[Optional[int], Optional[torch.Tensor]] = {}
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
