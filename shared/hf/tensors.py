"""Tensor names and layouts: Hugging Face's (gpt2's Conv1D `(in, out)`, Llama's separate
q/k/v and gate/up projections) against ours (the seed's names, fused qkv, `(out, in)`)."""

from __future__ import annotations

import numpy as np

from kvports.shared.config import ModelConfig
from kvports.shared.errors import UserError


class HFTensors:
    """The checkpoint's tensors, taken by name and checked for shape; leftovers are refused."""

    def __init__(self, tensors: dict[str, np.ndarray], prefix: str):
        # LMHeadModel/ForCausalLM checkpoints prefix the body ("transformer.", "model.");
        # bare GPT2Model/LlamaModel ones (and the original GPT-2 files) do not.
        self.tensors: dict[str, np.ndarray] = {}
        for name, array in tensors.items():
            short = name[len(prefix) :] if name.startswith(prefix) else name
            if short in self.tensors:
                raise UserError(f"tensor {name!r} appears both with and without the {prefix!r} prefix")
            self.tensors[short] = array
        self.prefix = prefix
        self.taken: set = set()

    def has(self, name: str) -> bool:
        return name in self.tensors

    def full_name(self, name: str) -> str:
        return name if name == "lm_head.weight" else self.prefix + name

    def take(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.tensors:
            raise UserError(f"missing tensor {self.full_name(name)!r} (expected shape {list(shape)})")
        array = self.tensors[name]
        if tuple(array.shape) != tuple(shape):
            raise UserError(
                f"tensor {self.full_name(name)!r} has shape {list(array.shape)}, the config needs {list(shape)}"
            )
        self.taken.add(name)
        return array

    def drop(self, name: str) -> None:
        self.taken.add(name)

    def refuse_leftovers(self) -> None:
        for name in sorted(self.tensors):
            if name not in self.taken:
                raise UserError(
                    f"unexpected tensor {self.full_name(name)!r} of shape {list(self.tensors[name].shape)}: "
                    "not part of the model this config describes"
                )


def tied_head(hf: HFTensors, config: ModelConfig, emb: np.ndarray) -> None:
    """A tied checkpoint may still store lm_head (a copy); a different one would be dropped silently."""
    if hf.has("lm_head.weight"):
        head = hf.take("lm_head.weight", (config.vocab_size, config.d_model))
        if not np.array_equal(head, emb):
            raise UserError(
                "tensor 'lm_head.weight' differs from the embedding, but tie_word_embeddings=true "
                "says the head is the embedding; set tie_word_embeddings=false to use it"
            )


def gpt2_tensors(hf: HFTensors, config: ModelConfig) -> dict[str, np.ndarray]:
    D, V, F = config.d_model, config.vocab_size, config.ffn_dim
    out = {"emb.weight": hf.take("wte.weight", (V, D)), "pos.weight": hf.take("wpe.weight", (config.max_seq_len, D))}
    for i in range(config.n_layers):
        h, b = f"h.{i}.", f"blocks.{i}."
        # The causal-mask buffers older GPT-2 files carry; constants, not weights.
        for buffer in ("attn.bias", "attn.masked_bias"):
            if hf.has(h + buffer):
                hf.drop(h + buffer)
        for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
            out[f"{b}{ours}.weight"] = hf.take(f"{h}{theirs}.weight", (D,))
            out[f"{b}{ours}.bias"] = hf.take(f"{h}{theirs}.bias", (D,))
        # GPT-2's Conv1D stores weights (in, out); ours are (out, in) like nn.Linear.
        for ours, theirs, n_in, n_out in (
            ("qkv", "attn.c_attn", D, 3 * D),
            ("proj", "attn.c_proj", D, D),
            ("ffn.0", "mlp.c_fc", D, F),
            ("ffn.2", "mlp.c_proj", F, D),
        ):
            out[f"{b}{ours}.weight"] = hf.take(f"{h}{theirs}.weight", (n_in, n_out)).T.copy()
            out[f"{b}{ours}.bias"] = hf.take(f"{h}{theirs}.bias", (n_out,))
    out["ln.weight"], out["ln.bias"] = hf.take("ln_f.weight", (D,)), hf.take("ln_f.bias", (D,))
    if config.tie_embeddings:
        tied_head(hf, config, out["emb.weight"])
    else:
        out["head.weight"] = hf.take("lm_head.weight", (V, D))
    return out


def llama_tensors(hf: HFTensors, config: ModelConfig) -> dict[str, np.ndarray]:
    D, V, F = config.d_model, config.vocab_size, config.ffn_dim
    Dh, H, Hkv = config.head_dim, config.n_heads, config.kv_heads
    out = {"emb.weight": hf.take("embed_tokens.weight", (V, D))}
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, Dh, 2, dtype=np.float64) / Dh))  # [Dh/2]
    for i in range(config.n_layers):
        h, b = f"layers.{i}.", f"blocks.{i}."
        out[b + "ln1.weight"] = hf.take(h + "input_layernorm.weight", (D,))
        out[b + "ln2.weight"] = hf.take(h + "post_attention_layernorm.weight", (D,))
        rows = {"q": H * Dh, "k": Hkv * Dh, "v": Hkv * Dh}
        # Our qkv Linear is q, k and v stacked along the output dim, in that order.
        out[b + "qkv.weight"] = np.concatenate(
            [hf.take(f"{h}self_attn.{n}_proj.weight", (r, D)) for n, r in rows.items()]
        )
        out[b + "proj.weight"] = hf.take(h + "self_attn.o_proj.weight", (D, H * Dh))
        # SwiGLU's gate and up stack into ffn.0, gate first, as our FeedForward splits them.
        out[b + "ffn.0.weight"] = np.concatenate(
            [hf.take(h + "mlp.gate_proj.weight", (F, D)), hf.take(h + "mlp.up_proj.weight", (F, D))]
        )
        out[b + "ffn.2.weight"] = hf.take(h + "mlp.down_proj.weight", (D, F))
        if config.attn_bias:
            out[b + "qkv.bias"] = np.concatenate(
                [hf.take(f"{h}self_attn.{n}_proj.bias", (r,)) for n, r in rows.items()]
            )
            out[b + "proj.bias"] = hf.take(h + "self_attn.o_proj.bias", (D,))
        if config.ffn_bias:
            out[b + "ffn.0.bias"] = np.concatenate(
                [hf.take(h + "mlp.gate_proj.bias", (F,)), hf.take(h + "mlp.up_proj.bias", (F,))]
            )
            out[b + "ffn.2.bias"] = hf.take(h + "mlp.down_proj.bias", (D,))
        # Older Llama files store the RoPE frequencies; they must be the ones theta gives.
        name = h + "self_attn.rotary_emb.inv_freq"
        if hf.has(name):
            stored = hf.take(name, (Dh // 2,))
            if not np.allclose(stored, inv_freq, rtol=1e-5):
                raise UserError(f"tensor {hf.full_name(name)!r} is not plain RoPE with rope_theta={config.rope_theta}")
    out["ln.weight"] = hf.take("norm.weight", (D,))
    if config.tie_embeddings:
        tied_head(hf, config, out["emb.weight"])
    else:
        out["head.weight"] = hf.take("lm_head.weight", (V, D))
    return out


def gpt2_hf_tensors(config: ModelConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {"transformer.wte.weight": tensors["emb.weight"], "transformer.wpe.weight": tensors["pos.weight"]}
    for i in range(config.n_layers):
        h, b = f"transformer.h.{i}.", f"blocks.{i}."
        for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
            out[f"{h}{theirs}.weight"], out[f"{h}{theirs}.bias"] = (
                tensors[f"{b}{ours}.weight"],
                tensors[f"{b}{ours}.bias"],
            )
        for ours, theirs in (
            ("qkv", "attn.c_attn"),
            ("proj", "attn.c_proj"),
            ("ffn.0", "mlp.c_fc"),
            ("ffn.2", "mlp.c_proj"),
        ):
            weight = tensors[f"{b}{ours}.weight"]  # (out, in); Conv1D wants (in, out)
            out[f"{h}{theirs}.weight"] = weight.T
            # GPT-2 always has these biases; zeros compute what a bias-free layer does.
            out[f"{h}{theirs}.bias"] = tensors.get(f"{b}{ours}.bias", np.zeros(weight.shape[0], weight.dtype))
    out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = tensors["ln.weight"], tensors["ln.bias"]
    if not config.tie_embeddings:
        out["lm_head.weight"] = tensors["head.weight"]
    return {name: np.ascontiguousarray(array) for name, array in out.items()}


def llama_hf_tensors(config: ModelConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Ours -> LlamaForCausalLM's (and MistralForCausalLM's) names: llama_tensors, inverted."""
    Dh, H, Hkv, F = config.head_dim, config.n_heads, config.kv_heads, config.ffn_dim
    q, k = H * Dh, Hkv * Dh  # rows of q and of k in our fused qkv
    out = {"model.embed_tokens.weight": tensors["emb.weight"], "model.norm.weight": tensors["ln.weight"]}
    for i in range(config.n_layers):
        h, b = f"model.layers.{i}.", f"blocks.{i}."
        out[h + "input_layernorm.weight"] = tensors[b + "ln1.weight"]
        out[h + "post_attention_layernorm.weight"] = tensors[b + "ln2.weight"]
        for kind in ("weight", "bias") if config.attn_bias else ("weight",):
            fused = tensors[f"{b}qkv.{kind}"]
            out[f"{h}self_attn.q_proj.{kind}"] = fused[:q]
            out[f"{h}self_attn.k_proj.{kind}"] = fused[q : q + k]
            out[f"{h}self_attn.v_proj.{kind}"] = fused[q + k :]
            out[f"{h}self_attn.o_proj.{kind}"] = tensors[f"{b}proj.{kind}"]
        for kind in ("weight", "bias") if config.ffn_bias else ("weight",):
            out[f"{h}mlp.gate_proj.{kind}"] = tensors[f"{b}ffn.0.{kind}"][:F]
            out[f"{h}mlp.up_proj.{kind}"] = tensors[f"{b}ffn.0.{kind}"][F:]
            out[f"{h}mlp.down_proj.{kind}"] = tensors[f"{b}ffn.2.{kind}"]
    if not config.tie_embeddings:
        out["lm_head.weight"] = tensors["head.weight"]
    return {name: np.ascontiguousarray(array) for name, array in out.items()}
