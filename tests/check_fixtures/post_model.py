"""A decoder in the style of the seed's blog post, written for kvports' tests: a PyTorch
TinyModel with the post's parameter names, its forward(idx, caches) with one dict cache per
block, and the post's two generators. Correct as it stands; tests/test_check.py writes
copies with MISTAKE set to one of the post's pitfalls (or one line changed), then checks them.
"""

import time

import torch
import torch.nn as nn

MISTAKE = None  # None, or one of: position_offset, mask_offset, cache_update, prefill, eval_mode

VOCAB, WIDTH, HEADS, LAYERS, CONTEXT = 500, 128, 4, 2, 512


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.ln2 = nn.LayerNorm(WIDTH)
        self.ffn = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
        self.drop = nn.Dropout(0.1)

    def forward(self, x, cache):
        B, T, D = x.shape
        heads = self.qkv(self.ln1(x)).view(B, T, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        q, k, v = heads[0], heads[1], heads[2]  # [B, H, T, Dh] each
        if cache is not None:
            if "k" in cache:
                k = torch.cat([cache["k"], k], dim=2)  # [B, H, S, Dh]
                v = torch.cat([cache["v"], v], dim=2)
            if MISTAKE != "cache_update" or "k" not in cache:
                cache["k"], cache["v"] = k, v
        S = k.shape[2]
        offset = 1 if MISTAKE == "mask_offset" else S - T + 1
        hidden = torch.triu(torch.ones(T, S, dtype=torch.bool), diagonal=offset)  # [T, S]
        scores = (q @ k.transpose(-1, -2)) / (D // HEADS) ** 0.5  # [B, H, T, S]
        attn = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)
        y = (attn @ v).transpose(1, 2).reshape(B, T, D)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.ffn(self.ln2(x)))


class TinyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx, caches=None):
        T = idx.shape[1]
        seen = caches[0]["k"].shape[2] if caches is not None and "k" in caches[0] else 0
        first = 0 if MISTAKE == "position_offset" else seen
        x = self.emb(idx) + self.pos(torch.arange(first, first + T))
        for i, block in enumerate(self.blocks):
            x = block(x, None if caches is None else caches[i])
        return self.head(self.ln(x))


@torch.no_grad()
def generate_naive(model, prompt, n):
    if MISTAKE != "eval_mode":
        model.eval()
    idx = prompt
    for _ in range(n):
        nxt = model(idx)[:, -1].argmax(-1, keepdim=True)  # [B, 1]
        idx = torch.cat([idx, nxt], dim=1)
    return idx


@torch.no_grad()
def generate_cached(model, prompt, n):
    if MISTAKE != "eval_mode":
        model.eval()
    caches = [{} for _ in model.blocks]
    if MISTAKE == "prefill":
        for i in range(prompt.shape[1]):
            logits = model(prompt[:, i : i + 1], caches)
    else:
        logits = model(prompt, caches)
    idx = prompt
    for step in range(n):
        nxt = logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
        idx = torch.cat([idx, nxt], dim=1)
        if step < n - 1:
            logits = model(nxt, caches)
    return idx


if __name__ == "__main__":
    torch.manual_seed(0)
    model = TinyModel()
    prompt = torch.randint(0, VOCAB, (1, 5))
    started = time.time()
    print(generate_naive(model, prompt, 20)[0].tolist(), time.time() - started)
    raise SystemExit("the __main__ block ran: kvports check must import this file without running it")
