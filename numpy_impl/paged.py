"""Continuous batching's model half in NumPy: a KV cache paged into fixed-size blocks.

Read it beside torch_impl/paged.py: the same names in the same order. The scheduler
(kvports/batching) decides which sequences run and owns their block tables; this file
writes each step's keys and values into the pool's blocks and gathers each row's blocks
back for attention. TinyModel.forward runs unchanged: PagedKVCache has KVCache's
interface (length, mask, update, advance).

The block table: row b's j-th block of positions (j * bs .. j * bs + bs - 1) lives in pool
block block_tables[b, j]. Gathering a row's table in order lays its keys out by position,
so logical slot s holds position s; the slots past the row's length are masked.

Shapes: as model.py, plus NB blocks in the pool, bs slots per block, M blocks per row in
this step, S' = M * bs slots a query attends over.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvports.numpy_impl.model import TinyModel, attention_mask, token_positions
from kvports.numpy_impl.sampling import sample_rows
from kvports.shared.generation import PAD


@dataclass
class BlockPool:
    # Every running sequence's keys and values, in blocks; written in place.
    keys: np.ndarray  # [L, NB, bs, Hkv, Dh]
    values: np.ndarray  # [L, NB, bs, Hkv, Dh]


def init_block_pool(model: TinyModel, num_blocks: int, block_size: int, max_batch: int, max_blocks: int) -> BlockPool:
    """The pool, at the model's dtype. max_batch and max_blocks (per sequence) fix JAX's step
    shapes; eager steps take the shapes each step has."""
    config, dtype = model.config, model.emb.weight.dtype
    shape = (config.n_layers, num_blocks, block_size, config.kv_heads, config.head_dim)
    return BlockPool(keys=np.zeros(shape, dtype=dtype), values=np.zeros(shape, dtype=dtype))


@dataclass
class PagedKVCache:
    """One step's view of the pool: which blocks each row reads, where this chunk's tokens go."""

    keys: np.ndarray  # [L, NB, bs, Hkv, Dh]: the pool itself, not a copy
    values: np.ndarray  # [L, NB, bs, Hkv, Dh]
    block_tables: np.ndarray  # [B, M] int64: row b's blocks in position order (padding: any block, masked)
    length: np.ndarray  # [B, 1] int64: each row's tokens already in the pool, where its positions start
    # (row, column) of this chunk's real tokens, [W] each: padding is not written
    written: tuple[np.ndarray, np.ndarray]
    slots: tuple[np.ndarray, np.ndarray]  # (pool block, offset in it) of each real token, [W] each
    gathered: tuple[np.ndarray, np.ndarray]  # [B * M, bs, Hkv, Dh] each: every row's blocks, refilled by each layer

    def key_positions(self, positions: np.ndarray) -> np.ndarray:
        """[B, S']: slot s holds position s, up to each row's last position in this chunk; -1 after."""
        slots = np.arange(self.block_tables.shape[1] * self.keys.shape[2])[None, :]  # [1, S']
        return np.where(slots <= positions[:, -1:], slots, -1)  # [B, S']: every row's last column is a real token

    def mask(self, positions: np.ndarray, padded: bool, window: int | None) -> np.ndarray:
        """Which keys each of this chunk's queries sees: [B, 1, T, S']. Never None: rows differ in length."""
        return attention_mask(positions, self.key_positions(positions), window)  # [B, 1, T, S']

    def update(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Write this chunk's k and v into their blocks; each row's blocks gathered, [B, Hkv, S', Dh]."""
        rows, columns = self.written
        blocks, offsets = self.slots
        # Every row writes before any row reads: a row that found its prefix in a block another row
        # computes in this same step reads it after this layer's write.
        self.keys[layer, blocks, offsets] = k[rows, :, columns]  # [W, Hkv, Dh]
        self.values[layer, blocks, offsets] = v[rows, :, columns]  # [W, Hkv, Dh]
        return self.gather(self.keys[layer], self.gathered[0]), self.gather(self.values[layer], self.gathered[1])

    def gather(self, pool: np.ndarray, out: np.ndarray) -> np.ndarray:
        # One copy, into a buffer the step reuses (a fresh array this size costs its page faults
        # again at every layer); blocks hold slots before heads, so the heads-first layout
        # attention takes is a view.
        B, M = self.block_tables.shape
        _, bs, Hkv, Dh = pool.shape
        np.take(pool, self.block_tables.reshape(-1), axis=0, out=out)  # [B * M, bs, Hkv, Dh]
        return out.reshape(B, M * bs, Hkv, Dh).transpose(0, 2, 1, 3)  # [B, Hkv, S', Dh]: slot s = position s

    def advance(self, positions: np.ndarray) -> PagedKVCache:
        self.length = positions[:, -1:] + 1  # [B, 1]
        return self


