"""The sampling rule in PyTorch: how a row of logits becomes the next token.

Greedy at temperature 0; else temperature, top-k and top-p as transformers' warpers apply them,
softmax in float64 and a draw by a uniform each row brings with it (shared.generation.uniforms),
so every port draws the same token from the same logits. Read it beside jax_impl/sampling.py
and numpy_impl/sampling.py: the same names in the same order.

Shapes: B batch, V vocabulary.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from kvports.shared.generation import PAD, GenerationConfig


def greedy(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)  # [B, V] -> [B]


def filter_logits(
    logits: torch.Tensor, top_k: Union[int, torch.Tensor], top_p: Union[float, torch.Tensor]
) -> torch.Tensor:
    """Top-k, then top-p (the smallest set of most likely tokens whose probability reaches
    top_p, the most likely always kept), as transformers' warpers do; the rest -inf. top_k and
    top_p: one value for every row, or one per row, [B, 1] (0 and 1: no filter), which filter
    exactly as the same values given one row at a time."""
    V = logits.shape[-1]
    if isinstance(top_k, torch.Tensor):
        filtering = (0 < top_k) & (top_k < V)  # [B, 1]: a row with k 0 (or V) keeps every token
        if bool(filtering.any()):  # a step where no row filters skips the sort (JAX: lax.cond)
            kth = logits.sort(dim=-1, descending=True).values.gather(1, (top_k - 1).clamp(0, V - 1))  # [B, 1]
            logits = logits.masked_fill(filtering & (logits < kth), float("-inf"))  # [B, V]
    elif 0 < top_k < V:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))  # [B, V]; ties with the k-th stay
    # Per row, top_p 1 removes only what has probability 0 already: the same probabilities, so a
    # step where every row has it skips the sort
    if bool((top_p < 1.0).any()) if isinstance(top_p, torch.Tensor) else top_p < 1.0:
        ascending, order = logits.sort(dim=-1, stable=True)  # [B, V] each
        remove = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p  # [B, V], in ascending order
        remove[:, -1] = False
        logits = logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))  # [B, V], back in vocab order
    return logits


def probabilities(logits: torch.Tensor, generation: GenerationConfig) -> torch.Tensor:
    """logits [..., V] -> what sampling draws from [..., V]: the temperature, top-k and top-p,
    then softmax. In float64, so the ports' draws can differ only where their logits do."""
    logits = logits.to(torch.float64) / generation.temperature  # [..., V]
    shape = logits.shape
    return (
        filter_logits(logits.reshape(-1, shape[-1]), generation.top_k, generation.top_p).softmax(dim=-1).reshape(shape)
    )


def draw(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """probs [B, V] (summing to any positive total), uniform [B] in [0, 1) -> tokens [B]: the
    first token whose cumulative probability exceeds the uniform's share of the total."""
    cumulative = probs.cumsum(dim=-1)  # [B, V]
    # [B]: tokens whose interval ends at or below it
    drawn = (cumulative <= uniform[:, None] * cumulative[:, -1:]).sum(dim=-1)
    return drawn.clamp(max=probs.shape[-1] - 1)


def sample(logits: torch.Tensor, generation: GenerationConfig, uniform: torch.Tensor) -> torch.Tensor:
    """logits [B, V], uniform [B] in [0, 1) -> tokens [B]: greedy at temperature 0, else a draw
    from the filtered probabilities."""
    if generation.greedy:
        return greedy(logits)
    return draw(probabilities(logits, generation), uniform)


def choose(
    logits: torch.Tensor, generation: GenerationConfig, uniform: torch.Tensor, done: torch.Tensor, stops: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each row's next token [B] and whether it has stopped [B]: a stopped row stays stopped (PAD)."""
    token = sample(logits, generation, uniform)  # [B]
    if generation.stop_ids:  # without stop ids no row can stop: no bookkeeping
        token = token.masked_fill(done, PAD)
        done = done | torch.isin(token, stops)
    return token, done


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniform: torch.Tensor,
    allowed: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Each row's next token [B] from logits [B, V] by its own settings, arrays [B] (temperature 0:
    greedy), the token it gets alone: values, not shapes, so one program serves any mix of them
    (JAX's compiles once). A row whose logits hold an inf or a NaN gets PAD: the engine stops there.
    allowed [B, V]: the tokens each row may take (a grammar's, from the host); the others -inf first."""
    finite = torch.isfinite(logits).all(dim=-1)  # [B]: the model's own logits, before any mask
    if allowed is not None:
        logits = logits.masked_fill(~allowed, -torch.inf)  # [B, V]
    sampled = temperature > 0  # [B]
    tokens = greedy(logits)  # [B]
    if bool(sampled.any()):  # a greedy step skips the sort (JAX: lax.cond)
        scaled = logits.to(torch.float64) / torch.where(sampled, temperature, 1.0)[:, None]  # [B, V]
        probs = filter_logits(scaled, top_k[:, None], top_p[:, None]).softmax(dim=-1)  # [B, V]
        tokens = torch.where(sampled, draw(probs, uniform), tokens)  # [B]
    return tokens.masked_fill(~finite, PAD)
