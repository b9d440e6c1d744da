"""The seed's cached generation as its blog post wrote it, in PyTorch: the baseline
the ports' preallocated caches are measured against.

Each layer's cache is a dict whose k and v grow by `torch.cat` every step (a fresh
copy of the whole history per token), and the causal mask is rebuilt every step with
`triu(ones(T, S), diagonal=S - T + 1)`. The seed's three fatal bugs are fixed the
obvious way; nothing else is improved. The seed's architecture, or GPT-2's, which
differs from it only in the GELU (tanh) and the head (tied to the embedding): nothing
the cache touches, so the bench's gpt2-small preset has this row too.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn as nn

from kvports.shared.config import ModelConfig
from kvports.torch_impl import port as torch_port

NAME = "seed-concat"
MODES = ("cached",)  # the seed's naive loop is the torch port's naive row


def check_seed_shaped(config: ModelConfig) -> None:
    """The seed's architecture or GPT-2's: learned positions, LayerNorm, full multi-head attention at
    1 / sqrt(Dh), a 4x MLP and biases everywhere; exact or tanh GELU, an untied or tied head. Every
    field a family added (a bias on q/k/v alone, q/k norms, post-norms, an embedding or attention
    scale) is refused too: this model has no place for it, and would run without it."""
    seed = ModelConfig()
    fields = (
        "positions",
        "norm",
        "attn_bias",
        "ffn_bias",
        "sliding_window",
        "qkv_bias",
        "qk_norm",
        "post_norms",
        "embed_scale",
        "attn_scale",
    )
    different = [name for name in fields if getattr(config, name) != getattr(seed, name)]
    # What the seed's shapes imply, however a config spells it (None or the same number).
    implied = {
        "n_kv_heads": config.kv_heads == config.n_heads,
        "ffn_hidden": config.ffn_dim == 4 * config.d_model,
        "head_size": config.head_dim * config.n_heads == config.d_model,
    }
    different += [name for name, same in implied.items() if not same]
    if config.activation not in ("gelu", "gelu_tanh"):
        different.append("activation")
    if different:
        raise ValueError(
            f"{NAME} runs the seed's or GPT-2's architecture only; this config differs in {', '.join(different)}"
        )


class SeedBlock(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        d = config.d_model
        self.n_heads = config.n_heads
        self.ln1, self.ln2 = nn.LayerNorm(d, eps=config.norm_eps), nn.LayerNorm(d, eps=config.norm_eps)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        gelu = nn.GELU(approximate="tanh" if config.activation == "gelu_tanh" else "none")
        self.ffn = nn.Sequential(nn.Linear(d, 4 * d), gelu, nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, cache: dict | None) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q = q.view(B, T, self.n_heads, -1).transpose(1, 2)  # [B, H, T, Dh]
        k = k.view(B, T, self.n_heads, -1).transpose(1, 2)  # [B, H, T, Dh]
        v = v.view(B, T, self.n_heads, -1).transpose(1, 2)  # [B, H, T, Dh]
        if cache is not None:
            if cache.get("k") is not None:
                k = torch.cat([cache["k"], k], dim=2)  # [B, H, S, Dh]: the whole history copied again
                v = torch.cat([cache["v"], v], dim=2)  # [B, H, S, Dh]
            cache["k"], cache["v"] = k, v
        S = k.shape[2]
        mask = torch.triu(
            torch.ones(T, S, dtype=torch.bool, device=x.device), diagonal=S - T + 1
        )  # [T, S], True = hidden
        att = q @ k.transpose(-2, -1) / k.shape[-1] ** 0.5  # [B, H, T, S]
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(B, T, D))  # [B, T, D]
        return x + self.ffn(self.ln2(x))  # [B, T, D]


class SeedModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos = nn.Embedding(config.max_seq_len, config.d_model)
        self.blocks = nn.ModuleList([SeedBlock(config) for _ in range(config.n_layers)])
        self.ln = nn.LayerNorm(config.d_model, eps=config.norm_eps)
        # GPT-2 ties its head to the embedding: no head of its own.
        self.head = None if config.tie_embeddings else nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, caches: list[dict | None]) -> torch.Tensor:
        T = idx.shape[1]
        S = caches[0]["k"].shape[2] if caches[0] is not None and caches[0].get("k") is not None else 0
        x = self.emb(idx) + self.pos.weight[S : S + T]  # [B, T, D]; positions start at the cached length
        for block, cache in zip(self.blocks, caches, strict=True):
            x = block(x, cache)  # [B, T, D]
        if self.head is None:
            return self.ln(x) @ self.emb.weight.T  # [B, T, V]
        return self.head(self.ln(x))  # [B, T, V]


@torch.inference_mode()
def seed_generate_cached(
    model: SeedModel, prompt: torch.Tensor, n: int, on_token: Callable[[torch.Tensor], None] | None = None
) -> torch.Tensor:
    caches: list[dict[str, torch.Tensor]] = [{} for _ in model.blocks]
    logits = model(prompt, caches)  # [B, P, V]: the prefill
    idx = logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
    out = [idx]
    if on_token is not None:
        on_token(idx[:, 0])
    for _ in range(n - 1):
        logits = model(idx, caches)  # [B, 1, V]
        idx = logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
        out.append(idx)
        if on_token is not None:
            on_token(idx[:, 0])
    return torch.cat([prompt] + out, dim=1)  # [B, P + N]


def versions() -> dict[str, str]:
    return torch_port.versions()


def load_model(
    config: ModelConfig, tensors: dict[str, np.ndarray], dtype: str = "float32", device: str = "cpu"
) -> SeedModel:
    check_seed_shaped(config)
    with torch.device("meta"):
        model = SeedModel(config)
    state = {name: torch.tensor(array) for name, array in tensors.items()}  # torch-allocated, as the seed's own model
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device=torch_port.resolve_device(device), dtype=torch_port.TORCH_DTYPES[dtype]).eval()


def generate(
    model: SeedModel,
    prompts: np.ndarray,
    new_tokens: int,
    mode: str = "cached",
    return_logits: bool = False,
    on_token: Callable[[np.ndarray], None] | None = None,
) -> tuple[np.ndarray, None]:
    """The seed's cached loop: tokens [B, P + N] and no logits (the bench asks for none);
    on_token(token [B]) as each new token reaches the host."""
    if mode not in MODES:
        raise ValueError(f"{NAME} has modes {MODES}, not {mode!r}")
    prompt = torch.from_numpy(np.asarray(prompts, dtype=np.int64)).to(model.emb.weight.device)  # [B, P]
    callback = None if on_token is None else (lambda token: on_token(token.cpu().numpy()))
    return seed_generate_cached(model.eval(), prompt, new_tokens, callback).cpu().numpy(), None  # [B, P + N]


def synchronize(model: SeedModel) -> None:
    if model.emb.weight.device.type == "cuda":
        torch.cuda.synchronize()


matvec_seconds = torch_port.matvec_seconds
