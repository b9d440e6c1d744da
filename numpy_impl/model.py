"""The NumPy port: the seed's TinyModel in plain NumPy, with a preallocated KV cache.

Read it beside torch_impl/model.py: the same names in the same order. NumPy has no
torch.nn, so numpy_impl/nn.py and numpy_impl/functional.py stand in for it, imported
as `nn` and `F`: the model's lines then read as the reference's.
NumPy also defaults to float64, so every array made here takes the model's dtype.

Shapes: B batch, T tokens in this call, P prompt, N new tokens, S cache slots, S' keys a
query attends over, D d_model, H query heads, Hkv key/value heads, G = H / Hkv, Dh head
dim, V vocabulary, L layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple, Union

import numpy as np
from numpy.typing import DTypeLike

import kvports.numpy_impl.functional as F
import kvports.numpy_impl.nn as nn
from kvports.shared.config import ModelConfig, cache_slots
from kvports.shared.generation import PAD, GenerationConfig, check_finite, dtype_name, uniforms


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

    def mask(self, positions: np.ndarray, padded: bool) -> Optional[np.ndarray]:
        """Which keys each of this chunk's queries sees: [B, 1, T, S'], or None when all of them do."""
        B, T = positions.shape
        if not self.writes_first(T):
            filled = self.filled(0)
            key_positions = np.concatenate(
                [self.slot_positions[:, :filled], np.broadcast_to(positions, (self.slot_positions.shape[0], T))], axis=1
            )
            return attention_mask(positions, key_positions, self.window)  # [B, 1, T, S']
        filled = self.filled(T)
        if T == 1 and not padded and (self.window is None or filled <= self.window):
            return None  # one new token over the slots filled so far: every one is visible
        key_positions = self.slot_positions.copy()  # [B, S]: as this chunk's write leaves them
        key_positions[:, self.slot_index(self.length, T)] = positions
        return attention_mask(positions, key_positions[:, :filled], self.window)  # [B, 1, T, S']

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
        window=config.sliding_window,
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


def rope_tables(positions: np.ndarray, head_dim: int, theta: float, dtype: DTypeLike) -> Rope:
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))  # [Dh/2]
    angles = positions.astype(np.float64)[:, None, :, None] * inv_freq  # [B, 1, T, Dh/2]: one table for every head
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
    SwiGLU fuses gate and up into `0` (gate first), as qkv fuses q, k and v."""

    def __init__(self, config: ModelConfig):
        self.activation = config.activation
        gated = 2 if config.activation == "swiglu" else 1
        setattr(self, "0", nn.Linear(config.d_model, gated * config.ffn_dim, bias=config.ffn_bias))
        setattr(self, "2", nn.Linear(config.ffn_dim, config.d_model, bias=config.ffn_bias))

    def forward(self, x: np.ndarray) -> np.ndarray:
        h = getattr(self, "0")(x)  # [B, T, ffn_dim] (swiglu: [B, T, 2 * ffn_dim])
        if self.activation == "swiglu":
            half = h.shape[-1] // 2
            gate, up = h[..., :half], h[..., half:]  # [B, T, ffn_dim] each: slices, not np.split, as qkv's
            h = F.silu(gate) * up
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
        self.qkv = nn.Linear(config.d_model, config.qkv_dim, bias=config.attn_bias)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=config.attn_bias)
        self.ffn = FeedForward(config)
        self.dropout = nn.Dropout(config.dropout, rng)  # pitfall 3: active only in train mode

    def attention(
        self, x: np.ndarray, rope: Optional[Rope], mask: Optional[np.ndarray], cache: Optional[KVCache], layer: int
    ) -> np.ndarray:
        config = self.config
        B, T, D = x.shape
        H, Hkv, Dh = config.n_heads, config.kv_heads, config.head_dim
        qkv = self.qkv(x).reshape(B, T, H + 2 * Hkv, Dh).transpose(0, 2, 1, 3)  # [B, H + 2 Hkv, T, Dh]
        # Slices, not np.split: its Python bookkeeping costs more than a decode step's views.
        q, k, v = qkv[:, :H], qkv[:, H : H + Hkv], qkv[:, H + Hkv :]  # [B, H, T, Dh], [B, Hkv, T, Dh], [B, Hkv, T, Dh]
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:
            k, v = cache.update(layer, k, v)  # [B, Hkv, S', Dh]: the cache, this chunk written in
        # GQA: each group of G = H / Hkv query heads shares one k/v head, without copying k and v.
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=H != Hkv)  # [B, H, T, Dh]
        out = out.transpose(0, 2, 1, 3).reshape(B, T, D)  # [B, T, D]
        return self.proj(out)  # [B, T, D]

    def forward(
        self, x: np.ndarray, rope: Optional[Rope], mask: Optional[np.ndarray], cache: Optional[KVCache], layer: int
    ) -> np.ndarray:
        x = x + self.dropout(self.attention(self.ln1(x), rope, mask, cache, layer))  # [B, T, D]
        return x + self.dropout(self.ffn(self.ln2(x)))  # [B, T, D]


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
        self, tokens: np.ndarray, cache: Optional[KVCache] = None, pad: Optional[np.ndarray] = None
    ) -> Tuple[np.ndarray, Optional[KVCache]]:
        """tokens [B, T] -> logits [B, T, V]; pad [B]: each row's left padding (None: no row is padded)."""
        config = self.config
        B, T = tokens.shape
        start = 0 if cache is None else cache.length
        positions = token_positions(start, T, pad)  # [B, T] ([1, T] without padding)
        x = self.emb(tokens)  # [B, T, D]
        rope = None
        if config.positions == "learned":
            x = x + self.pos(np.maximum(positions, 0))  # [B, T, D]; padding borrows position 0, its outputs unused
        else:
            rope = rope_tables(positions, config.head_dim, config.rope_theta, x.dtype)  # 2 x [B, 1, T, Dh]
        mask: Optional[np.ndarray]
        if cache is None:
            mask = attention_mask(positions, positions, config.sliding_window)  # [B, 1, T, T]
        else:
            mask = cache.mask(positions, pad is not None)  # [B, 1, T, S'], or None
        for layer, block in enumerate(self.blocks):
            x = block(x, rope, mask, cache, layer)  # [B, T, D]
        if cache is not None:
            cache = cache.advance(positions)
        x = self.ln(x)  # [B, T, D]
        head_weight = self.emb.weight if config.tie_embeddings else self.head.weight  # [V, D]
        return F.linear(x, head_weight), cache  # [B, T, V]