def paged_cache(
    pool: BlockPool, block_tables: np.ndarray, start: np.ndarray, pad: np.ndarray | None, T: int
) -> PagedKVCache:
    """The cache a step of T tokens a row runs against: rows start at `start` [B] (tokens already in
    the pool); pad [B] counts each row's left padding (None: none)."""
    length = start[:, None]  # [B, 1]
    positions = token_positions(length, T, pad)  # [B, T]: what the model computes from the same length and padding
    real = positions >= length  # [B, T]: padding sits before the row's first new position (or at -1)
    rows, columns = real.nonzero()  # [W] each
    block_size = pool.keys.shape[2]
    real_positions = positions[rows, columns]  # [W]
    blocks = block_tables[rows, real_positions // block_size]  # [W]
    buffer_shape = (block_tables.size,) + pool.keys.shape[2:]  # [B * M, bs, Hkv, Dh]
    gathered = (np.empty(buffer_shape, dtype=pool.keys.dtype), np.empty(buffer_shape, dtype=pool.values.dtype))
    return PagedKVCache(
        pool.keys,
        pool.values,
        np.maximum(block_tables, 0),
        length,
        (rows, columns),
        (blocks, real_positions % block_size),
        gathered,
    )


# No inference_mode decorator: NumPy records no autograd graph to switch off.
def paged_step(
    model: TinyModel,
    pool: BlockPool,
    tokens: np.ndarray,
    start: np.ndarray,
    block_tables: np.ndarray,
    temperature: np.ndarray,
    top_k: np.ndarray,
    top_p: np.ndarray,
    uniform: np.ndarray,
    allowed: np.ndarray | None = None,
    return_logits: bool = False,
    every_position: bool = False,
) -> tuple[np.ndarray, BlockPool, np.ndarray | None]:
    """One step of the running batch: tokens [B, T] (PAD on the left of shorter rows) after each
    row's `start` [B] tokens in the pool; block_tables [B, M] (-1 past a row's blocks); each row's
    sampling settings and draw [B]; allowed [B, V]: the tokens each row may take (None: all);
    return_logits: whether the step's logits leave it too (what the log-probabilities are reported
    from); every_position: every position's logits, not the last one's (a prompt's own log-probabilities).
    Each row's next token [B] (PAD where its logits were not
    finite), the pool with this step's keys and values written in, and the step's logits [B, V]
    ([B, T, V]) or None."""
    model.eval()
    B, T = tokens.shape
    pad = (tokens == PAD).sum(axis=1)  # [B]
    pad = pad if pad.any() else None  # decode steps and equal-length prefills skip the padding arithmetic
    cache = paged_cache(pool, block_tables, start, pad, T)
    logits, _ = model(np.maximum(tokens, 0), cache, pad)  # [B, T, V]
    # Left padding puts every row's last token in column T - 1: its logits choose the next token [B].
    next_tokens = sample_rows(logits[:, -1], temperature, top_k, top_p, uniform, allowed)  # [B]
    kept = logits if every_position else logits[:, -1]  # [B, T, V] or [B, V]
    return next_tokens, pool, kept if return_logits else None  # [B], the pool, the logits or None
