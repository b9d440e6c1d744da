"""Generation in PyTorch: the loops that run model.py's TinyModel, naive and cached.

One loop for both (gpt-fast's shape): `decode_one_token` makes the next token from the whole
history (naive) or from the last token through the KV cache (cached), and `decode_n_tokens`
repeats it; `generate_cached` fills the cache with the prompt in one forward first. What a
generation reads at every step is one `Decoding`, what the loop carries one `DecodeState`.
Read it beside jax_impl/generate.py and numpy_impl/generate.py: the same names in the same order.

Shapes: B batch, T tokens in this call, P prompt, N new tokens, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from kvports.shared.generation import PAD, GenerationConfig, check_finite, dtype_name, uniforms
from kvports.torch_impl.model import KVCache, TinyModel, init_cache
from kvports.torch_impl.sampling import choose

# on_token(token [B]) is called as each new token is made (streaming, per-step timing); the
# tokens stay on the device: whoever wants them on the host pays for the copy.
OnToken = Optional[Callable[[torch.Tensor], None]]


@dataclass(frozen=True)
class Decoding:
    """What a generation reads at every step and never changes, by name: built once by
    start_generation, passed whole to every step."""

    pad: Optional[torch.Tensor]  # [B]: each row's left padding (None when no row is padded)
    draws: torch.Tensor  # [B, N]: each row's uniform for each new token
    stops: torch.Tensor  # [K]: the stop ids
    generation: GenerationConfig
    dtype: str  # the model's, for the message when a forward overflows it


@dataclass
class DecodeState:
    """What the decode loop carries from one token to the next, by name."""

    step: int  # new tokens made so far
    tokens: torch.Tensor  # [B, P + N]: the prompt, then the new tokens (PAD after a row stops)
    done: torch.Tensor  # [B] bool: the rows that have stopped
    nonfinite: torch.Tensor  # [2] int64: (step, row) of the first logits with an inf or a NaN in a running row, or -1s
    step_logits: Optional[List[torch.Tensor]]  # [B, V] each: what each token was chosen from, when asked for
    cache: Optional[KVCache]  # None: naive, the whole history again at every step


def start_generation(
    prompt: torch.Tensor, generation: GenerationConfig, dtype: torch.dtype
) -> Tuple[Decoding, torch.Tensor]:
    """What both loops need: the generation's constants (each row's left padding, its draws,
    the stop ids, the model's dtype) and the token buffer [B, P + N] with the prompt in it."""
    B, P = prompt.shape
    padding = (prompt == PAD).sum(dim=1)  # [B]
    # The one host look before the loop: unpadded batches skip every mask they can
    pad = padding if bool(padding.any()) else None
    # [B, N]: each row's stream, keyed by its seed
    draws = torch.from_numpy(uniforms(generation.row_seeds(B), generation.max_new_tokens)).to(prompt.device)
    stops = torch.tensor(generation.stop_ids, dtype=prompt.dtype, device=prompt.device)  # [K]
    tokens = torch.full((B, P + generation.max_new_tokens), PAD, dtype=prompt.dtype, device=prompt.device)  # [B, P + N]
    tokens[:, :P] = prompt
    return Decoding(pad, draws, stops, generation, dtype_name(dtype)), tokens


def no_nonfinite(device: torch.device) -> torch.Tensor:
    return torch.full((2,), -1, dtype=torch.int64, device=device)  # [2]: no step's logits have overflowed yet


def first_nonfinite(logits: torch.Tensor, done: torch.Tensor, step: int, nonfinite: torch.Tensor) -> torch.Tensor:
    """(step, row) of the first step whose logits [B, V] hold an inf or a NaN in a running row, kept
    from the first such step on [2]. Carried, not raised here: no host look per step."""
    bad = ~torch.isfinite(logits).all(dim=-1) & ~done  # [B]
    found = torch.stack([torch.tensor(step, device=bad.device), bad.int().argmax()])  # [2]
    return torch.where((nonfinite[0] < 0) & bad.any(), found, nonfinite)


def check_logits(state: DecodeState, decoding: Decoding) -> None:
    """Stop the run at the first step whose logits were not finite: one line naming it (a host look at two numbers)."""
    check_finite(state.nonfinite.tolist(), decoding.dtype)


