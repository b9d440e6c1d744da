"""Speculative decoding in NumPy: a cheap draft proposes K tokens, the target checks them
all in one forward, keeps the longest prefix it agrees with and adds its own next token. The
output is the target's own: token for token its greedy output, or, when sampling, a draw
from its distribution (the accept/resample rule in `verify`).

Read it beside torch_impl/speculative.py and jax_impl/speculative.py. The draft is another
TinyModel with the same vocabulary, or None for prompt lookup: propose what followed the
latest earlier occurrence of the last n tokens, no second model.

Both caches are written position by position and taken back with `crop`: rejected tokens
leave them as if never written. A batch moves as one: every row keeps as many proposals as
the least lucky row, then one more token (its own next proposal where its target agreed
with it, else the target's correction), so no row ever gets a token its target would not.

Shapes: B batch, P prompt, N new tokens, K proposals per round, V vocabulary, E tokens so far.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvports.numpy_impl.generate import first_nonfinite, no_nonfinite, start_generation
from kvports.numpy_impl.model import KVCache, TinyModel, init_cache
from kvports.numpy_impl.sampling import draw, probabilities, sample
from kvports.shared.generation import PAD, GenerationConfig, check_finite, speculative_uniforms


def propose_ngram(tokens: np.ndarray, end: int, n: int, draft_tokens: int) -> np.ndarray:
    """Prompt lookup: for each row of tokens [B, >= E], the K tokens that followed the latest
    earlier occurrence of its last n tokens (its last token repeated where there is none)."""
    history = tokens[:, :end]  # [B, E]
    if end <= n:
        return np.repeat(history[:, -1:], draft_tokens, axis=1)  # [B, K]: too short to hold an earlier n-gram
    windows = np.stack([history[:, i : end - n + i] for i in range(n)], axis=-1)  # [B, E - n, n]: every earlier n-gram
    found = (windows == history[:, None, end - n :]).all(axis=-1)  # [B, E - n]
    latest = np.where(found, np.arange(end - n), -1).max(axis=1, initial=-1)  # [B], -1 where none
    start = np.where(latest >= 0, latest + n, end - 1)  # [B]: where the proposal is copied from
    index = np.minimum(start[:, None] + np.arange(draft_tokens), end - 1)  # [B, K]
    return np.take_along_axis(history, index, axis=1)  # [B, K]


def propose_draft(
    draft: TinyModel,
    draft_cache: KVCache,
    tokens: np.ndarray,
    end: int,
    pad: np.ndarray | None,
    generation: GenerationConfig,
    uniform: np.ndarray,
    draft_tokens: int,
) -> tuple[np.ndarray, np.ndarray | None, KVCache]:
    """K proposals [B, K] from the draft model, and the probabilities they were drawn from
    [B, K, V] (None when greedy). The draft's cache always lacks the last two tokens here: the
    one before the last is fed again (the same key and value in the same slot), so one rule
    serves a round after a rejection and a round after every proposal was kept."""
    draft_cache = draft_cache.crop(end - 2)
    logits, draft_cache = draft(np.maximum(tokens[:, end - 2 : end], 0), draft_cache, pad)  # [B, 2, V]
    proposals: list[np.ndarray] = []
    drawn_from: list[np.ndarray] = []
    for i in range(draft_tokens):
        if i > 0:
            logits, draft_cache = draft(proposals[-1][:, None], draft_cache, pad)  # [B, 1, V]
        proposals.append(sample(logits[:, -1], generation, uniform[:, i]))  # [B]
        if not generation.greedy:
            drawn_from.append(probabilities(logits[:, -1], generation))  # [B, V]
    q = np.stack(drawn_from, axis=1) if drawn_from else None  # [B, K, V]
    return np.stack(proposals, axis=1), q, draft_cache  # [B, K]


def verify(
    target_logits: np.ndarray,
    q: np.ndarray | None,
    proposals: np.ndarray,
    generation: GenerationConfig,
    uniform: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """target_logits [B, K + 1, V] for the last token and the K proposals; q [B, K, V] what the
    proposals were drawn from (None: greedy, or a lookup's certain proposals); uniform [B, K + 1].
    -> accepted [B], how many proposals each row keeps, and final [B], its token after them."""
    K = proposals.shape[1]
    if generation.greedy:
        choice = target_logits.argmax(axis=-1)  # [B, K + 1]: what the target itself emits at each place
        accepted = (proposals == choice[:, :K]).cumprod(axis=1).sum(axis=1)  # [B]: the longest agreeing prefix
        return accepted, np.take_along_axis(choice, accepted[:, None], axis=1)[
            :, 0
        ]  # its correction, or the bonus token
    p = probabilities(target_logits, generation)  # [B, K + 1, V]
    if q is None:
        q = (proposals[..., None] == np.arange(p.shape[-1])).astype(p.dtype)  # [B, K, V]: a lookup proposes for certain
    p_proposed = np.take_along_axis(p[:, :K], proposals[..., None], axis=2)[..., 0]  # [B, K]
    q_proposed = np.take_along_axis(q, proposals[..., None], axis=2)[..., 0]  # [B, K]
    # Keep a proposal with probability min(1, p / q): what the draft proposes too often is cut to the target's share...
    accepted = (uniform[:, :K] * q_proposed < p_proposed).cumprod(axis=1).sum(axis=1)  # [B]
    # ...and after the last one kept, draw from what the draft proposed too rarely, max(p - q, 0); after all K, from p.
    residual = np.concatenate([np.maximum(p[:, :K] - q, 0), p[:, K:]], axis=1)  # [B, K + 1, V]
    at_rejection = np.take_along_axis(residual, accepted[:, None, None], axis=1)[:, 0]  # [B, V]
    return accepted, draw(at_rejection, uniform[:, K])


def first_nonfinite_in_round(
    logits: np.ndarray, q: np.ndarray | None, used: np.ndarray, step: int, nonfinite: np.ndarray
) -> np.ndarray:
    """(step, row) of the first token a round emitted from logits [B, K + 1, V] holding an inf or a
    NaN, or from a sampled draft's probabilities q [B, K, V] holding one (they decide whether a
    proposal stays, and the token drawn where one is rejected); used [B, K + 1]: the places that
    chose a running row's token (the rest are rejected or come after a stop, never used); step:
    the new token at place 0. Kept once found [2]."""
    bad = ~np.isfinite(logits).all(axis=-1)  # [B, K + 1]
    if q is not None:
        drafted = ~np.isfinite(q[:, : bad.shape[1]]).all(axis=-1)  # [B, K]
        bad[:, : drafted.shape[1]] |= drafted
    bad &= used
    place = bad.any(axis=0).astype(np.int64).argmax()  # []: the first place any row overflowed
    found = np.stack([step + place, bad[:, place].astype(np.int64).argmax()])  # [2]
    return np.where((nonfinite[0] < 0) & bad.any(), found, nonfinite)


def generate_speculative(
    model: TinyModel,
    draft: TinyModel | None,
    prompt: np.ndarray,
    generation: GenerationConfig,
    draft_tokens: int,
    ngram: int = 2,
    on_token: Callable[[np.ndarray], None] | None = None,
) -> tuple[np.ndarray, dict[str, int]]:
    """prompt [B, P] (PAD on the left of shorter rows) -> tokens [B, P + N], the target's own
    output, and counts: rounds, target forwards, proposals made and accepted."""
    model.eval()  # pitfall 3: dropout off, or the two paths disagree
    B, P = prompt.shape
    N, K = generation.max_new_tokens, draft_tokens
    decoding, tokens = start_generation(prompt, generation, model.emb.weight.dtype)
    pad, stops = decoding.pad, decoding.stops
    tokens = np.concatenate([tokens, np.full((B, K + 1), PAD, dtype=tokens.dtype)], axis=1)  # room for a round past N
    first, rounds = speculative_uniforms(generation.row_seeds(B), N, K)  # [B], [B, N, 2K + 1]
    # A verified chunk is K + 1 wide and partly taken back: a ring keeps K spare slots for it.
    cache = init_cache(model.config, B, P + N + K + 1, model.emb.weight.dtype, chunk=K + 1)
    logits, cache = model(np.maximum(prompt, 0), cache, pad)  # [B, P, V]: the target's cache lacks only the last token
    if draft is not None:
        draft.eval()
        draft_cache = init_cache(draft.config, B, P + N + K + 1, draft.emb.weight.dtype, chunk=K + 1)
        if P > 1:
            _, draft_cache = draft(np.maximum(prompt[:, :-1], 0), draft_cache, pad)  # the draft's lacks the last two
    token = sample(logits[:, -1], generation, first)  # [B]
    tokens[:, P] = token
    done = np.zeros(B, dtype=bool)  # [B]
    nonfinite = first_nonfinite(logits[:, -1], done, 0, no_nonfinite())  # [2]
    if on_token is not None:
        check_finite(nonfinite.tolist(), decoding.dtype)
        on_token(token)
    done = np.isin(token, stops)  # [B]
    counts = dict(rounds=0, target_forwards=1, proposed=0, accepted=0)
    end = P + 1  # tokens so far in every row
    # Until N tokens, every row has stopped, or a round's logits overflowed
    while end < P + N and not done.all() and nonfinite[0] < 0:
        uniform = rounds[:, counts["rounds"]]  # [B, 2K + 1]: K for the draft, K to accept, 1 for the last token
        if draft is None:
            proposals, q = propose_ngram(tokens, end, ngram, K), None  # [B, K]
        else:
            proposals, q, draft_cache = propose_draft(draft, draft_cache, tokens, end, pad, generation, uniform, K)
        # [B, K + 1]: the last token, then the proposals
        chunk = np.maximum(np.concatenate([tokens[:, end - 1 : end], proposals], axis=1), 0)
        logits, cache = model(chunk, cache, pad)  # [B, K + 1, V]: one target forward checks all K
        accepted, final = verify(logits, q, proposals, generation, uniform[:, K:])  # [B], [B]
        kept = int(accepted[~done].min())  # the batch moves as one: as far as its least lucky row
        # [B]: agreed proposal, or the target's token
        extra = np.where(accepted > kept, proposals[:, min(kept, K - 1)], final)
        emitted = np.concatenate([proposals[:, :kept], extra[:, None]], axis=1)  # [B, kept + 1]
        cache = cache.crop(end + kept)  # the last token and the kept proposals stay; the rest never happened
        place = np.arange(K + 1)  # [K + 1]
        stop = np.isin(emitted, stops)  # [B, kept + 1]
        after_stop = np.concatenate([np.zeros_like(stop[:, :1]), stop.cumsum(axis=1)[:, :-1] > 0], axis=1)
        used = (place[: kept + 1] < P + N - end) & ~done[:, None] & ~after_stop  # [B, kept + 1]
        nonfinite = first_nonfinite_in_round(logits[:, : kept + 1], q, used, end - P, nonfinite)  # [2]
        counts["rounds"] += 1
        counts["target_forwards"] += 1
        counts["proposed"] += K * int((~done).sum())
        counts["accepted"] += int(accepted[~done].sum())
        for i in range(min(kept + 1, P + N - end)):
            token = np.where(done, PAD, emitted[:, i])  # [B]; a stopped row stays stopped
            tokens[:, end + i] = token
            if on_token is not None:
                if nonfinite[0] == end - P + i:
                    check_finite(nonfinite.tolist(), decoding.dtype)  # no token made from overflowed logits is heard
                on_token(token)
            done |= np.isin(token, stops)
        end += kept + 1
    check_finite(nonfinite.tolist(), decoding.dtype)
    return tokens[:, : P + N], counts  # [B, P + N]
