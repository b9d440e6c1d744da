"""Continuous batching's model half in JAX: a KV cache paged into fixed-size blocks.

Read it beside torch_impl/paged.py: the same names in the same order. What JAX forces to
differ: the pool is a pytree passed into and out of one compiled step (donated, so XLA
writes the blocks in place); every shape is static, so a step runs a fixed number of rows
and blocks per row (the padding rows and blocks masked), and padding tokens' writes go to
an out-of-range block, which the scatter drops, instead of being filtered out.

The block table: row b's j-th block of positions (j * bs .. j * bs + bs - 1) lives in pool
block block_tables[b, j]. Gathering a row's table in order lays its keys out by position,
so logical slot s holds position s; the slots past the row's length are masked.

Shapes: as model.py, plus NB blocks in the pool, bs slots per block, M blocks per row in
this step, S' = M * bs slots a query attends over.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from kvports.jax_impl.model import TinyModel, attention_mask, token_positions
from kvports.jax_impl.sampling import sample_rows
from kvports.jax_impl.split import Static, merge_model, split_once
from kvports.shared.generation import PAD, RowSampling


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class BlockPool:
    # Every running sequence's keys and values, in blocks; a new pool comes back from each step.
    keys: jax.Array  # [L, NB, bs, Hkv, Dh]
    values: jax.Array  # [L, NB, bs, Hkv, Dh]
    # The step's largest shapes: a step runs a rung of rows up to max_batch (decode: 1, 4, 16, ...;
    # prefill: a bucket, in chunks of a few fixed widths) over a rung of blocks a row up to max_blocks
    # (prefill: max_blocks), so a few compiled programs serve every step.
    max_batch: int = dataclasses.field(metadata=dict(static=True))
    max_blocks: int = dataclasses.field(metadata=dict(static=True))


def init_block_pool(model: TinyModel, num_blocks: int, block_size: int, max_batch: int, max_blocks: int) -> BlockPool:
    """The pool, beside the model's weights and at their dtype. max_batch and max_blocks (per
    sequence) fix the compiled step's shapes."""
    config, embedding = model.config, model.emb.embedding[...]
    shape = (config.n_layers, num_blocks, block_size, config.kv_heads, config.head_dim)
    with jax.default_device(next(iter(embedding.devices()))):
        return BlockPool(
            keys=jnp.zeros(shape, dtype=embedding.dtype),
            values=jnp.zeros(shape, dtype=embedding.dtype),
            max_batch=max_batch,
            max_blocks=max_blocks,
        )


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PagedKVCache:
    """One step's view of the pool: which blocks each row reads, where this chunk's tokens go."""

    keys: jax.Array  # [L, NB, bs, Hkv, Dh]: the pool (donated: written in place)
    values: jax.Array  # [L, NB, bs, Hkv, Dh]
    block_tables: jax.Array  # [B, M] int32: row b's blocks in position order (padding: any block, masked)
    length: jax.Array  # [B, 1] int32: each row's tokens already in the pool, where its positions start
    # Static shapes: every token has a slot, padding's in block NB (out of range, so its write is dropped).
    slots: tuple[jax.Array, jax.Array]  # (pool block, offset in it) of each token, [B, T] each

    def key_positions(self, positions: jax.Array) -> jax.Array:
        """[B, S']: slot s holds position s, up to each row's last position in this chunk; -1 after."""
        slots = jnp.arange(self.block_tables.shape[1] * self.keys.shape[2], dtype=jnp.int32)[None, :]  # [1, S']
        return jnp.where(slots <= positions[:, -1:], slots, -1)  # [B, S']: every row's last column is a real token

    def mask(self, positions: jax.Array, padded: bool, window: int | None) -> jax.Array:
        """Which keys each of this chunk's queries sees: [B, 1, T, S']. Never None: rows differ in length."""
        return attention_mask(positions, self.key_positions(positions), window)  # [B, 1, T, S']

    def update(self, layer: int, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array, PagedKVCache]:
        """Write this chunk's k and v into their blocks; each row's blocks gathered, [B, Hkv, S', Dh],
        and the new cache (JAX cannot write in place: the donated pool lets XLA do it)."""
        blocks, offsets = self.slots
        # Every row writes before any row reads: a row that found its prefix in a block another row
        # computes in this same step reads it after this layer's write.
        keys = self.keys.at[layer, blocks, offsets].set(k.transpose(0, 2, 1, 3), mode="drop")  # [B, T, Hkv, Dh] written
        values = self.values.at[layer, blocks, offsets].set(v.transpose(0, 2, 1, 3), mode="drop")
        cache = dataclasses.replace(self, keys=keys, values=values)
        return cache.gather(keys[layer]), cache.gather(values[layer]), cache

    def gather(self, pool: jax.Array) -> jax.Array:
        # XLA owns the buffers: no reused output here. Blocks hold slots before heads, so the
        # heads-first layout attention takes is a transpose of the gathered rows.
        B, M = self.block_tables.shape
        _, bs, Hkv, Dh = pool.shape
        blocks = jnp.take(pool, self.block_tables.reshape(-1), axis=0)  # [B * M, bs, Hkv, Dh]
        return blocks.reshape(B, M * bs, Hkv, Dh).transpose(0, 2, 1, 3)  # [B, Hkv, S', Dh]: slot s = position s

    def advance(self, positions: jax.Array) -> PagedKVCache:
        return dataclasses.replace(self, length=positions[:, -1:] + 1)  # [B, 1]


