"""The NumPy port: the seed's TinyModel in plain NumPy, with a preallocated KV cache.

Read it beside torch_impl/model.py: the same names in the same order. NumPy has no
nn.Module, so a small stand-in (Module, Linear, LayerNorm, Embedding, Dropout) and the
activations torch gets from F sit just before RMSNorm; everything else lines up.
NumPy also defaults to float64, so every array made here takes the model's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from shared.config import ModelConfig
from shared.config import cache_slots


@dataclass
class KVCache:
    # Written in place by position; NumPy arrays are mutable, as torch's buffers are.
    keys: np.ndarray  # [L, B, Hkv, S, Dh], S = slots (prompt + new tokens, or the window)
    values: np.ndarray  # [L, B, Hkv, S, Dh]
    slot_positions: np.ndarray  # [S] int64: the position each slot holds, -1 while empty
    length: int  # tokens seen so far = the position of the next token


def init_cache(config: ModelConfig, batch: int, total_len: int, dtype: np.dtype) -> KVCache:
    slots = cache_slots(config, total_len)
    shape = (config.n_layers, batch, config.kv_heads, slots, config.head_dim)
    return KVCache(
        keys=np.zeros(shape, dtype=dtype),
        values=np.zeros(shape, dtype=dtype),
        slot_positions=np.full((slots,), -1, dtype=np.int64),
        length=0,
    )


def token_positions(start: int, length: int) -> np.ndarray:
    # Pitfall 1: in cache mode the new tokens' positions start at the cache length, not 0.
    return np.arange(start, start + length, dtype=np.int64)  # [T]


def attention_mask(query_positions: np.ndarray, key_positions: np.ndarray, window: Optional[int]) -> np.ndarray:
    # Built from positions, not indices: the same rule serves a full prompt, a cached step
    # and a ring buffer. With keys 0..S-1 and queries S-T..S-1 it is the seed's
    # triu(ones(T, S), diagonal=S - T + 1), inverted (True here means visible).
    visible = (key_positions[None, :] <= query_positions[:, None]) & (key_positions[None, :] >= 0)  # [T, S]
    if window is not None:
        visible = visible & (key_positions[None, :] > query_positions[:, None] - window)  # [T, S]
    return visible


def rope_tables(positions: np.ndarray, head_dim: int, theta: float, dtype: np.dtype):
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))  # [Dh/2]
    angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]  # [T, Dh/2]
    angles = np.concatenate([angles, angles], axis=-1)  # [T, Dh]
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    # Half-split rotation, the layout Hugging Face's Llama checkpoints use.
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)  # [B, H, T, Dh]
    return x * cos + rotated * sin  # [B, H, T, Dh]


# ---- What torch.nn and torch.nn.functional give the reference, and NumPy lacks ----

class Module:
    """The part of nn.Module this port needs: named parameters (so torch's state_dict
    names load as they are), a dtype cast, and the train/eval switch."""

    training = True  # as nn.Module: a fresh model is in train mode until eval()

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def named_children(self):
        for name, value in vars(self).items():
            if isinstance(value, Module):
                yield name, value
            elif isinstance(value, list):  # a plain list stands in for nn.ModuleList
                for i, item in enumerate(value):
                    if isinstance(item, Module):
                        yield f"{name}.{i}", item

    def named_parameters(self, prefix: str = ""):
        for name, value in vars(self).items():
            if isinstance(value, np.ndarray):
                yield prefix + name, self, name
        for name, child in self.named_children():
            yield from child.named_parameters(f"{prefix}{name}.")

    def load_state_dict(self, state: dict) -> "Module":
        # strict, as torch's load_state_dict(strict=True): no missing, unexpected or misshaped tensor.
        own = {name: (owner, attr) for name, owner, attr in self.named_parameters()}
        if set(own) != set(state):
            missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
            raise KeyError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
        for name, (owner, attr) in own.items():
            array = np.asarray(state[name])
            if array.shape != getattr(owner, attr).shape:
                raise ValueError(f"{name}: shape {array.shape}, expected {getattr(owner, attr).shape}")
            setattr(owner, attr, array)
        return self

    def to(self, dtype) -> "Module":
        for _, owner, attr in self.named_parameters():
            setattr(owner, attr, getattr(owner, attr).astype(dtype))  # a copy: the model owns its weights
        return self

    def train(self, mode: bool = True) -> "Module":
        self.training = mode
        for _, child in self.named_children():
            child.train(mode)
        return self

    def eval(self) -> "Module":
        return self.train(False)


class Linear(Module):
    # Placeholders until load_state_dict: NumPy has no meta device, and np.zeros costs no
    # memory until written.
    def __init__(self, n_in: int, n_out: int, bias: bool = True):
        self.weight = np.zeros((n_out, n_in), dtype=np.float32)  # (out, in), torch's layout
        self.bias = np.zeros((n_out,), dtype=np.float32) if bias else None

    def forward(self, x: np.ndarray) -> np.ndarray:
        y = x @ self.weight.T  # [..., out]
        return y if self.bias is None else y + self.bias


class LayerNorm(Module):
    def __init__(self, dim: int, eps: float):
        self.eps = eps
        self.weight = np.ones((dim,), dtype=np.float32)
        self.bias = np.zeros((dim,), dtype=np.float32)

    def forward(self, x: np.ndarray) -> np.ndarray:
        mean = x.mean(-1, keepdims=True)  # [B, T, 1]
        var = ((x - mean) ** 2).mean(-1, keepdims=True)  # [B, T, 1], biased, as torch
        return (x - mean) / np.sqrt(var + self.eps) * self.weight + self.bias  # [B, T, D]


class Embedding(Module):
    def __init__(self, n: int, dim: int):
        self.weight = np.zeros((n, dim), dtype=np.float32)

    def forward(self, ids: np.ndarray) -> np.ndarray:
        return self.weight[ids]  # [B, T, D]


class Dropout(Module):
    # NumPy has no global seed like torch.manual_seed: the model's Generator is passed in.
    def __init__(self, p: float, rng: np.random.Generator):
        self.p, self.rng = p, rng

    def forward(self, x: np.ndarray) -> np.ndarray:
        if not self.training or self.p == 0.0:
            return x
        keep = self.rng.random(x.shape, dtype=x.dtype) >= self.p  # [B, T, D] bool
        return x * keep / (1.0 - self.p)  # [B, T, D]


# W. J. Cody's rational Chebyshev approximations (Math. Comp. 1969; SPECFUN CALERF),
# accurate to float64 rounding: NumPy has no erf and the seed's GELU is the exact form.
_ERF_A = (3.16112374387056560e00, 1.13864154151050156e02, 3.77485237685302021e02,
          3.20937758913846947e03, 1.85777706184603153e-1)
_ERF_B = (2.36012909523441209e01, 2.44024637934444173e02, 1.28261652607737228e03,
          2.84423683343917062e03)
_ERF_C = (5.64188496988670089e-1, 8.88314979438837594e00, 6.61191906371416295e01,
          2.98635138197400131e02, 8.81952221241769090e02, 1.71204761263407058e03,
          2.05107837782607147e03, 1.23033935479799725e03, 2.15311535474403846e-8)
_ERF_D = (1.57449261107098347e01, 1.17693950891312499e02, 5.37181101862009858e02,
          1.62138957456669019e03, 3.29079923573345963e03, 4.36261909014324716e03,
          3.43936767414372164e03, 1.23033935480374942e03)
_ERF_P = (3.05326634961232344e-1, 3.60344899949804439e-1, 1.25781726111229246e-1,
          1.60837851487422766e-2, 6.58749161529837803e-4, 1.63153871373020978e-2)
_ERF_Q = (2.56852019228982242e00, 1.87295284992346047e00, 5.27905102951428412e-1,
          6.05183413124413191e-2, 2.33520497626869185e-3)


# The helpers below work in place: on large activations, fresh temporaries cost more
# than the arithmetic itself.
def _ratio(t: np.ndarray, num_coef, den_coef) -> np.ndarray:
    # Cody's Horner form: num has one coefficient more than den, den's leading one is 1.
    num, den = num_coef[-1] * t, t.copy()
    for a, b in zip(num_coef[:-2], den_coef[:-1]):
        num += a
        num *= t
        den += b
        den *= t
    num += num_coef[-2]
    den += den_coef[-1]
    num /= den
    return num


def _times_exp_minus_square(y: np.ndarray, value: np.ndarray) -> np.ndarray:
    # value * exp(-y^2), with exp(-y^2) = exp(-r^2) * exp(-(y - r)(y + r)) and r = y cut to
    # 1/16: r^2 is exact, so the large exponent loses no bits.
    r = np.trunc(y * 16.0)
    r /= 16.0
    d = y - r
    d *= y + r
    value *= np.exp(np.negative(d, out=d), out=d)
    r *= r
    value *= np.exp(np.negative(r, out=r), out=r)
    return value


def erf(x: np.ndarray) -> np.ndarray:
    """erf in float64 whatever the input dtype; the caller casts back."""
    x = np.asarray(x, dtype=np.float64)
    shape, x = x.shape, x.reshape(-1)
    y = np.abs(x)
    out = np.empty_like(x)
    # Each interval is evaluated only on its own elements, picked by integer index: boolean
    # masks of random density gather and scatter several times slower.
    small = np.flatnonzero(y <= 0.46875)
    mid = np.flatnonzero((y > 0.46875) & (y <= 4.0))
    big = np.flatnonzero(~(y <= 4.0))  # also NaN, which the arithmetic below carries through
    xs = x[small]
    out[small] = xs * _ratio(xs * xs, _ERF_A, _ERF_B)  # erf directly; odd, so the sign comes free
    ym = y[mid]
    erfc = _times_exp_minus_square(ym, _ratio(ym, _ERF_C, _ERF_D))
    out[mid] = np.copysign(np.subtract(1.0, erfc, out=erfc), x[mid], out=erfc)
    # Past 27 erfc underflows to 0 anyway; the clip keeps inf out of y - r.
    yb = np.minimum(y[big], 27.0)
    z = 1.0 / (yb * yb)
    erfc = np.subtract(0.56418958354775628695, z * _ratio(z, _ERF_P, _ERF_Q)) / yb  # 1/sqrt(pi) - ...
    erfc = _times_exp_minus_square(yb, erfc)
    out[big] = np.copysign(np.subtract(1.0, erfc, out=erfc), x[big], out=erfc)
    return out.reshape(shape)


def gelu(x: np.ndarray) -> np.ndarray:
    # Exact erf form: the erf in float64, then back to the model's dtype.
    x64 = x.astype(np.float64)
    h = erf(x64 * 0.7071067811865476)  # 1 / sqrt(2)
    h += 1.0
    h *= x64
    h *= 0.5
    return h.astype(x.dtype, copy=False)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))  # sqrt(2 / pi)


def silu(x: np.ndarray) -> np.ndarray:
    # x * sigmoid(x) with exp of a non-positive number only: no overflow for large |x|.
    e = np.exp(-np.abs(x))
    return x * np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))  # every row sees itself, so max is finite
    return e / e.sum(axis=axis, keepdims=True)


# ---- The model, as in the reference ----

class RMSNorm(Module):
    def __init__(self, dim: int, eps: float):
        self.eps = eps
        self.weight = np.ones((dim,), dtype=np.float32)

    def forward(self, x: np.ndarray) -> np.ndarray:
        # NumPy has no rsqrt.
        return x * (1.0 / np.sqrt((x ** 2).mean(-1, keepdims=True) + self.eps)) * self.weight  # [B, T, D]


def make_norm(config: ModelConfig) -> Module:
    if config.norm == "rmsnorm":
        return RMSNorm(config.d_model, config.norm_eps)
    return LayerNorm(config.d_model, eps=config.norm_eps)


class FeedForward(Module):
    """Seed: Sequential(Linear(d, 4d), GELU(), Linear(4d, d)); `0` and `2` keep its names.
    SwiGLU fuses gate and up into `0` (gate first), as qkv fuses q, k and v."""

    def __init__(self, config: ModelConfig):
        self.activation = config.activation
        gated = 2 if config.activation == "swiglu" else 1
        setattr(self, "0", Linear(config.d_model, gated * config.hidden, bias=config.ffn_bias))
        setattr(self, "2", Linear(config.hidden, config.d_model, bias=config.ffn_bias))

    def forward(self, x: np.ndarray) -> np.ndarray:
        h = getattr(self, "0")(x)  # [B, T, hidden] (swiglu: [B, T, 2 * hidden])
        if self.activation == "swiglu":
            gate, up = np.split(h, 2, axis=-1)  # [B, T, hidden] each
            h = silu(gate) * up
        elif self.activation == "gelu_tanh":
            h = gelu_tanh(h)
        else:
            h = gelu(h)  # exact erf form, as the seed's nn.GELU()
        return getattr(self, "2")(h)  # [B, T, D]


class Block(Module):
    def __init__(self, config: ModelConfig, rng: np.random.Generator):
        self.config = config
        # Construction order is the seed's, so named_parameters lists the state_dict order.
        self.ln1, self.ln2 = make_norm(config), make_norm(config)
        self.qkv = Linear(config.d_model, config.qkv_dim, bias=config.attn_bias)
        self.proj = Linear(config.d_model, config.d_model, bias=config.attn_bias)
        self.ffn = FeedForward(config)
        self.dropout = Dropout(config.dropout, rng)  # pitfall 3: active only in train mode

    def attention(self, x, positions, rope, cache: Optional[KVCache], layer: int) -> np.ndarray:
        config = self.config
        B, T, D = x.shape
        H, Hkv, Dh = config.n_heads, config.kv_heads, config.head_dim
        q, k, v = np.split(self.qkv(x), [H * Dh, (H + Hkv) * Dh], axis=-1)  # split points, not sizes
        q = q.reshape(B, T, H, Dh).transpose(0, 2, 1, 3)  # [B, H, T, Dh]
        k = k.reshape(B, T, Hkv, Dh).transpose(0, 2, 1, 3)  # [B, Hkv, T, Dh]
        v = v.reshape(B, T, Hkv, Dh).transpose(0, 2, 1, 3)  # [B, Hkv, T, Dh]
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is None:
            keys, values, key_positions = k, v, positions  # [B, Hkv, T, Dh], [T]
        else:
            # Attend over the slots as they were plus this chunk, then write the chunk:
            # a ring buffer may overwrite slots that this chunk's first queries still need.
            keys = np.concatenate([cache.keys[layer], k], axis=2)  # [B, Hkv, S + T, Dh]
            values = np.concatenate([cache.values[layer], v], axis=2)  # [B, Hkv, S + T, Dh]
            key_positions = np.concatenate([cache.slot_positions, positions])  # [S + T]
            write_cache(cache, layer, k, v, positions)
        visible = attention_mask(positions, key_positions, config.sliding_window)  # [T, S']
        # GQA: each group of H / Hkv query heads shares one k/v head; grouping avoids a copy.
        q = q.reshape(B, Hkv, H // Hkv, T, Dh)  # [B, Hkv, G, T, Dh]
        scores = q @ keys[:, :, None].swapaxes(-2, -1) / math.sqrt(Dh)  # [B, Hkv, G, T, S']
        probs = softmax(np.where(visible, scores, -np.inf), axis=-1)  # [B, Hkv, G, T, S']
        out = probs @ values[:, :, None]  # [B, Hkv, G, T, Dh]
        out = out.reshape(B, H, T, Dh).transpose(0, 2, 1, 3).reshape(B, T, D)  # [B, T, D]
        return self.proj(out)  # [B, T, D]

    def forward(self, x, positions, rope, cache: Optional[KVCache], layer: int) -> np.ndarray:
        x = x + self.dropout(self.attention(self.ln1(x), positions, rope, cache, layer))  # [B, T, D]
        return x + self.dropout(self.ffn(self.ln2(x)))  # [B, T, D]


def write_cache(cache: KVCache, layer: int, k: np.ndarray, v: np.ndarray, positions: np.ndarray) -> None:
    slots = cache.keys.shape[3]
    keep = min(k.shape[2], slots)  # a chunk longer than a ring keeps only its newest tokens
    slot_index = positions[-keep:] % slots  # [keep]; without a window, slot == position
    cache.keys[layer][:, :, slot_index] = k[:, :, -keep:]
    cache.values[layer][:, :, slot_index] = v[:, :, -keep:]


class TinyModel(Module):
    def __init__(self, config: ModelConfig = ModelConfig(), seed: int = 0):
        self.config = config
        self.rng = np.random.default_rng(seed)  # dropout's randomness, shared by every block
        self.emb = Embedding(config.vocab_size, config.d_model)
        if config.positions == "learned":
            self.pos = Embedding(config.max_seq_len, config.d_model)
        self.blocks = [Block(config, self.rng) for _ in range(config.n_layers)]
        self.ln = make_norm(config)
        if not config.tie_embeddings:
            self.head = Linear(config.d_model, config.vocab_size, bias=False)
        self.forward_calls = 0  # counted so a test can see prefill is one call

    def forward(self, tokens: np.ndarray, cache: Optional[KVCache] = None):
        self.forward_calls += 1
        config = self.config
        B, T = tokens.shape
        start = 0 if cache is None else cache.length
        positions = token_positions(start, T)  # [T]
        x = self.emb(tokens)  # [B, T, D]
        rope = None
        if config.positions == "learned":
            x = x + self.pos.weight[positions]  # [B, T, D]
        else:
            rope = rope_tables(positions, config.head_dim, config.rope_theta, x.dtype)  # 2 x [T, Dh]
        for layer, block in enumerate(self.blocks):
            x = block(x, positions, rope, cache, layer)  # [B, T, D]
        if cache is not None:
            # Slot positions change only after every layer has read the old ones.
            slots = cache.slot_positions.shape[0]
            keep = min(T, slots)
            cache.slot_positions[positions[-keep:] % slots] = positions[-keep:]
            cache.length = start + T
        x = self.ln(x)  # [B, T, D]
        head_weight = self.emb.weight if config.tie_embeddings else self.head.weight  # [V, D]
        return x @ head_weight.T, cache  # [B, T, V]


def greedy(logits: np.ndarray) -> np.ndarray:
    return logits.argmax(axis=-1).astype(np.int64)  # [B, V] -> [B]; argmax gives intp


# No inference_mode decorator: NumPy records no autograd graph to switch off.
def generate_naive(model: TinyModel, prompt: np.ndarray, new_tokens: int, return_logits: bool = False):
    """Recompute the whole history every step: O(n^2) work per token."""
    model.eval()  # pitfall 3: dropout off, or the two paths disagree
    tokens = prompt  # [B, P]
    step_logits = []
    for _ in range(new_tokens):
        logits, _ = model(tokens)  # [B, t, V]
        step_logits.append(logits[:, -1])
        tokens = np.concatenate([tokens, greedy(logits[:, -1])[:, None]], axis=1)  # [B, t + 1]
    return (tokens, np.stack(step_logits, axis=1)) if return_logits else tokens  # [B, P + N], [B, N, V]


def generate_cached(model: TinyModel, prompt: np.ndarray, new_tokens: int, return_logits: bool = False, prefill: bool = True):
    """Prefill the prompt in one forward, then one token per step against the cache.
    prefill=False is pitfall 2 on purpose: the same tokens from P forwards instead of one."""
    model.eval()  # pitfall 3: dropout off, or the two paths disagree
    B, P = prompt.shape
    cache = init_cache(model.config, B, P + new_tokens, model.emb.weight.dtype)
    if prefill:
        logits, cache = model(prompt, cache)  # [B, P, V]
    else:
        for i in range(P):
            logits, cache = model(prompt[:, i : i + 1], cache)  # [B, 1, V]
    tokens = np.empty((B, P + new_tokens), dtype=prompt.dtype)  # [B, P + N]
    tokens[:, :P] = prompt
    step_logits = []
    for step in range(new_tokens):
        if step > 0:
            logits, cache = model(tokens[:, P + step - 1 : P + step], cache)  # [B, 1, V]
        step_logits.append(logits[:, -1])
        tokens[:, P + step] = greedy(logits[:, -1])
    return (tokens, np.stack(step_logits, axis=1)) if return_logits else tokens  # [B, P + N], [B, N, V]