def greedy(logits: np.ndarray) -> np.ndarray:
    return logits.argmax(axis=-1).astype(np.int64)  # [B, V] -> [B]; argmax gives intp


def filter_logits(logits: np.ndarray, top_k: Union[int, np.ndarray], top_p: Union[float, np.ndarray]) -> np.ndarray:
    """Top-k, then top-p (the smallest set of most likely tokens whose probability reaches
    top_p, the most likely always kept), as transformers' warpers do; the rest -inf. top_k and
    top_p: one value for every row, or one per row, [B, 1] (0 and 1: no filter), which filter
    exactly as the same values given one row at a time."""
    V = logits.shape[-1]
    if isinstance(top_k, np.ndarray):
        kth = np.take_along_axis(-np.sort(-logits, axis=-1), np.clip(top_k - 1, 0, V - 1), axis=-1)  # [B, 1]
        logits = np.where((0 < top_k) & (top_k < V) & (logits < kth), -np.inf, logits)  # [B, V]
    elif 0 < top_k < V:
        kth = -np.partition(-logits, top_k - 1, axis=-1)[:, top_k - 1 : top_k]  # [B, 1]
        logits = np.where(logits < kth, -np.inf, logits)  # [B, V]; ties with the k-th stay
    # Per row, top_p 1 removes only what has probability 0 already: the same probabilities
    if isinstance(top_p, np.ndarray) or top_p < 1.0:
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


# on_token(token [B]) is called as each new token is made (streaming, per-step timing).
OnToken = Optional[Callable[[np.ndarray], None]]


