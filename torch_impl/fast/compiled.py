"""The cache a torch.compile'd forward takes, KVCache with its length a tensor, and the cached loop
over it (`generate_compiled`, which kvports/baselines/torch_compile.py runs).

Torch only: eager mode attends over the slots filled so far (a shape that grows is free), but
under torch.compile every new shape, and every new Python int the graph reads, is a recompile.
With the length a tensor every decode step is one graph of one shape: it attends over every
slot, the empty ones masked. The loop is generate.py's own; only the cache it starts from differs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvports.shared.config import ModelConfig
from kvports.shared.generation import GenerationConfig
from kvports.torch_impl.generate import (
    DecodeState,
    OnToken,
    check_logits,
    decode_n_tokens,
    finish,
    next_token,
    no_nonfinite,
    start_generation,
)
from kvports.torch_impl.model import KVCache, TinyModel, init_cache


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


def init_compiled_cache(
    config: ModelConfig, batch: int, total_len: int, dtype: torch.dtype, chunk: int = 1
) -> CompiledKVCache:
    cache = init_cache(config, batch, total_len, dtype, chunk)
    fields = {field.name: getattr(cache, field.name) for field in dataclasses.fields(cache)}
    return CompiledKVCache(**{**fields, "length": torch.zeros((), dtype=torch.int64)})


@torch.inference_mode()
def generate_compiled(
    model: TinyModel,
    prompt: torch.Tensor,
    generation: GenerationConfig,
    return_logits: bool = False,
    on_token: OnToken = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """generate.generate_cached over a CompiledKVCache: the prompt in one forward, whose logits
    choose the first token, then generate.py's decode_n_tokens. prompt [B, P] -> tokens [B, P + N]."""
    model.eval()  # pitfall 3: dropout off
    B, P = prompt.shape
    decoding, tokens = start_generation(prompt, generation, model.emb.weight.dtype)
    cache = init_compiled_cache(model.config, B, P + generation.max_new_tokens, model.emb.weight.dtype)
    logits, cache = model(prompt.clamp(min=0), cache, decoding.pad)  # [B, P, V]
    done = torch.zeros(B, dtype=torch.bool, device=prompt.device)  # [B]
    state = DecodeState(0, tokens, done, no_nonfinite(prompt.device), [] if return_logits else None, cache)
    state, token = next_token(state, logits[:, -1], cache, decoding)
    if on_token is not None:
        check_logits(state, decoding)
        on_token(token)
    return finish(decode_n_tokens(model, state, decoding, on_token))
