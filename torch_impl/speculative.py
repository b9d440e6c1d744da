"""Speculative decoding in PyTorch: a cheap draft proposes K tokens, the target checks them
all in one forward, keeps the longest prefix it agrees with and adds its own next token. The
output is the target's own: token for token its greedy output, or, when sampling, a draw
from its distribution (the accept/resample rule in `verify`).

Read it beside jax_impl/speculative.py and numpy_impl/speculative.py. The draft is another
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

import torch

from kvports.shared.generation import PAD, GenerationConfig, check_finite, speculative_uniforms
from kvports.torch_impl.generate import first_nonfinite, no_nonfinite, start_generation
from kvports.torch_impl.model import KVCache, TinyModel, init_cache
from kvports.torch_impl.sampling import draw, probabilities, sample


def propose_ngram(tokens: torch.Tensor, end: int, n: int, draft_tokens: int) -> torch.Tensor:
    """Prompt lookup: for each row of tokens [B, >= E], the K tokens that followed the latest
    earlier occurrence of its last n tokens (its last token repeated where there is none)."""
    history = tokens[:, :end]  # [B, E]
    if end <= n:
        return history[:, -1:].expand(-1, draft_tokens)  # [B, K]: too short to hold an earlier n-gram
    # [B, E - n, n]: every earlier n-gram
    windows = torch.stack([history[:, i : end - n + i] for i in range(n)], dim=-1)
    found = (windows == history[:, None, end - n :]).all(dim=-1)  # [B, E - n]
    latest = torch.where(found, torch.arange(end - n), -1).max(dim=1).values  # [B], -1 where none
    start = torch.where(latest >= 0, latest + n, end - 1)  # [B]: where the proposal is copied from
    index = (start[:, None] + torch.arange(draft_tokens)).clamp(max=end - 1)  # [B, K]
    return history.gather(1, index)  # [B, K]


def propose_draft(
    draft: TinyModel,
    draft_cache: KVCache,
    tokens: torch.Tensor,
    end: int,
    pad: torch.Tensor | None,
    generation: GenerationConfig,
    uniform: torch.Tensor,
    draft_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor | None, KVCache]:
    """K proposals [B, K] from the draft model, and the probabilities they were drawn from
    [B, K, V] (None when greedy). The draft's cache always lacks the last two tokens here: the
    one before the last is fed again (the same key and value in the same slot), so one rule
    serves a round after a rejection and a round after every proposal was kept."""
    draft_cache = draft_cache.crop(end - 2)
    logits, draft_cache = draft(tokens[:, end - 2 : end].clamp(min=0), draft_cache, pad)  # [B, 2, V]
    proposals: list[torch.Tensor] = []
    drawn_from: list[torch.Tensor] = []
    for i in range(draft_tokens):
        if i > 0:
            logits, draft_cache = draft(proposals[-1][:, None], draft_cache, pad)  # [B, 1, V]
        proposals.append(sample(logits[:, -1], generation, uniform[:, i]))  # [B]
        if not generation.greedy:
            drawn_from.append(probabilities(logits[:, -1], generation))  # [B, V]
    q = torch.stack(drawn_from, dim=1) if drawn_from else None  # [B, K, V]
    return torch.stack(proposals, dim=1), q, draft_cache  # [B, K]


def verify(
    target_logits: torch.Tensor,
    q: torch.Tensor | None,
    proposals: torch.Tensor,
    generation: GenerationConfig,
    uniform: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """target_logits [B, K + 1, V] for the last token and the K proposals; q [B, K, V] what the
    proposals were drawn from (None: greedy, or a lookup's certain proposals); uniform [B, K + 1].
    -> accepted [B], how many proposals each row keeps, and final [B], its token after them."""
    K = proposals.shape[1]
    if generation.greedy:
        choice = target_logits.argmax(dim=-1)  # [B, K + 1]: what the target itself emits at each place
        accepted = (proposals == choice[:, :K]).cumprod(dim=1).sum(dim=1)  # [B]: the longest agreeing prefix
        return accepted, choice.gather(1, accepted[:, None])[:, 0]  # its correction, or the bonus token
    p = probabilities(target_logits, generation)  # [B, K + 1, V]
    if q is None:
        q = torch.nn.functional.one_hot(proposals, p.shape[-1]).to(p.dtype)  # [B, K, V]: a lookup proposes for certain
    p_proposed = p[:, :K].gather(2, proposals[..., None])[..., 0]  # [B, K]
    q_proposed = q.gather(2, proposals[..., None])[..., 0]  # [B, K]
    # Keep a proposal with probability min(1, p / q): what the draft proposes too often is cut to the target's share...
    accepted = (uniform[:, :K] * q_proposed < p_proposed).cumprod(dim=1).sum(dim=1)  # [B]
    # ...and after the last one kept, draw from what the draft proposed too rarely, max(p - q, 0); after all K, from p.
    residual = torch.cat([(p[:, :K] - q).clamp(min=0), p[:, K:]], dim=1)  # [B, K + 1, V]
    at_rejection = residual.gather(1, accepted[:, None, None].expand(-1, 1, p.shape[-1]))[:, 0]  # [B, V]
    return accepted, draw(at_rejection, uniform[:, K])


def first_nonfinite_in_round(
    logits: torch.Tensor, q: torch.Tensor | None, used: torch.Tensor, step: int, nonfinite: torch.Tensor
) -> torch.Tensor:
    """(step, row) of the first token a round emitted from logits [B, K + 1, V] holding an inf or a
    NaN, or from a sampled draft's probabilities q [B, K, V] holding one (they decide whether a
    proposal stays, and the token drawn where one is rejected); used [B, K + 1]: the places that
    chose a running row's token (the rest are rejected or come after a stop, never used); step:
    the new token at place 0. Kept once found [2]."""
    bad = ~torch.isfinite(logits).all(dim=-1)  # [B, K + 1]
    if q is not None:
        drafted = ~torch.isfinite(q[:, : bad.shape[1]]).all(dim=-1)  # [B, K]
        bad[:, : drafted.shape[1]] |= drafted
    bad &= used
    place = bad.any(dim=0).int().argmax()  # []: the first place any row overflowed
    found = torch.stack([step + place, bad[:, place].int().argmax()])  # [2]
    return torch.where((nonfinite[0] < 0) & bad.any(), found, nonfinite)


@torch.inference_mode()
def generate_speculative(
    model: TinyModel,
    draft: TinyModel | None,
    prompt: torch.Tensor,
    generation: GenerationConfig,
    draft_tokens: int,
    ngram: int = 2,
    on_token: Callable[[torch.Tensor], None] | None = None,
) -> tuple[torch.Tensor, dict[str, int]]:
    """prompt [B, P] (PAD on the left of shorter rows) -> tokens [B, P + N], the target's own
    output, and counts: rounds, target forwards, proposals made and accepted."""
    model.eval()  # pitfall 3: dropout off, or the two paths disagree
    B, P = prompt.shape
    N, K = generation.max_new_tokens, draft_tokens
    decoding, tokens = start_generation(prompt, generation, model.emb.weight.dtype)
    pad, stops = decoding.pad, decoding.stops
    # Room for a round past N
    tokens = torch.cat([tokens, torch.full((B, K + 1), PAD, dtype=tokens.dtype, device=tokens.device)], dim=1)
    first, rounds = speculative_uniforms(generation.row_seeds(B), N, K)  # [B], [B, N, 2K + 1]
    first, rounds = torch.from_numpy(first).to(prompt.device), torch.from_numpy(rounds).to(prompt.device)
    # A verified chunk is K + 1 wide and partly taken back: a ring keeps K spare slots for it.
    cache = init_cache(model.config, B, P + N + K + 1, model.emb.weight.dtype, chunk=K + 1)
    logits, cache = model(prompt.clamp(min=0), cache, pad)  # [B, P, V]: the target's cache lacks only the last token
    if draft is not None:
        draft.eval()
        draft_cache = init_cache(draft.config, B, P + N + K + 1, draft.emb.weight.dtype, chunk=K + 1)
        if P > 1:
            _, draft_cache = draft(prompt[:, :-1].clamp(min=0), draft_cache, pad)  # the draft's lacks the last two
    token = sample(logits[:, -1], generation, first)  # [B]
    tokens[:, P] = token
    done = torch.zeros(B, dtype=torch.bool, device=prompt.device)  # [B]
    nonfinite = first_nonfinite(logits[:, -1], done, 0, no_nonfinite(prompt.device))  # [2]
    if on_token is not None:
        check_finite(nonfinite.tolist(), decoding.dtype)
        on_token(token)
    done = torch.isin(token, stops)  # [B]
    counts = dict(rounds=0, target_forwards=1, proposed=0, accepted=0)
    end = P + 1  # tokens so far in every row
    # Until N tokens, every row has stopped, or a round's logits overflowed (it looks at the host every round anyway)
    while end < P + N and not bool(done.all()) and int(nonfinite[0]) < 0:
        uniform = rounds[:, counts["rounds"]]  # [B, 2K + 1]: K for the draft, K to accept, 1 for the last token
        if draft is None:
            proposals, q = propose_ngram(tokens, end, ngram, K), None  # [B, K]
        else:
            proposals, q, draft_cache = propose_draft(draft, draft_cache, tokens, end, pad, generation, uniform, K)
        # [B, K + 1]: the last token, then the proposals
        chunk = torch.cat([tokens[:, end - 1 : end], proposals], dim=1).clamp(min=0)
        logits, cache = model(chunk, cache, pad)  # [B, K + 1, V]: one target forward checks all K
        accepted, final = verify(logits, q, proposals, generation, uniform[:, K:])  # [B], [B]
        kept = int(accepted[~done].min())  # the batch moves as one: as far as its least lucky row
        # [B]: agreed proposal, or the target's token
        extra = torch.where(accepted > kept, proposals[:, min(kept, K - 1)], final)
        emitted = torch.cat([proposals[:, :kept], extra[:, None]], dim=1)  # [B, kept + 1]
        cache = cache.crop(end + kept)  # the last token and the kept proposals stay; the rest never happened
        place = torch.arange(K + 1)  # [K + 1]
        stop = torch.isin(emitted, stops)  # [B, kept + 1]
        after_stop = torch.cat([torch.zeros_like(stop[:, :1]), stop.cumsum(dim=1)[:, :-1] > 0], dim=1)  # [B, kept + 1]
        used = (place[: kept + 1] < P + N - end) & ~done[:, None] & ~after_stop  # [B, kept + 1]
        nonfinite = first_nonfinite_in_round(logits[:, : kept + 1], q, used, end - P, nonfinite)  # [2]
        counts["rounds"] += 1
        counts["target_forwards"] += 1
        counts["proposed"] += K * int((~done).sum())
        counts["accepted"] += int(accepted[~done].sum())
        for i in range(min(kept + 1, P + N - end)):
            token = emitted[:, i].masked_fill(done, PAD)  # [B]; a stopped row stays stopped
            tokens[:, end + i] = token
            if on_token is not None:
                if int(nonfinite[0]) == end - P + i:
                    check_finite(nonfinite.tolist(), decoding.dtype)  # no token made from overflowed logits is heard
                on_token(token)
            done |= torch.isin(token, stops)
        end += kept + 1
    check_finite(nonfinite.tolist(), decoding.dtype)
    return tokens[:, : P + N], counts  # [B, P + N]