def paged_cache(
    pool: BlockPool, block_tables: jax.Array, start: jax.Array, pad: jax.Array | None, T: int
) -> PagedKVCache:
    """The cache a step of T tokens a row runs against: rows start at `start` [B] (tokens already in
    the pool); pad [B] counts each row's left padding (None: none)."""
    length = start[:, None]  # [B, 1]
    positions = token_positions(length, T, pad)  # [B, T]: what the model computes from the same length and padding
    real = positions >= length  # [B, T]: padding sits before the row's first new position (or at -1)
    num_blocks, block_size = pool.keys.shape[1], pool.keys.shape[2]
    blocks = jnp.take_along_axis(block_tables, jnp.maximum(positions, 0) // block_size, axis=1)  # [B, T]
    blocks = jnp.where(real, blocks, num_blocks)  # [B, T]: padding to block NB, dropped
    return PagedKVCache(pool.keys, pool.values, jnp.maximum(block_tables, 0), length, (blocks, positions % block_size))


def paged_step(
    model: TinyModel,
    pool: BlockPool,
    tokens: Sequence[jax.Array],
    start: Sequence[jax.Array],
    block_tables: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    uniform: jax.Array,
    allowed: jax.Array | None = None,
    return_logits: bool = False,
    every_position: bool = False,
) -> tuple[jax.Array, BlockPool, jax.Array | np.ndarray | None]:
    """One step of the running batch: tokens, its [B, T] block (PAD on the left of shorter rows) cut
    into chunks of the fixed widths static_shapes chose, [B, w] each, left to right; start: each
    row's tokens in the pool before each chunk, [B] each; block_tables [B, M] (-1 past a row's
    blocks); each row's sampling settings and draw [B]; allowed [B, V]: the tokens each row may take
    (None: all); return_logits: whether the step's logits leave it too (what the log-probabilities
    are reported from); every_position: every position's logits, not the last one's (a prompt's own
    log-probabilities). Each row's next token [B] (PAD where its logits were not finite), the pool
    with this step's keys and values written in (the one passed in is donated: use the returned
    one), and the step's logits [B, V] (or [B, T, V], joined on the host, or None).
    JAX only: the chunks. Each is one compiled forward of a fixed width, so a few programs serve
    every prompt length and all of them compile before a server is ready (compile_paged_steps)."""
    static, leaves = split_once(model)  # split the first time this model is stepped: every step runs it
    pieces = []
    for chunk, chunk_start in zip(tokens, start, strict=True):
        # Each chunk writes its keys and values before the next reads them: a prompt's later chunks
        # attend to its earlier ones through the pool, as a cached step attends to its prefix.
        last, logits, pool = _paged_forward(static, leaves, pool, chunk, chunk_start, block_tables, every_position)
        pieces.append(logits)
    # Left padding puts every row's last token in the last chunk's last column: sampled from there.
    next_tokens = _sample_rows(last, temperature, top_k, top_p, uniform, allowed)  # [B]
    if not return_logits:
        return next_tokens, pool, None
    # Joined on the host: joining on the device would compile once per number of chunks.
    joined = np.concatenate([np.asarray(piece) for piece in pieces], axis=1) if every_position else None  # [B, T, V]
    return next_tokens, pool, last if joined is None else joined  # [B], the pool, [B, V] or [B, T, V]


# What paged_step compiles: one program per (rows, width) shape, and per every_position; the pool is donated.
@partial(jax.jit, static_argnums=(0, 6), donate_argnames="pool")
def _paged_forward(
    static: Static,
    leaves: list[jax.Array],
    pool: BlockPool,
    tokens: jax.Array,
    start: jax.Array,
    block_tables: jax.Array,
    every_position: bool = False,
) -> tuple[jax.Array, jax.Array | None, BlockPool]:
    model = merge_model(static, leaves)
    # Inside the program, zeros included: an eager sum would compile once per new shape.
    pad = jnp.sum(tokens == PAD, axis=1, dtype=jnp.int32)  # [B]
    cache = paged_cache(pool, block_tables, start, pad, tokens.shape[1])
    logits, cache = model(jnp.maximum(tokens, 0), cache, pad)  # [B, T, V]
    # Left padding puts every row's last token in column T - 1: only its logits leave the program,
    # and every position's too when a prompt's own log-probabilities were asked for (sliced here,
    # not on the host's copy: an eager slice would compile once per shape).
    kept = logits if every_position else None  # [B, T, V] or None
    return logits[:, -1], kept, dataclasses.replace(pool, keys=cache.keys, values=cache.values)  # [B, V], ...


# One program per number of rows, and per whether a mask of allowed tokens comes, whatever the rows' values.
_sample_rows = jax.jit(sample_rows)


def static_shapes(
    max_batch: int,
    max_blocks: int,
    tokens: np.ndarray,
    start: np.ndarray,
    block_tables: np.ndarray,
    sampling: RowSampling,
    every_position: bool = False,
) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray, RowSampling]:
    """A step's NumPy inputs padded to compiled shapes: decode steps (T = 1) to the next of a few
    row counts and blocks a row (decode_sizes: 1, 4, 16, ... rows up to max_batch; 8, 32, 128, ...
    blocks up to max_blocks), so a handful of programs serve every decode step; prefill steps to the
    next size in 1, 2, 3, 4, 6, 8, 12, ... rows (powers of two and their halfway points), and their
    [B, T] block, padded on the left to a multiple of the narrowest chunk width, cut into chunks of
    CHUNK_WIDTHS (step_shape): each chunk's tokens [rows, w] and each row's tokens in the pool before
    it [rows], their block tables to max_blocks. Padding rows are all PAD and greedy: nothing of
    theirs is written, and their tokens are dropped."""
    B, T = tokens.shape
    rows, widths = step_shape(max_batch, B, T, every_position)
    blocks = step_blocks(max_blocks, block_tables.shape[1], T, every_position)
    width = sum(widths)
    tokens = np.pad(tokens, ((0, rows - B), (width - T, 0)), constant_values=PAD)  # [rows, width]: more left padding
    start = np.pad(start, (0, rows - B))  # [rows]
    # [rows, width + 1]: each row's real tokens before each column (left padding: the prompt's count)
    before = np.concatenate([np.zeros((rows, 1), np.int64), np.cumsum(tokens != PAD, axis=1)], axis=1)
    edges = np.cumsum((0, *widths))  # [chunks + 1]: each chunk's first column, and the block's end
    chunks = [(tokens[:, edges[i] : edges[i + 1]], start + before[:, edges[i]]) for i in range(len(widths))]
    block_tables = np.pad(block_tables, ((0, rows - B), (0, blocks - block_tables.shape[1])), constant_values=-1)
    sampling = RowSampling(
        np.pad(sampling.temperature, (0, rows - B)),  # [rows]
        np.pad(sampling.top_k, (0, rows - B)),
        np.pad(sampling.top_p, (0, rows - B), constant_values=1.0),
        np.pad(sampling.uniform, (0, rows - B)),
        None if sampling.allowed is None else np.pad(sampling.allowed, ((0, rows - B), (0, 0)), constant_values=True),
    )
    return chunks, block_tables, sampling


