"""The cache a torch.compile'd forward takes: KVCache with its length a tensor.

Torch only: eager mode attends over the slots filled so far (a shape that grows is free), but
under torch.compile every new shape, and every new Python int the graph reads, is a recompile.
With the length a tensor every decode step is one graph of one shape: it attends over every
slot, the empty ones masked. kvports/baselines/torch_compile.py passes this cache to generate_cached.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvports.shared.config import ModelConfig
from kvports.torch_impl.model import KVCache, init_cache


@dataclass
class CompiledKVCache(KVCache):
    length: torch.Tensor  # [] int64: columns written so far, read inside the graph

    def filled(self, count: int) -> int:
        return self.keys.shape[3]  # every slot, whatever the length: one shape at every step

    def slot_index(self, column: torch.Tensor, count: int) -> torch.Tensor:
        return (column + torch.arange(count)) % self.keys.shape[3]  # [count]: a traced column may wrap

    def mask(self, positions: torch.Tensor, padded: bool) -> torch.Tensor:
        # Never None: the empty slots are attended too, so they must be masked even when no row is padded.
        mask = super().mask(positions, padded=True)  # [B, 1, T, S]
        assert mask is not None
        return mask


def init_compiled_cache(
    config: ModelConfig, batch: int, total_len: int, dtype: torch.dtype, chunk: int = 1
) -> CompiledKVCache:
    cache = init_cache(config, batch, total_len, dtype, chunk)
    fields = {field.name: getattr(cache, field.name) for field in dataclasses.fields(cache)}
    return CompiledKVCache(**{**fields, "length": torch.zeros((), dtype=torch.int64)})
