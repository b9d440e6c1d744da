"""A decoder with the seed's blog post's own signatures, written for kvports' tests:
Block(d=128, h=4) with forward(x, cache=None), TinyModel(vocab=500, d=128) with
forward(idx, caches) where caches is required (a list of None per block for the whole
history, a list of dicts for the cached path), generate_naive and generate_cached as the post
calls them. The post's slips are fixed (a None cache is not read; the naive loop joins along
dim=1). Correct as it stands, plus a dropout layer a learner may add; tests/test_check.py writes
copies with MISTAKE set to one of the known mistakes (or one line changed), then checks them.
"""

import time

import torch
import torch.nn as nn

MISTAKE = None  # None, or one of: position_offset, mask_offset, cache_update, prefill, eval_mode


class Block(nn.Module):
    def __init__(self, d=128, h=4):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ffn = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(0.1)

    def forward(self, x, cache=None):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)  # [B, T, D] each
        q, k, v = (t.view(B, T, self.h, D // self.h).transpose(1, 2) for t in (q, k, v))  # [B, h, T, dh]
        if cache is not None:
            if cache.get("k") is not None:
                k = torch.cat([cache["k"], k], dim=2)  # [B, h, S, dh]
                v = torch.cat([cache["v"], v], dim=2)
            if MISTAKE != "cache_update" or cache.get("k") is None:
                cache["k"], cache["v"] = k, v
        T, S = q.shape[2], k.shape[2]
        diagonal = 1 if MISTAKE == "mask_offset" else S - T + 1
        mask = torch.triu(torch.ones(T, S, dtype=torch.bool), diagonal=diagonal)  # [T, S]: True is hidden
        att = (q @ k.transpose(-2, -1) / k.shape[-1] ** 0.5).masked_fill(mask, float("-inf")).softmax(-1)
        x = x + self.drop(self.proj((att @ v).transpose(1, 2).reshape(B, T, D)))
        return x + self.drop(self.ffn(self.ln2(x)))


class TinyModel(nn.Module):
    def __init__(self, vocab=500, d=128):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(512, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(2)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, caches):
        T = idx.shape[1]
        first = caches[0]
        S = first["k"].shape[2] if first is not None and first.get("k") is not None else 0  # tokens cached
        if MISTAKE == "position_offset":
            S = 0
        x = self.emb(idx) + self.pos.weight[S : S + T]  # [B, T, d]
        for block, cache in zip(self.blocks, caches, strict=True):
            x = block(x, cache)
        return self.head(self.ln(x))  # [B, T, vocab]


def generate_naive(model, prompt, n):
    if MISTAKE != "eval_mode":
        model.eval()
    idx = prompt
    for _ in range(n):
        logits = model(idx, [None] * len(model.blocks))  # the whole history, every step
        idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx


def generate_cached(model, prompt, n):
    if MISTAKE != "eval_mode":
        model.eval()
    caches = [{} for _ in model.blocks]
    if MISTAKE == "prefill":
        for i in range(prompt.shape[1]):
            logits = model(prompt[:, i : i + 1], caches)
    else:
        logits = model(prompt, caches)  # the prefill: the prompt's k and v in one forward
    idx = logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
    out = [idx]
    for _ in range(n - 1):
        logits = model(idx, caches)  # one new token a step
        idx = logits[:, -1].argmax(-1, keepdim=True)
        out.append(idx)
    return torch.cat([prompt, *out], dim=1)


if __name__ == "__main__":
    torch.manual_seed(0)
    model = TinyModel().eval()
    prompt = torch.randint(0, 500, (1, 5))
    started = time.perf_counter()
    print(generate_naive(model, prompt, 20)[0].tolist(), time.perf_counter() - started)
    raise SystemExit("the __main__ block ran: kvports check must import this file without running it")