# The widths a prefill step's block runs in, narrowest first. Why chunks: a width per prompt length
# would be a program per length (147 at a server's defaults, growing with --max-length); these few,
# times the row counts, are every program a server runs, compiled before it is ready. 16: a short
# prompt (a chat's) pads at most 15 columns; 64: a long one runs in calls whose fixed cost (reading
# every weight, gathering each row's blocks) is small next to their compute (docs/SERVING.md).
CHUNK_WIDTHS = (16, 64)


def step_shape(max_batch: int, B: int, T: int, every_position: bool = False) -> tuple[int, tuple[int, ...]]:
    """The compiled rows, and the chunk widths left to right, a step of B rows of T tokens runs in
    (static_shapes' padding): T rounded up to a multiple of the narrowest width, the widest
    chunks first from the right. A step of one token a row runs as a decode step, unless every
    position's logits are asked for."""
    if T == 1 and not every_position:
        return _rung(B, decode_sizes(max_batch, 1)), (1,)
    narrowest = CHUNK_WIDTHS[0]
    left = -(-T // narrowest) * narrowest  # columns still to cut, from the right
    widths: list[int] = []
    for width in reversed(CHUNK_WIDTHS):
        widths += [width] * (left // width)
        left %= width
    return min(max_batch, _bucket(B)), tuple(reversed(widths))


# A decode step reads every weight once whatever its rows, then gathers each row's blocks and
# attends over them: at SmolLM2's serve defaults (16 rows of 64 blocks of 16 slots) one step's forward
# took 235 ms, 69 ms over 8 blocks a row and 26 ms for one row over 8 (2 cores). So a decode step
# runs in the fewest rows, and blocks a row, of a ladder that grows 4x a rung: a few programs, none
# more than 4x the work the step needs.
DECODE_RUNG = 4
DECODE_MIN_BLOCKS = 8  # the fewest blocks a row a decode step reads: 128 slots at the default block size, 16


def step_blocks(max_blocks: int, M: int, T: int, every_position: bool = False) -> int:
    """The blocks a row a step of T tokens a row runs over, its longest row having M."""
    return _rung(M, block_rungs(max_blocks, T, every_position))


def block_rungs(max_blocks: int, T: int, every_position: bool = False) -> list[int]:
    """Every count of blocks a row a step of T tokens a row can run over (compile_paged_steps compiles
    each): a decode step's rungs of decode_sizes; a prefill chunk's, every row's max_blocks."""
    if T == 1 and not every_position:
        return decode_sizes(max_blocks, DECODE_MIN_BLOCKS)
    return [max_blocks]


def decode_sizes(largest: int, smallest: int) -> list[int]:
    """The rungs of a decode step's rows (or blocks a row): smallest, DECODE_RUNG times that, ...,
    up to largest, which is always the last."""
    sizes = [smallest]
    while sizes[-1] * DECODE_RUNG < largest:
        sizes.append(sizes[-1] * DECODE_RUNG)
    return [size for size in sizes if size < largest] + [largest]


def _rung(n: int, sizes: list[int]) -> int:
    """The smallest of sizes (ascending, the last the largest there is) at least n."""
    return next((size for size in sizes if size >= n), sizes[-1])


def _bucket(n: int) -> int:
    """The smallest of 1, 2, 3, 4, 6, 8, 12, 16, ... at least n."""
    power = 1 << max(0, n - 1).bit_length()  # the next power of two
    return power * 3 // 4 if power >= 4 and n <= power * 3 // 4 else power
