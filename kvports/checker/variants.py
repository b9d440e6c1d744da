"""The reference's forward once more, small, in NumPy float64, with each known cache mistake
as a flag: the signatures `kvports check` matches an implementation's logits against.

Nothing here touches a port's model: it reads the weights dict (the seed's state_dict names)
and the ModelConfig, and keeps the seed's own cache, a dict of k and v per block grown by
concatenation. With `mistake=None` it is the reference (tests/test_check.py holds it to the
NumPy port); each other value is one way the seed's pitfalls show up in real code.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvports.shared.config import ModelConfig
from kvports.shared.rope import rope_frequencies


@dataclass(frozen=True)
class Mistake:
    variant: str  # the flag below
    diagnosis: str  # the name `kvports check --json` reports
    what: str  # what the broken code does
    fix: str  # the one sentence the report prints, in the post's terms
    stale_positions: bool = False  # positions read from the cache's own length (the post's way), not a count


MISTAKES = (
    Mistake(
        "position_offset",
        "position_offset",
        "positions restart at 0 in every cached call",
        "in cache mode the new tokens' positions must start at the cache length: "
        "pos[S : S + T] with S = cache['k'].shape[2], not pos[0 : T]",
    ),
    Mistake(
        "mask_offset",
        "mask_offset",
        "the causal mask's diagonal ignores the cache length",
        "build the mask over cache + new tokens with triu(ones(T, S), diagonal=S - T + 1), "
        "S the keys in all (cache plus this call), not diagonal=1",
    ),
    *(
        Mistake(variant, "cache_update", what + how, fix, stale)
        for variant, what, fix in (
            (
                "cache_prefill_only",
                "the cache is written by the prefill and never again",
                "write every call's k and v into the cache (cache['k'] = cat([cache['k'], k], dim=2)), "
                "not only the prompt's",
            ),
            (
                "cache_never_written",
                "the cache is never written: each call attends only over its own tokens",
                "store k and v in the block's cache dict after each call, and attend over cat([cache['k'], k], dim=2)",
            ),
            (
                "cache_read_only",
                "the cache is attended but never grown: the prefill's keys and values are read in place of the "
                "new token's own",
                "append each call's k and v to the cache and attend over both: "
                "k = cat([cache['k'], k], dim=2); cache['k'] = k",
            ),
            (
                "cache_slot_zero",
                "each call writes its k and v at slot 0 of a preallocated cache, not at the cache length",
                "write a call's T keys and values at slots [S, S + T), S the cache length, not at [0, T)",
            ),
        )
        for stale, how in ((False, ""), (True, ", and the positions read from it stall"))
    ),
)
FIXES = {
    "position_offset": MISTAKES[0].fix,
    "mask_offset": MISTAKES[1].fix,
    "cache_update": "write each call's k and v into the cache at the cache length, along the sequence axis "
    "(torch.cat([cache['k'], k], dim=2) for [B, H, S, Dh])",
    "prefill": "feed the whole prompt in one forward (logits = model(prompt, caches)), "
    "not one token at a time: the same cache, P times the forwards before the first token",
    "eval_mode": "call model.eval() before generating (dropout is active in training mode, "
    "so the two paths and two runs disagree)",
}
DIAGNOSES = tuple(FIXES)


def layer_norm(x: np.ndarray, weights: dict, prefix: str, config: ModelConfig) -> np.ndarray:
    if config.norm == "rmsnorm":
        return x / np.sqrt((x**2).mean(-1, keepdims=True) + config.norm_eps) * weights[prefix + ".weight"]
    centred = x - x.mean(-1, keepdims=True)
    scaled = centred / np.sqrt((centred**2).mean(-1, keepdims=True) + config.norm_eps)
    return scaled * weights[prefix + ".weight"] + weights[prefix + ".bias"]  # [B, T, D]


def dense(x: np.ndarray, weights: dict, prefix: str) -> np.ndarray:
    y = x @ weights[prefix + ".weight"].T  # [B, T, out]
    bias = weights.get(prefix + ".bias")
    return y if bias is None else y + bias


def rotate(x: np.ndarray, positions: np.ndarray, frequencies: np.ndarray) -> np.ndarray:
    """RoPE, half-split (Hugging Face's Llama layout): x [B, H, T, Dh], positions [T], frequencies [Dh/2]."""
    half = x.shape[-1] // 2
    angles = positions[:, None] * frequencies  # [T, Dh/2]
    cos, sin = np.cos(angles), np.sin(angles)
    first, second = x[..., :half], x[..., half:]
    return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)  # [B, H, T, Dh]


