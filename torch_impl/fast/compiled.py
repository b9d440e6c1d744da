"""The cache a torch.compile'd forward takes, KVCache with its length a tensor, and the cached loop
over it (`generate_compiled`, which kvports/baselines/torch_compile.py runs).

Torch only: eager mode attends over the slots filled so far (a shape that grows is free), but
under torch.compile every new shape, and every new Python int the graph reads, is a recompile.
With the length a tensor every decode step is one graph of one shape: it attends over every
slot, the empty ones masked. The loop is generate.py's generate_cached, called as it is; only the
cache its model's forward receives differs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import cast

import torch

from kvports.shared.generation import GenerationConfig
from kvports.torch_impl.generate import OnToken, generate_cached
from kvports.torch_impl.model import KVCache, TinyModel


@dataclass
class CompiledKVCache(KVCache):
    length: torch.Tensor  # [] int64: columns written so far, read inside the graph

    def filled(self, count: int) -> int:
        return self.keys.shape[3]  # every slot, whatever the length: one shape at every step

    def slot_index(self, column: torch.Tensor, count: int) -> torch.Tensor:
        return (column + torch.arange(count)) % self.keys.shape[3]  # [count]: a traced column may wrap

    def mask(self, positions: torch.Tensor, padded: bool, window: int | None) -> torch.Tensor:
        # Never None: the empty slots are attended too, so they must be masked even when no row is padded.
        mask = super().mask(positions, True, window)  # [B, 1, T, S]
        assert mask is not None
        return mask


def as_compiled(cache: KVCache) -> CompiledKVCache:
    """The same buffers, the length made a tensor: no copy."""
    fields = {field.name: getattr(cache, field.name) for field in dataclasses.fields(cache)}
    return CompiledKVCache(**{**fields, "length": torch.tensor(cache.length, dtype=torch.int64)})


class CompiledCacheModel:
    """The model, called with its cache's length made a tensor: generate_cached allocates a KVCache,
    and its first forward (the prompt's) turns it into a CompiledKVCache, which every later step gets
    back. Only the call is wrapped; generate_cached reads the model's config, emb and eval as they are."""

    def __init__(self, model: TinyModel):
        self.model = model
        self.config = model.config
        self.emb = model.emb

    def eval(self) -> CompiledCacheModel:
        self.model.eval()
        return self

    def __call__(
        self, tokens: torch.Tensor, cache: KVCache, pad: torch.Tensor | None = None, logits_to_keep: int = 0
    ) -> tuple[torch.Tensor, KVCache]:
        if not isinstance(cache, CompiledKVCache):
            cache = as_compiled(cache)
        return self.model(tokens, cache, pad, logits_to_keep=logits_to_keep)  # [B, T or logits_to_keep, V], cache


def generate_compiled(
    model: TinyModel,
    prompt: torch.Tensor,
    generation: GenerationConfig,
    return_logits: bool = False,
    on_token: OnToken = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """generate.generate_cached, its loop unchanged, over a CompiledKVCache. prompt [B, P] -> tokens [B, P + N]."""
    # The wrapper stands in for the model: generate_cached calls it, reads its config and emb, and
    # sets eval mode, nothing else.
    return generate_cached(
        cast(TinyModel, CompiledCacheModel(model)), prompt, generation, return_logits, on_token=on_token
    )
