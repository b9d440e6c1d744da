"""Speculative decoding in JAX: a cheap draft proposes K tokens, the target checks them all
in one forward, keeps the longest prefix it agrees with and adds its own next token. The
output is the target's own: token for token its greedy output, or, when sampling, a draw
from its distribution (the accept/resample rule in `verify`).

Read it beside torch_impl/speculative.py: the same names in the same order. What JAX
forces to differ: the whole loop is one compiled `lax.while_loop` (K fixed, how many
proposals a round keeps a traced number, so acceptance works by masks and dynamic slices,
and every buffer keeps its shape), and the caches go through it as donated pytrees.

Both caches are written position by position and taken back with `crop`: rejected tokens
leave them as if never written. A batch moves as one: every row keeps as many proposals as
the least lucky row, then one more token (its own next proposal where its target agreed
with it, else the target's correction), so no row ever gets a token its target would not.

Shapes: B batch, P prompt, N new tokens, K proposals per round, V vocabulary, L the token buffer.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kvports.jax_impl.generate import first_nonfinite, no_nonfinite, start_generation
from kvports.jax_impl.model import KVCache, TinyModel, init_cache
from kvports.jax_impl.sampling import draw, probabilities, sample
from kvports.jax_impl.split import Static, merge_model, split_model
from kvports.shared.generation import PAD, GenerationConfig, check_finite, speculative_uniforms


def propose_ngram(tokens: jax.Array, end: jax.Array, n: int, draft_tokens: int) -> jax.Array:
    """Prompt lookup: for each row of tokens [B, L], the K tokens that followed the latest
    earlier occurrence of its last n tokens before `end` (its last token repeated where there
    is none). Every n-gram of the buffer is compared, the ones not earlier masked: shapes are static."""
    L = tokens.shape[1]
    windows = jnp.stack([tokens[:, i : L - n + 1 + i] for i in range(n)], axis=-1)  # [B, L - n + 1, n]
    starts = jnp.arange(L - n + 1)  # [L - n + 1]
    found = (windows == lax.dynamic_slice_in_dim(tokens, end - n, n, axis=1)[:, None]).all(axis=-1) & (starts < end - n)
    latest = jnp.where(found, starts, -1).max(axis=1)  # [B], -1 where none
    start = jnp.where(latest >= 0, latest + n, end - 1)  # [B]: where the proposal is copied from
    index = jnp.minimum(start[:, None] + jnp.arange(draft_tokens), end - 1)  # [B, K]
    return jnp.take_along_axis(tokens, index, axis=1)  # [B, K]


def propose_draft(
    draft: TinyModel,
    draft_cache: KVCache,
    tokens: jax.Array,
    end: jax.Array,
    pad: jax.Array | None,
    generation: GenerationConfig,
    uniform: jax.Array,
    draft_tokens: int,
) -> tuple[jax.Array, jax.Array | None, KVCache]:
    """K proposals [B, K] from the draft model, and the probabilities they were drawn from
    [B, K, V] (None when greedy). The draft's cache always lacks the last two tokens here: the
    one before the last is fed again (the same key and value in the same slot), so one rule
    serves a round after a rejection and a round after every proposal was kept."""
    last_two = jnp.maximum(lax.dynamic_slice_in_dim(tokens, end - 2, 2, axis=1), 0)  # [B, 2]
    logits, cache = draft(last_two, draft_cache.crop(end - 2), pad)  # [B, 2, V]
    B, V = logits.shape[0], logits.shape[-1]
    proposals = (
        jnp.zeros((B, draft_tokens), dtype=jnp.int32).at[:, 0].set(sample(logits[:, -1], generation, uniform[:, 0]))
    )
    q = (
        None
        if generation.greedy
        else jnp.zeros((B, draft_tokens, V)).at[:, 0].set(probabilities(logits[:, -1], generation))
    )

    def propose(i: int, carry: tuple) -> tuple:  # K - 1 more draft steps, one compiled body
        proposals, q, draft_cache = carry
        # [B, 1, V]
        logits, draft_cache = draft(lax.dynamic_slice_in_dim(proposals, i - 1, 1, axis=1), draft_cache, pad)
        proposals = proposals.at[:, i].set(sample(logits[:, -1], generation, uniform[:, i]))  # [B, K]
        if q is not None:
            q = q.at[:, i].set(probabilities(logits[:, -1], generation))  # [B, K, V]
        return proposals, q, draft_cache

    proposals, q, draft_cache = lax.fori_loop(1, draft_tokens, propose, (proposals, q, cache))
    return proposals, q, draft_cache  # [B, K]


def verify(
    target_logits: jax.Array,
    q: jax.Array | None,
    proposals: jax.Array,
    generation: GenerationConfig,
    uniform: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """target_logits [B, K + 1, V] for the last token and the K proposals; q [B, K, V] what the
    proposals were drawn from (None: greedy, or a lookup's certain proposals); uniform [B, K + 1].
    -> accepted [B], how many proposals each row keeps, and final [B], its token after them."""
    K = proposals.shape[1]
    if generation.greedy:
        # [B, K + 1]: what the target itself emits at each place
        choice = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)
        accepted = jnp.cumprod(proposals == choice[:, :K], axis=1).sum(axis=1)  # [B]: the longest agreeing prefix
        return accepted, jnp.take_along_axis(choice, accepted[:, None], axis=1)[
            :, 0
        ]  # its correction, or the bonus token
    p = probabilities(target_logits, generation)  # [B, K + 1, V]
    if q is None:
        q = jax.nn.one_hot(proposals, p.shape[-1], dtype=p.dtype)  # [B, K, V]: a lookup proposes for certain
    p_proposed = jnp.take_along_axis(p[:, :K], proposals[..., None], axis=2)[..., 0]  # [B, K]
    q_proposed = jnp.take_along_axis(q, proposals[..., None], axis=2)[..., 0]  # [B, K]
    # Keep a proposal with probability min(1, p / q): what the draft proposes too often is cut to the target's share...
    accepted = jnp.cumprod(uniform[:, :K] * q_proposed < p_proposed, axis=1).sum(axis=1)  # [B]
    # ...and after the last one kept, draw from what the draft proposed too rarely, max(p - q, 0); after all K, from p.
    residual = jnp.concatenate([jnp.maximum(p[:, :K] - q, 0), p[:, K:]], axis=1)  # [B, K + 1, V]
    at_rejection = jnp.take_along_axis(residual, accepted[:, None, None], axis=1)[:, 0]  # [B, V]
    return accepted, draw(at_rejection, uniform[:, K])


def first_nonfinite_in_round(
    logits: jax.Array, q: jax.Array | None, used: jax.Array, step: jax.Array, nonfinite: jax.Array
) -> jax.Array:
    """(step, row) of the first token a round emitted from logits [B, K + 1, V] holding an inf or a
    NaN, or from a sampled draft's probabilities q [B, K, V] holding one (they decide whether a
    proposal stays, and the token drawn where one is rejected); used [B, K + 1]: the places that
    chose a running row's token (the rest are rejected or come after a stop, never used); step:
    the new token at place 0. Kept once found [2]."""
    bad = ~jnp.all(jnp.isfinite(logits), axis=-1)  # [B, K + 1]
    if q is not None:
        drafted = ~jnp.all(jnp.isfinite(q[:, : bad.shape[1]]), axis=-1)  # [B, K]
        bad = bad.at[:, : drafted.shape[1]].set(bad[:, : drafted.shape[1]] | drafted)
    bad &= used
    place = jnp.argmax(bad.any(axis=0))  # []: the first place any row overflowed
    found = jnp.stack([step + place, jnp.argmax(bad[:, place])]).astype(jnp.int32)  # [2]
    return jnp.where((nonfinite[0] < 0) & bad.any(), found, nonfinite)


def generate_speculative(
    model: TinyModel,
    draft: TinyModel | None,
    prompt: jax.Array,
    generation: GenerationConfig,
    draft_tokens: int,
    ngram: int = 2,
    on_token: Callable[[np.ndarray], None] | None = None,
) -> tuple[jax.Array, dict[str, int]]:
    """prompt [B, P] (PAD on the left of shorter rows) -> tokens [B, P + N], the target's own
    output, and counts: rounds, target forwards, proposals made and accepted. One compiled
    call: on_token hears each token when it returns, not as it is made, and only the steps the
    loop made (up to where every row stopped), as torch's and NumPy's loops hear them."""
    model.eval()  # pitfall 3: dropout off, or the two paths disagree
    if draft is not None:
        draft.eval()
    B, P = prompt.shape
    N, K = generation.max_new_tokens, draft_tokens
    decoding, tokens = start_generation(prompt, generation, model.emb.embedding.dtype)
    pad, stops = decoding.pad, decoding.stops
    tokens = jnp.concatenate([tokens, jnp.full((B, K + 1), PAD, dtype=tokens.dtype)], axis=1)  # room for a round past N
    first, rounds = speculative_uniforms(generation.row_seeds(B), N, K)  # [B], [B, N, 2K + 1]
    static, leaves = split_model(model)
    draft_static, draft_leaves = split_model(draft) if draft is not None else (None, None)
    tokens, counts, end, nonfinite = _speculative_loop(
        static,
        leaves,
        draft_static,
        draft_leaves,
        prompt,
        tokens,
        pad,
        jnp.asarray(first),
        jnp.asarray(rounds),
        stops,
        generation,
        K,
        ngram,
    )
    tokens = np.asarray(tokens)[:, : P + N]  # [B, P + N]
    overflowed = np.asarray(nonfinite).tolist()  # [step, row], -1s: none
    if on_token is not None:
        made = min(int(end), P + N) - P  # the loop ends when every row has stopped
        heard = made if overflowed[0] < 0 else min(made, overflowed[0])  # no token made from overflowed logits
        for column in range(P, P + heard):
            on_token(tokens[:, column])
    check_finite(overflowed, decoding.dtype)
    names = ("rounds", "target_forwards", "proposed", "accepted")
    return jnp.asarray(tokens), {name: int(value) for name, value in zip(names, np.asarray(counts), strict=True)}


@partial(jax.jit, static_argnums=(0, 2, 10, 11, 12))
def _speculative_loop(
    static: Static,
    leaves: list[jax.Array],
    draft_static: Static | None,
    draft_leaves: list[jax.Array] | None,
    prompt: jax.Array,
    tokens: jax.Array,
    pad: jax.Array | None,
    first: jax.Array,
    rounds: jax.Array,
    stops: jax.Array,
    generation: GenerationConfig,
    draft_tokens: int,
    ngram: int,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    model = merge_model(static, leaves)
    draft = merge_model(draft_static, draft_leaves) if draft_static is not None and draft_leaves is not None else None
    B, P = prompt.shape
    N, K = generation.max_new_tokens, draft_tokens
    # A verified chunk is K + 1 wide and partly taken back: a ring keeps K spare slots for it.
    cache = init_cache(model.config, B, P + N + K + 1, model.emb.embedding.dtype, chunk=K + 1)
    logits, cache = model(jnp.maximum(prompt, 0), cache, pad)  # [B, P, V]: the target's cache lacks only the last token
    draft_cache = None
    if draft is not None:
        draft_cache = init_cache(draft.config, B, P + N + K + 1, draft.emb.embedding.dtype, chunk=K + 1)
        if P > 1:
            _, draft_cache = draft(jnp.maximum(prompt[:, :-1], 0), draft_cache, pad)  # the draft's lacks the last two
    token = sample(logits[:, -1], generation, first)  # [B]
    tokens = tokens.at[:, P].set(token)
    nonfinite = first_nonfinite(logits[:, -1], jnp.zeros(B, dtype=bool), 0, no_nonfinite())  # [2]
    done = jnp.isin(token, stops)  # [B]
    counts = jnp.array([0, 1, 0, 0], dtype=jnp.int32)  # rounds, target forwards, proposed, accepted

    def running(carry: tuple) -> jax.Array:
        # Until N tokens, every row has stopped, or a round's logits overflowed
        end, _, done, nonfinite = carry[:4]
        return (end < P + N) & ~jnp.all(done) & (nonfinite[0] < 0)

    def speculate(carry: tuple) -> tuple:
        end, tokens, done, nonfinite, cache, draft_cache, counts = carry
        uniform = rounds[:, counts[0]]  # [B, 2K + 1]: K for the draft, K to accept, 1 for the last token
        if draft is None:
            proposals, q = propose_ngram(tokens, end, ngram, K), None  # [B, K]
        else:
            proposals, q, draft_cache = propose_draft(draft, draft_cache, tokens, end, pad, generation, uniform, K)
        last = lax.dynamic_slice_in_dim(tokens, end - 1, 1, axis=1)  # [B, 1]
        chunk = jnp.maximum(jnp.concatenate([last, proposals], axis=1), 0)  # [B, K + 1]: the last token, the proposals
        logits, cache = model(chunk, cache, pad)  # [B, K + 1, V]: one target forward checks all K
        accepted, final = verify(logits, q, proposals, generation, uniform[:, K:])  # [B], [B]
        kept = jnp.min(jnp.where(done, K, accepted))  # the batch moves as one: as far as its least lucky row
        extra = jnp.where(accepted > kept, jnp.take(proposals, jnp.minimum(kept, K - 1), axis=1), final)  # [B]
        column = jnp.arange(K + 1)  # [K + 1]
        emitted = jnp.where(column < kept, jnp.pad(proposals, ((0, 0), (0, 1))), extra[:, None])  # [B, K + 1]
        cache = cache.crop(end + kept)  # the last token and the kept proposals stay; the rest never happened
        live = ~done
        counts = counts + jnp.stack([1, 1, K * live.sum(), jnp.where(live, accepted, 0).sum()]).astype(jnp.int32)
        stop = jnp.isin(emitted, stops) & (column <= kept)  # [B, K + 1]
        after_stop = jnp.cumsum(stop, axis=1) - stop > 0  # [B, K + 1]: past a row's first stop; it stays stopped
        written = jnp.where((column <= kept) & live[:, None] & ~after_stop, emitted, PAD)  # [B, K + 1]
        tokens = lax.dynamic_update_slice_in_dim(tokens, written, end, axis=1)  # [B, L]
        used = (column <= kept) & (column < P + N - end) & live[:, None] & ~after_stop  # [B, K + 1]
        nonfinite = first_nonfinite_in_round(logits, q, used, end - P, nonfinite)  # [2]
        return end + kept + 1, tokens, done | stop.any(axis=1), nonfinite, cache, draft_cache, counts

    carry = (jnp.asarray(P + 1), tokens, done, nonfinite, cache, draft_cache, counts)
    end, tokens, _, nonfinite, _, _, counts = lax.while_loop(running, speculate, carry)
    return tokens, counts, end, nonfinite  # [B, L], [4], [], [2]