def mlp(x: np.ndarray, weights: dict, prefix: str, config: ModelConfig) -> np.ndarray:
    h = dense(x, weights, prefix + ".0")  # [B, T, F] (gated: [B, T, 2F], gate first)
    if config.activation == "swiglu":
        gate, up = np.split(h, 2, axis=-1)
        h = gate / (1 + np.exp(-gate)) * up
    elif config.activation == "geglu_tanh":
        gate, up = np.split(h, 2, axis=-1)
        h = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate**3))) * up
    elif config.activation == "gelu_tanh":
        h = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3)))
    else:
        from scipy.special import erf  # here: the command line starts without SciPy

        h = 0.5 * h * (1 + erf(h / np.sqrt(2)))
    return dense(h, weights, prefix + ".2")  # [B, T, D]


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, visible: np.ndarray, scale: float | None) -> np.ndarray:
    """q [B, H, T, Dh] over k, v [B, Hkv, S, Dh]; visible [T, S]; scale None: 1 / sqrt(Dh)."""
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # [B, H, S, Dh]
    scores = q @ k.swapaxes(-1, -2) * (1 / np.sqrt(q.shape[-1]) if scale is None else scale)  # [B, H, T, S]
    scores = np.where(visible, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return (weights / weights.sum(-1, keepdims=True)) @ v  # [B, H, T, Dh]


def forward(
    config: ModelConfig, weights: dict, tokens: np.ndarray, caches: list[dict], length: int, mistake: Mistake | None
) -> np.ndarray:
    """One call of T new tokens [B, T] after `length` earlier ones; the caches are updated in place."""
    B, T = tokens.shape
    H, Hkv, Dh = config.n_heads, config.kv_heads, config.head_dim
    stored = caches[0]["k"].shape[2] if "k" in caches[0] else 0  # what the cache itself holds
    start = stored if mistake is not None and mistake.stale_positions else length
    variant = None if mistake is None else mistake.variant
    start = 0 if variant == "position_offset" else start
    positions = np.arange(start, start + T)  # [T]
    x = weights["emb.weight"][tokens] * config.embed_scale  # [B, T, D]
    if config.positions == "learned":
        x = x + weights["pos.weight"][positions]
    for i, cache in enumerate(caches):
        p = f"blocks.{i}"
        qkv = dense(layer_norm(x, weights, p + ".ln1", config), weights, p + ".qkv")  # [B, T, (H + 2 Hkv) Dh]
        qkv = qkv.reshape(B, T, H + 2 * Hkv, Dh).transpose(0, 2, 1, 3)  # [B, H + 2 Hkv, T, Dh]
        q, k, v = np.split(qkv, [H, H + Hkv], axis=1)
        if config.qk_norm:
            q, k = layer_norm(q, weights, p + ".q_norm", config), layer_norm(k, weights, p + ".k_norm", config)
        window = config.layer_window(i)
        if config.positions == "rope":
            frequencies = rope_frequencies(config, window)
            q, k = rotate(q, positions, frequencies), rotate(k, positions, frequencies)
        old_k, old_v = cache.get("k", k[:, :, :0]), cache.get("v", v[:, :, :0])  # [B, Hkv, S_old, Dh]
        if variant == "cache_slot_zero":
            keys = np.zeros((B, Hkv, length + T, Dh))  # [B, Hkv, S, Dh]: the buffer, filled up to the cache length
            values = np.zeros_like(keys)
            keys[:, :, : old_k.shape[2]], values[:, :, : old_v.shape[2]] = old_k, old_v
            keys[:, :, :T], values[:, :, :T] = k, v  # written at slot 0, whatever the cache holds
            cache["k"], cache["v"] = keys, values
        elif variant == "cache_never_written" or (variant == "cache_read_only" and not old_k.shape[2]):
            keys, values = k, v
            if variant == "cache_read_only":
                cache["k"], cache["v"] = keys, values  # [B, Hkv, P, Dh]: the prefill's, for good
        elif variant == "cache_read_only":
            keys, values = old_k, old_v  # the new token's own k and v are dropped
        else:
            keys, values = np.concatenate([old_k, k], axis=2), np.concatenate([old_v, v], axis=2)  # [B, Hkv, S, Dh]
            if variant != "cache_prefill_only" or not length:
                cache["k"], cache["v"] = keys, values
        S = keys.shape[2]
        query = np.arange(T)[:, None] + (0 if variant == "mask_offset" else S - T)  # [T, 1]: index among the keys
        key = np.arange(S)[None, :]  # [1, S]
        visible = key <= query
        if window is not None:
            visible &= key > query - window
        out = attend(q, keys, values, visible, config.attn_scale)  # [B, H, T, Dh]
        out = dense(out.transpose(0, 2, 1, 3).reshape(B, T, H * Dh), weights, p + ".proj")  # [B, T, D]
        x = x + (layer_norm(out, weights, p + ".ln1_post", config) if config.post_norms else out)
        out = mlp(layer_norm(x, weights, p + ".ln2", config), weights, p + ".ffn", config)  # [B, T, D]
        x = x + (layer_norm(out, weights, p + ".ln2_post", config) if config.post_norms else out)
    head = weights["emb.weight"] if config.tie_embeddings else weights["head.weight"]  # [V, D]
    return layer_norm(x, weights, "ln", config) @ head.T  # [B, T, V]


def as_float64(weights: dict) -> dict:
    return {name: np.asarray(array, dtype=np.float64) for name, array in weights.items()}


def forward_chunks(
    config: ModelConfig, weights: dict, tokens: np.ndarray, chunks: list[int], mistake: Mistake | None = None
) -> np.ndarray:
    """tokens [B, T] fed in chunks of the given sizes into one cache; the logits [B, T, V]."""
    weights = as_float64(weights)
    caches: list[dict] = [{} for _ in range(config.n_layers)]
    pieces, start = [], 0
    for size in chunks:
        pieces.append(forward(config, weights, tokens[:, start : start + size], caches, start, mistake))
        start += size
    return np.concatenate(pieces, axis=1)


def greedy_cached(
    config: ModelConfig, weights: dict, prompt: np.ndarray, new_tokens: int, mistake: Mistake | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The cached greedy loop with the mistake: tokens [B, P + N] and step logits [B, N, V]."""
    weights = as_float64(weights)
    caches: list[dict] = [{} for _ in range(config.n_layers)]
    tokens, steps = np.asarray(prompt, dtype=np.int64), []
    logits = forward(config, weights, tokens, caches, 0, mistake)[:, -1]  # [B, V]
    for _ in range(new_tokens):
        steps.append(logits)
        token = logits.argmax(-1)[:, None]  # [B, 1]
        length = tokens.shape[1]
        tokens = np.concatenate([tokens, token], axis=1)
        if len(steps) < new_tokens:
            logits = forward(config, weights, token, caches, length, mistake)[:, -1]
    return tokens, np.stack(steps, axis=1)
