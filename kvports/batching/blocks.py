"""The block manager: which pool block holds which tokens, who shares it, and which are free.

The KV cache is a pool of `num_blocks` blocks of `block_size` token slots each (every layer's
keys and values for those tokens). A sequence's block table lists its blocks in order:
table[j] holds its positions j * block_size .. (j + 1) * block_size - 1. Blocks are
reference-counted: sequences with the same prompt prefix share its full blocks.

Prefix caching: a full block is known by a hash of its tokens chained with the hash of the
block before it, so equal hashes mean equal tokens at equal positions after an equal prefix,
which is what makes the keys and values equal. A freed block keeps its contents and its
hash until the pool needs it for something else: a later request with the same prefix
takes it back without recomputing it. Free blocks are reused oldest-freed first.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvports.shared.errors import UserError

BlockHash = bytes
ROOT_HASH: BlockHash = b""  # the "block before" the first block


def chain_hash(previous: BlockHash, tokens: Sequence[int]) -> BlockHash:
    """A full block's identity: its tokens and, through `previous`, everything before it."""
    digest = hashlib.blake2b(previous, digest_size=16)
    digest.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return digest.digest()


def blocks_for(length: int, block_size: int) -> int:
    """Blocks that hold `length` tokens."""
    return -(-length // block_size)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0  # sequences holding it; 0: free (its contents may still be reused)
    hash: BlockHash | None = None  # set once the block is full and prefix caching is on
    tokens: tuple[int, ...] = ()  # the tokens behind the hash, checked on a hit


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise UserError(
                f"a block pool needs num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}"
            )
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        # A dict as an ordered set: O(1) removal of a cached block taken back, oldest freed first out.
        self.free: dict[int, None] = dict.fromkeys(range(num_blocks))
        self.by_hash: dict[BlockHash, int] = {}
        self.peak_used = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    # ---------------------------------------------------------------- prompts

    def cached_prefix(self, tokens: Sequence[int], reuse: bool = True) -> list[int]:
        """The blocks already holding the longest run of `tokens`' full blocks. The block of the
        last token is never taken from the cache: its logits choose the next token, so it is computed.
        reuse=False: none (a prompt whose every position's logits are wanted is computed whole)."""
        found: list[int] = []
        if not self.prefix_caching or not reuse:
            return found
        previous = ROOT_HASH
        for index in range((len(tokens) - 1) // self.block_size):
            block_tokens = tuple(tokens[index * self.block_size : (index + 1) * self.block_size])
            previous = chain_hash(previous, block_tokens)
            block_id = self.by_hash.get(previous)
            if block_id is None or self.blocks[block_id].tokens != block_tokens:
                break
            found.append(block_id)
        return found

    def can_allocate(self, tokens: Sequence[int], reuse: bool = True) -> bool:
        # A cached block still in use costs nothing; one sitting in the free list costs a free block, as a new one does.
        shared = sum(1 for block_id in self.cached_prefix(tokens, reuse) if self.blocks[block_id].ref_count > 0)
        return blocks_for(len(tokens), self.block_size) - shared <= self.num_free

    def allocate(self, tokens: Sequence[int], reuse: bool = True) -> tuple[list[int], int]:
        """A block table for `tokens` (call can_allocate first) and how many of them the prefix cache
        already holds. Full blocks are registered at once: a sequence admitted in the same step finds
        them too, and gets their keys and values from the same forward (each layer writes before it reads)."""
        cached = self.cached_prefix(tokens, reuse)
        table = []
        for block_id in cached:
            table.append(self.take_cached(block_id))
        previous = self.blocks[cached[-1]].hash if cached else ROOT_HASH
        for index in range(len(cached), blocks_for(len(tokens), self.block_size)):
            block_id = self.take_free()
            table.append(block_id)
            block_tokens = tuple(tokens[index * self.block_size : (index + 1) * self.block_size])
            if len(block_tokens) == self.block_size and previous is not None:
                previous = self.register(block_id, previous, block_tokens)
        return table, len(cached) * self.block_size

    # ---------------------------------------------------------------- decoding

    def needs_block(self, table: Sequence[int], position: int) -> bool:
        """Whether writing `position` needs a block the table does not have yet."""
        return position // self.block_size >= len(table)

    def append_slot(self, table: list[int], tokens: Sequence[int], position: int) -> None:
        """Make room for the token at `position` (tokens[position], computed in the coming step): a new
        block when it starts one (call needs_block and check num_free first), and the block registered
        for prefix caching when it fills one."""
        if self.needs_block(table, position):
            table.append(self.take_free())
        if (position + 1) % self.block_size == 0:
            index = position // self.block_size
            previous = self.blocks[table[index - 1]].hash if index > 0 else ROOT_HASH
            if previous is not None:
                self.register(table[index], previous, tuple(tokens[index * self.block_size : position + 1]))

    # ---------------------------------------------------------------- freeing

    def free_table(self, table: Sequence[int]) -> None:
        # Last block first: a sequence's tail is the least likely to be shared, so it is reused first.
        for block_id in reversed(table):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} freed more often than it was taken")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None

    def forget_prefixes(self) -> None:
        """Drop every hash: after a failed step, registered blocks may hold keys never computed."""
        self.by_hash.clear()
        for block in self.blocks:
            block.hash, block.tokens = None, ()

    # ---------------------------------------------------------------- internals

    def take_free(self) -> int:
        """The oldest free block, for new contents: whatever it held can no longer be found."""
        block = self.blocks[next(iter(self.free))]
        if block.hash is not None and self.by_hash.get(block.hash) == block.block_id:
            del self.by_hash[block.hash]
        block.hash, block.tokens = None, ()
        return self.take_cached(block.block_id)

    def take_cached(self, block_id: int) -> int:
        """One more holder of a block, contents kept (a prefix-cache hit, maybe from the free list)."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1
        self.peak_used = max(self.peak_used, self.num_used)
        return block_id

    def register(self, block_id: int, previous: BlockHash, tokens: tuple[int, ...]) -> BlockHash | None:
        if not self.prefix_caching:
            return None
        block = self.blocks[block_id]
        block.hash, block.tokens = chain_hash(previous, tokens), tokens
        self.by_hash[block.hash] = block_id  # the newest copy: the likeliest to stay alive
        return block.hash
