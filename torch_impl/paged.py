"""Continuous batching's model half in PyTorch: a KV cache paged into fixed-size blocks.

Read it beside jax_impl/paged.py and numpy_impl/paged.py: the same names in the same
order. The scheduler (kvports/batching) decides which sequences run and owns their block
tables; this file writes each step's keys and values into the pool's blocks and gathers
each row's blocks back for attention. TinyModel.forward runs unchanged: PagedKVCache has
KVCache's interface (length, mask, update, advance).

The block table: row b's j-th block of positions (j * bs .. j * bs + bs - 1) lives in pool
block block_tables[b, j]. Gathering a row's table in order lays its keys out by position,
so logical slot s holds position s; the slots past the row's length are masked.

Shapes: as model.py, plus NB blocks in the pool, bs slots per block, M blocks per row in
this step, S' = M * bs slots a query attends over.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvports.shared.generation import PAD
from kvports.torch_impl.model import TinyModel, attention_mask, token_positions
from kvports.torch_impl.sampling import sample_rows


@dataclass
class BlockPool:
    # Every running sequence's keys and values, in blocks; written in place.
    keys: torch.Tensor  # [L, NB, bs, Hkv, Dh]
    values: torch.Tensor  # [L, NB, bs, Hkv, Dh]


def init_block_pool(model: TinyModel, num_blocks: int, block_size: int, max_batch: int, max_blocks: int) -> BlockPool:
    """The pool, beside the model's weights and at their dtype. max_batch and max_blocks (per
    sequence) fix JAX's step shapes; eager steps take the shapes each step has."""
    config, weight = model.config, model.emb.weight
    shape = (config.n_layers, num_blocks, block_size, config.kv_heads, config.head_dim)
    return BlockPool(
        keys=torch.zeros(shape, dtype=weight.dtype, device=weight.device),
        values=torch.zeros(shape, dtype=weight.dtype, device=weight.device),
    )


@dataclass
class PagedKVCache:
    """One step's view of the pool: which blocks each row reads, where this chunk's tokens go."""

    keys: torch.Tensor  # [L, NB, bs, Hkv, Dh]: the pool itself, not a copy
    values: torch.Tensor  # [L, NB, bs, Hkv, Dh]
    block_tables: torch.Tensor  # [B, M] int64: row b's blocks in position order (padding: any block, masked)
    length: torch.Tensor  # [B, 1] int64: each row's tokens already in the pool, where its positions start
    # (row, column) of this chunk's real tokens, [W] each: padding is not written
    written: tuple[torch.Tensor, torch.Tensor]
    slots: tuple[torch.Tensor, torch.Tensor]  # (pool block, offset in it) of each real token, [W] each
    gathered: tuple[torch.Tensor, torch.Tensor]  # [B * M, bs, Hkv, Dh] each: every row's blocks, refilled by each layer

    def key_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """[B, S']: slot s holds position s, up to each row's last position in this chunk; -1 after."""
        slots = torch.arange(self.block_tables.shape[1] * self.keys.shape[2])[None, :]  # [1, S']
        return torch.where(slots <= positions[:, -1:], slots, -1)  # [B, S']: every row's last column is a real token

    def mask(self, positions: torch.Tensor, padded: bool, window: int | None) -> torch.Tensor:
        """Which keys each of this chunk's queries sees: [B, 1, T, S']. Never None: rows differ in length."""
        return attention_mask(positions, self.key_positions(positions), window)  # [B, 1, T, S']

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this chunk's k and v into their blocks; each row's blocks gathered, [B, Hkv, S', Dh]."""
        rows, columns = self.written
        blocks, offsets = self.slots
        # Every row writes before any row reads: a row that found its prefix in a block another row
        # computes in this same step reads it after this layer's write.
        self.keys[layer, blocks, offsets] = k[rows, :, columns]  # [W, Hkv, Dh]
        self.values[layer, blocks, offsets] = v[rows, :, columns]  # [W, Hkv, Dh]
        return self.gather(self.keys[layer], self.gathered[0]), self.gather(self.values[layer], self.gathered[1])

    def gather(self, pool: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        # One copy, into a buffer the step reuses (a fresh tensor this size costs its page faults
        # again at every layer); blocks hold slots before heads, so the heads-first layout
        # attention takes is a view.
        B, M = self.block_tables.shape
        _, bs, Hkv, Dh = pool.shape
        torch.index_select(pool, 0, self.block_tables.flatten(), out=out)  # [B * M, bs, Hkv, Dh]
        return out.view(B, M * bs, Hkv, Dh).transpose(1, 2)  # [B, Hkv, S', Dh]: slot s = position s

    def advance(self, positions: torch.Tensor) -> PagedKVCache:
        self.length = positions[:, -1:] + 1  # [B, 1]
        return self


def paged_cache(
    pool: BlockPool,
    block_tables: torch.Tensor,
    start: torch.Tensor,
    pad: torch.Tensor | None,
    T: int,
) -> PagedKVCache:
    """The cache a step of T tokens a row runs against: rows start at `start` [B] (tokens already in
    the pool); pad [B] counts each row's left padding (None: none)."""
    length = start[:, None]  # [B, 1]
    positions = token_positions(length, T, pad)  # [B, T]: what the model computes from the same length and padding
    real = positions >= length  # [B, T]: padding sits before the row's first new position (or at -1)
    rows, columns = real.nonzero(as_tuple=True)  # [W] each
    block_size = pool.keys.shape[2]
    real_positions = positions[rows, columns]  # [W]
    blocks = block_tables[rows, real_positions // block_size]  # [W]
    buffer_shape = (block_tables.numel(),) + pool.keys.shape[2:]  # [B * M, bs, Hkv, Dh]
    gathered = (pool.keys.new_empty(buffer_shape), pool.values.new_empty(buffer_shape))
    return PagedKVCache(
        pool.keys,
        pool.values,
        block_tables.clamp(min=0),
        length,
        (rows, columns),
        (blocks, real_positions % block_size),
        gathered,
    )


@torch.inference_mode()
def paged_step(
    model: TinyModel,
    pool: BlockPool,
    tokens: torch.Tensor,
    start: torch.Tensor,
    block_tables: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniform: torch.Tensor,
    allowed: torch.Tensor | None = None,
    return_logits: bool = False,
    every_position: bool = False,
) -> tuple[torch.Tensor, BlockPool, torch.Tensor | None]:
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
    pad = (tokens == PAD).sum(dim=1)  # [B]
    pad = pad if bool(pad.any()) else None  # decode steps and equal-length prefills skip the padding arithmetic
    cache = paged_cache(pool, block_tables, start, pad, T)
    logits, _ = model(tokens.clamp(min=0), cache, pad)  # [B, T, V]
    # Left padding puts every row's last token in column T - 1: its logits choose the next token [B].
    next_tokens = sample_rows(logits[:, -1], temperature, top_k, top_p, uniform, allowed)  # [B]
    kept = logits if every_position else logits[:, -1]  # [B, T, V] or [B, V]
    return next_tokens, pool, kept if return_logits else None  # [B], the pool, the logits or None