@dataclass(frozen=True)
class Decoding:
    """What a generation reads at every step and never changes, by name: built once by
    start_generation, passed whole to every step."""

    pad: Optional[np.ndarray]  # [B]: each row's left padding (None when no row is padded)
    draws: np.ndarray  # [B, N]: each row's uniform for each new token
    stops: np.ndarray  # [K]: the stop ids
    generation: GenerationConfig
    dtype: str  # the model's, for the message when a forward overflows it


@dataclass
class DecodeState:
    """What the decode loop carries from one token to the next, by name."""

    step: int  # new tokens made so far
    tokens: np.ndarray  # [B, P + N]: the prompt, then the new tokens (PAD after a row stops)
    done: np.ndarray  # [B] bool: the rows that have stopped
    nonfinite: np.ndarray  # [2] int64: (step, row) of the first logits with an inf or a NaN in a running row, or -1s
    step_logits: Optional[List[np.ndarray]]  # [B, V] each: what each token was chosen from, when asked for
    cache: Optional[KVCache]  # None: naive, the whole history again at every step


def start_generation(prompt: np.ndarray, generation: GenerationConfig, dtype: np.dtype) -> Tuple[Decoding, np.ndarray]:
    """What both loops need: the generation's constants (each row's left padding, its draws,
    the stop ids, the model's dtype) and the token buffer [B, P + N] with the prompt in it."""
    B, P = prompt.shape
    padding = (prompt == PAD).sum(axis=1)  # [B]
    pad = padding if padding.any() else None  # unpadded batches skip every mask they can
    # [B, N]: each row's stream, keyed by its seed
    draws = uniforms(generation.row_seeds(B), generation.max_new_tokens)
    stops = np.asarray(generation.stop_ids, dtype=prompt.dtype)  # [K]
    tokens = np.full((B, P + generation.max_new_tokens), PAD, dtype=prompt.dtype)  # [B, P + N]
    tokens[:, :P] = prompt
    return Decoding(pad, draws, stops, generation, dtype_name(dtype)), tokens


def no_nonfinite() -> np.ndarray:
    return np.full(2, -1, dtype=np.int64)  # [2]: no step's logits have overflowed yet


def first_nonfinite(logits: np.ndarray, done: np.ndarray, step: int, nonfinite: np.ndarray) -> np.ndarray:
    """(step, row) of the first step whose logits [B, V] hold an inf or a NaN in a running row, kept
    from the first such step on [2]. Carried, not raised here: no host look per step."""
    bad = ~np.isfinite(logits).all(axis=-1) & ~done  # [B]
    found = np.stack([np.asarray(step), bad.astype(np.int64).argmax()])  # [2]
    return np.where((nonfinite[0] < 0) & bad.any(), found, nonfinite)


def check_logits(state: DecodeState, decoding: Decoding) -> None:
    """Stop the run at the first step whose logits were not finite: one line naming it (a host look at two numbers)."""
    check_finite(state.nonfinite.tolist(), decoding.dtype)


def next_token(
    state: DecodeState, logits: np.ndarray, cache: Optional[KVCache], decoding: Decoding
) -> Tuple[DecodeState, np.ndarray]:
    """The token [B] at state.step chosen from its logits [B, V] and written; the state one step on."""
    column = state.tokens.shape[1] - decoding.draws.shape[1] + state.step  # P + step
    uniform = decoding.draws[:, state.step]  # [B]
    token, done = choose(logits, decoding.generation, uniform, state.done, decoding.stops)  # [B], [B]
    nonfinite = first_nonfinite(logits, state.done, state.step, state.nonfinite)  # [2]
    state.tokens[:, column] = token
    if state.step_logits is not None:
        state.step_logits.append(logits)
    return DecodeState(state.step + 1, state.tokens, done, nonfinite, state.step_logits, cache), token