def next_token(
    state: DecodeState, logits: torch.Tensor, cache: Optional[KVCache], decoding: Decoding
) -> Tuple[DecodeState, torch.Tensor]:
    """The token [B] at state.step chosen from its logits [B, V] and written; the state one step on."""
    column = state.tokens.shape[1] - decoding.draws.shape[1] + state.step  # P + step
    uniform = decoding.draws[:, state.step]  # [B]
    token, done = choose(logits, decoding.generation, uniform, state.done, decoding.stops)  # [B], [B]
    nonfinite = first_nonfinite(logits, state.done, state.step, state.nonfinite)  # [2]
    state.tokens[:, column] = token
    if state.step_logits is not None:
        state.step_logits.append(logits)
    return DecodeState(state.step + 1, state.tokens, done, nonfinite, state.step_logits, cache), token


def decode_one_token(model: TinyModel, state: DecodeState, decoding: Decoding) -> Tuple[DecodeState, torch.Tensor]:
    """One step of either loop: the logits of the token at state.step, then next_token."""
    column = state.tokens.shape[1] - decoding.draws.shape[1] + state.step  # P + step
    if state.cache is None:
        # The whole history again
        logits, cache = model(state.tokens[:, :column].clamp(min=0), pad=decoding.pad)  # [B, column, V]
    else:
        # A stopped row feeds PAD as token 0: its outputs are never used.
        token = state.tokens[:, column - 1 : column].clamp(min=0)  # [B, 1]
        logits, cache = model(token, state.cache, decoding.pad)  # [B, 1, V]
    return next_token(state, logits[:, -1], cache, decoding)


def decode_n_tokens(model: TinyModel, state: DecodeState, decoding: Decoding, on_token: OnToken) -> DecodeState:
    """The one loop: decode_one_token until N new tokens, or until every row has stopped;
    on_token(token [B]) after each. Logits that overflowed stop it with an error: at once when
    streaming (no token made from them is heard), else after the loop (no host look per step)."""
    generation = decoding.generation
    for _ in range(state.step, generation.max_new_tokens):
        if generation.stop_ids and bool(state.done.all()):
            break  # every row has stopped (a host look per step, only when there are stop ids)
        state, token = decode_one_token(model, state, decoding)
        if on_token is not None:
            check_logits(state, decoding)
            on_token(token)
    check_logits(state, decoding)
    return state


def finish(state: DecodeState) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """tokens [B, P + N] and, when asked for, the step logits [B, steps, V]."""
    return state.tokens, None if state.step_logits is None else torch.stack(state.step_logits, dim=1)


@torch.inference_mode()
def generate_naive(
    model: TinyModel,
    prompt: torch.Tensor,
    generation: GenerationConfig,
    return_logits: bool = False,
    on_token: OnToken = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Recompute the whole history every step: O(n^2) work per token.
    prompt [B, P], PAD on the left of shorter rows -> tokens [B, P + N], PAD after a row stops."""
    model.eval()  # pitfall 3: dropout off, or the two paths disagree
    decoding, tokens = start_generation(prompt, generation, model.emb.weight.dtype)
    done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)  # [B]
    state = DecodeState(0, tokens, done, no_nonfinite(prompt.device), [] if return_logits else None, None)
    return finish(decode_n_tokens(model, state, decoding, on_token))


@torch.inference_mode()
def generate_cached(
    model: TinyModel,
    prompt: torch.Tensor,
    generation: GenerationConfig,
    return_logits: bool = False,
    prefill: bool = True,
    on_token: OnToken = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Prefill the prompt in one forward, then one token per step against the cache.
    prefill=False is pitfall 2 on purpose: the same tokens from P forwards instead of one."""
    model.eval()  # pitfall 3: dropout off, or the two paths disagree
    B, P = prompt.shape
    decoding, tokens = start_generation(prompt, generation, model.emb.weight.dtype)
    cache = init_cache(model.config, B, P + generation.max_new_tokens, model.emb.weight.dtype)
    if prefill:
        logits, cache = model(prompt.clamp(min=0), cache, decoding.pad, logits_to_keep=1)  # [B, 1, V]
    else:
        for i in range(P):
            logits, cache = model(prompt[:, i : i + 1].clamp(min=0), cache, decoding.pad)  # [B, 1, V]
    done = torch.zeros(B, dtype=torch.bool, device=prompt.device)  # [B]
    state = DecodeState(0, tokens, done, no_nonfinite(prompt.device), [] if return_logits else None, cache)
    state, token = next_token(state, logits[:, -1], cache, decoding)  # the prefill's logits choose it
    if on_token is not None:
        check_logits(state, decoding)
        on_token(token)
    return finish(decode_n_tokens(model, state, decoding, on_token))


# A forward against the cache, as its own call (port.forward_chunks feeds chunks through it;
# in JAX it is the compiled, cache-donating forward).
@torch.inference_mode()
def prefill(
    model: TinyModel, prompt: torch.Tensor, cache: KVCache, pad: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, KVCache]:
    return model(prompt, cache, pad)  # [B, P, V], cache
