"""An implementation of the seed's model in NumPy behind kvports check's adapter interface
(load, full, step), written for kvports' tests: its own code, float32 throughout, a cache
preallocated per block and written at the cache length. Correct as it stands;
tests/test_check.py writes copies with MISTAKE set to one known mistake.
"""

import numpy as np
from scipy.special import erf

MISTAKE = None  # None, or one of: position_offset, mask_offset, cache_update, prefill, eval_mode, never_grown


class Model:
    def __init__(self, config, weights):
        self.config = config
        self.w = {name: np.asarray(array, dtype=np.float32) for name, array in weights.items()}
        self.rng = np.random.default_rng()

    def norm(self, x, name):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + np.float32(self.config["norm_eps"])) * self.w[name + ".weight"] + self.w[
            name + ".bias"
        ]

    def linear(self, x, name):
        out = x @ self.w[name + ".weight"].T
        return out + self.w[name + ".bias"] if name + ".bias" in self.w else out

    def dropout(self, x):
        if MISTAKE != "eval_mode":
            return x
        return x * (self.rng.random(x.shape) > 0.1) / np.float32(0.9)

    def forward(self, tokens, cache):
        """tokens [B, T] after cache["length"] tokens (cache None: no cache); logits [B, T, V]."""
        c = self.config
        B, T = tokens.shape
        H = c["n_heads"]
        Dh = c["d_model"] // H
        past = 0 if cache is None else cache["length"]
        first = 0 if MISTAKE == "position_offset" else past
        x = self.w["emb.weight"][tokens] + self.w["pos.weight"][first : first + T]
        for i in range(c["n_layers"]):
            p = f"blocks.{i}."
            qkv = self.linear(self.norm(x, p + "ln1"), p + "qkv").reshape(B, T, 3, H, Dh)
            q, k, v = (qkv[:, :, j].transpose(0, 2, 1, 3) for j in range(3))  # [B, H, T, Dh]
            if cache is not None and MISTAKE == "never_grown" and past:  # attends the prefill's cache only
                k, v = cache["k"][i][:, :, :past], cache["v"][i][:, :, :past]
            elif cache is not None:
                at = 0 if MISTAKE == "cache_update" else past
                cache["k"][i][:, :, at : at + T] = k
                cache["v"][i][:, :, at : at + T] = v
                k, v = cache["k"][i][:, :, : past + T], cache["v"][i][:, :, : past + T]
            S = k.shape[2]
            seen = np.arange(T)[:, None] + (0 if MISTAKE == "mask_offset" else S - T) >= np.arange(S)[None, :]
            scores = np.where(seen, q @ k.transpose(0, 1, 3, 2) / np.float32(np.sqrt(Dh)), -np.inf)
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            out = (scores / scores.sum(-1, keepdims=True)) @ v
            x = x + self.dropout(self.linear(out.transpose(0, 2, 1, 3).reshape(B, T, -1), p + "proj"))
            h = self.linear(self.norm(x, p + "ln2"), p + "ffn.0")
            h = 0.5 * h * (1 + erf(h / np.float32(np.sqrt(2))))
            x = x + self.dropout(self.linear(h, p + "ffn.2"))
        if cache is not None and (MISTAKE != "never_grown" or not past):
            cache["length"] = past + T
        head = self.w.get("head.weight", self.w["emb.weight"])
        return self.norm(x, "ln") @ head.T


def load(config, weights):
    return Model(config, weights)


def full(model, tokens):
    return model.forward(tokens, None)


def step(model, tokens, state):
    if state is None:
        c = model.config
        shape = (tokens.shape[0], c["n_heads"], c["max_seq_len"], c["d_model"] // c["n_heads"])
        state = {"length": 0, "k": [np.zeros(shape, np.float32) for _ in range(c["n_layers"])]}
        state["v"] = [np.zeros(shape, np.float32) for _ in range(c["n_layers"])]
    if MISTAKE == "prefill":
        pieces = [model.forward(tokens[:, i : i + 1], state) for i in range(tokens.shape[1])]
        return np.concatenate(pieces, axis=1), state
    return model.forward(tokens, state), state