def decode_one_token(model: TinyModel, state: DecodeState, decoding: Decoding) -> Tuple[DecodeState, np.ndarray]:
    """One step of either loop: the logits of the token at state.step, then next_token."""
    column = state.tokens.shape[1] - decoding.draws.shape[1] + state.step  # P + step
    if state.cache is None:
        # The whole history again
        logits, cache = model(np.maximum(state.tokens[:, :column], 0), pad=decoding.pad)  # [B, column, V]
    else:
        # A stopped row feeds PAD as token 0: its outputs are never used.
        token = np.maximum(state.tokens[:, column - 1 : column], 0)  # [B, 1]
        logits, cache = model(token, state.cache, decoding.pad)  # [B, 1, V]
    return next_token(state, logits[:, -1], cache, decoding)


def decode_n_tokens(model: TinyModel, state: DecodeState, decoding: Decoding, on_token: OnToken) -> DecodeState:
    """The one loop: decode_one_token until N new tokens, or until every row has stopped;
    on_token(token [B]) after each. Logits that overflowed stop it with an error: at once when
    streaming (no token made from them is heard), else after the loop (no host look per step)."""
    generation = decoding.generation
    for _ in range(state.step, generation.max_new_tokens):
        if generation.stop_ids and state.done.all():
            break  # every row has stopped
        state, token = decode_one_token(model, state, decoding)
        if on_token is not None:
            check_logits(state, decoding)
            on_token(token)
    check_logits(state, decoding)
    return state


def finish(state: DecodeState) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """tokens [B, P + N] and, when asked for, the step logits [B, steps, V]."""
    return state.tokens, None if state.step_logits is None else np.stack(state.step_logits, axis=1)


# No inference_mode decorator: NumPy records no autograd graph to switch off.
def generate_naive(
    model: TinyModel,
    prompt: np.ndarray,
    generation: GenerationConfig,
    return_logits: bool = False,
    on_token: OnToken = None,
) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """Recompute the whole history every step: O(n^2) work per token.
    prompt [B, P], PAD on the left of shorter rows -> tokens [B, P + N], PAD after a row stops."""
    model.eval()  # pitfall 3: dropout off, or the two paths disagree
    decoding, tokens = start_generation(prompt, generation, model.emb.weight.dtype)
    done = np.zeros(prompt.shape[0], dtype=bool)  # [B]
    state = DecodeState(0, tokens, done, no_nonfinite(), [] if return_logits else None, None)
    return finish(decode_n_tokens(model, state, decoding, on_token))


def generate_cached(
    model: TinyModel,
    prompt: np.ndarray,
    generation: GenerationConfig,
    return_logits: bool = False,
    prefill: bool = True,
    on_token: OnToken = None,
) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """Prefill the prompt in one forward, then one token per step against the cache.
    prefill=False is pitfall 2 on purpose: the same tokens from P forwards instead of one."""
    model.eval()  # pitfall 3: dropout off, or the two paths disagree
    B, P = prompt.shape
    decoding, tokens = start_generation(prompt, generation, model.emb.weight.dtype)
    cache = init_cache(model.config, B, P + generation.max_new_tokens, model.emb.weight.dtype)
    if prefill:
        logits, cache = model(np.maximum(prompt, 0), cache, decoding.pad)  # [B, P, V]
    else:
        for i in range(P):
            logits, cache = model(np.maximum(prompt[:, i : i + 1], 0), cache, decoding.pad)  # [B, 1, V]
    done = np.zeros(B, dtype=bool)  # [B]
    state = DecodeState(0, tokens, done, no_nonfinite(), [] if return_logits else None, cache)
    state, token = next_token(state, logits[:, -1], cache, decoding)  # the prefill's logits choose it
    if on_token is not None:
        check_logits(state, decoding)
        on_token(token)
    return finish(decode_n_tokens(model, state, decoding, on_token))


# A forward against the cache, as its own call (port.forward_chunks feeds chunks through it;
# in JAX it is the compiled, cache-donating forward).
def prefill(
    model: TinyModel, prompt: np.ndarray, cache: KVCache, pad: Optional[np.ndarray] = None
) -> Tuple[np.ndarray, KVCache]:
    return model(prompt, cache, pad)  # [B, P, V], cache
