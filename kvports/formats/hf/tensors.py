"""Tensor names and layouts: Hugging Face's (gpt2's Conv1D `(in, out)`, Llama's separate
q/k/v and gate/up projections) against ours (the seed's names, fused qkv, `(out, in)`).

An import is a plan, walked twice: once against the checkpoint's headers (every name
present, every shape right, nothing left over), before any tensor is read; then to read
and assemble our tensors. The plan is generated layer by layer, and the first walk stops
at the first missing name, so a config's n_layers never becomes a list longer than the
checkpoint's own."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from kvports.shared.config import ModelConfig
from kvports.shared.errors import UserError, echo
from kvports.shared.rope import rope_frequencies


@dataclass(frozen=True)
class Source:
    """One of our tensors: Hugging Face tensors (short names) stacked along dim 0, in order,
    and transposed for GPT-2's Conv1D."""

    ours: str
    parts: tuple[tuple[str, tuple[int, ...]], ...]
    transpose: bool = False
    offset: float = 0.0  # added to the tensor: Gemma's norms compute with (1 + w), folded into ours once


@dataclass(frozen=True)
class Extra:
    """A tensor a checkpoint may hold but we do not load: a constant buffer (dropped), the
    copy of a tied head (must equal the embedding), RoPE's stored frequencies (must be the
    ones rope_theta gives)."""

    name: str
    shape: tuple[int, ...]
    kind: str  # "buffer", "tied head" or "inv_freq"


Step = Source | Extra


class HFTensors:
    """The checkpoint's tensor names and shapes (prefix stripped), checked against a plan."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], prefix: str):
        # LMHeadModel/ForCausalLM checkpoints prefix the body ("transformer.", "model.");
        # bare GPT2Model/LlamaModel ones (and the original GPT-2 files) do not.
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.full: dict[str, str] = {}
        for name, shape in shapes.items():
            short = name[len(prefix) :] if name.startswith(prefix) else name
            if short in self.shapes:
                raise UserError(f"tensor {echo(name)} appears both with and without the {prefix!r} prefix")
            self.shapes[short], self.full[short] = shape, name
        self.prefix = prefix

    def full_name(self, name: str) -> str:
        return self.full.get(name, name if name == "lm_head.weight" else self.prefix + name)

    def check(self, plan: Iterator[Step]) -> None:
        """Every planned name present with its shape, every optional one right if present,
        nothing else: from the headers alone."""
        taken: set[str] = set()
        for step in plan:
            parts = step.parts if isinstance(step, Source) else ((step.name, step.shape),)
            for name, shape in parts:
                if name not in self.shapes:
                    if isinstance(step, Extra):
                        continue
                    raise UserError(f"missing tensor {echo(self.full_name(name))} (expected shape {list(shape)})")
                if self.shapes[name] != shape and not (isinstance(step, Extra) and step.kind == "buffer"):
                    raise UserError(
                        f"tensor {echo(self.full_name(name))} has shape {list(self.shapes[name])}, "
                        f"the config needs {list(shape)}"
                    )
                taken.add(name)
        for name in sorted(self.shapes):
            if name not in taken:
                raise UserError(
                    f"unexpected tensor {echo(self.full_name(name))} of shape {list(self.shapes[name])}: "
                    "not part of the model this config describes"
                )

    def build(self, plan: Iterator[Step], read: Callable[[str], np.ndarray], config: ModelConfig) -> dict:
        """Our tensors, read (by full name) and assembled; the optional ones read and checked."""
        out: dict[str, np.ndarray] = {}
        for step in plan:
            if isinstance(step, Source):
                arrays = [read(self.full_name(name)) for name, _ in step.parts]
                array = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
                array = np.ascontiguousarray(array.T if step.transpose else array)
                out[step.ours] = array + np.asarray(step.offset, array.dtype) if step.offset else array
            elif step.name in self.shapes and step.kind != "buffer":
                check_optional(step, read(self.full_name(step.name)), out, config)
        return out


def check_optional(step: Extra, array: np.ndarray, out: dict[str, np.ndarray], config: ModelConfig) -> None:
    if step.kind == "tied head":
        # A tied checkpoint may still store lm_head (a copy); a different one would be dropped silently.
        if not np.array_equal(array, out["emb.weight"]):
            raise UserError(
                "tensor 'lm_head.weight' differs from the embedding, but tie_word_embeddings=true "
                "says the head is the embedding; set tie_word_embeddings=false to use it"
            )
    else:  # Older Llama files store the RoPE frequencies; they must be the ones theta gives.
        if not np.allclose(array, rope_frequencies(config), rtol=1e-5):
            raise UserError(
                f"tensor {echo(step.name)} is not the RoPE this config gives (rope_theta={config.rope_theta})"
            )


def head(config: ModelConfig) -> Iterator[Step]:
    if config.tie_embeddings:
        yield Extra("lm_head.weight", (config.vocab_size, config.d_model), "tied head")
    else:
        yield Source("head.weight", (("lm_head.weight", (config.vocab_size, config.d_model)),))


def gpt2_plan(config: ModelConfig) -> Iterator[Step]:
    D, V, F = config.d_model, config.vocab_size, config.ffn_dim
    yield Source("emb.weight", (("wte.weight", (V, D)),))
    yield Source("pos.weight", (("wpe.weight", (config.max_seq_len, D)),))
    for i in range(config.n_layers):
        h, b = f"h.{i}.", f"blocks.{i}."
        # The causal-mask buffers older GPT-2 files carry; constants, not weights.
        for buffer in ("attn.bias", "attn.masked_bias"):
            yield Extra(h + buffer, (), "buffer")  # any shape: never read
        for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
            yield Source(f"{b}{ours}.weight", ((f"{h}{theirs}.weight", (D,)),))
            yield Source(f"{b}{ours}.bias", ((f"{h}{theirs}.bias", (D,)),))
        # GPT-2's Conv1D stores weights (in, out); ours are (out, in) like nn.Linear.
        for ours, theirs, n_in, n_out in (
            ("qkv", "attn.c_attn", D, 3 * D),
            ("proj", "attn.c_proj", D, D),
            ("ffn.0", "mlp.c_fc", D, F),
            ("ffn.2", "mlp.c_proj", F, D),
        ):
            yield Source(f"{b}{ours}.weight", ((f"{h}{theirs}.weight", (n_in, n_out)),), transpose=True)
            yield Source(f"{b}{ours}.bias", ((f"{h}{theirs}.bias", (n_out,)),))
    yield Source("ln.weight", (("ln_f.weight", (D,)),))
    yield Source("ln.bias", (("ln_f.bias", (D,)),))
    yield from head(config)


def llama_plan(config: ModelConfig, model_type: str = "llama") -> Iterator[Step]:
    """Llama's names, and the families built on it: Gemma 3's four norms a layer (each (1 + w)),
    Phi-3's fused qkv_proj and gate_up_proj, Qwen's q, k and v biases and Qwen3's and Gemma 3's qk-norms."""
    D, V, F = config.d_model, config.vocab_size, config.ffn_dim
    Dh, H, Hkv = config.head_dim, config.n_heads, config.kv_heads
    offset = 1.0 if model_type == "gemma3_text" else 0.0
    yield Source("emb.weight", (("embed_tokens.weight", (V, D)),))
    for i in range(config.n_layers):
        h, b = f"layers.{i}.", f"blocks.{i}."
        yield Source(b + "ln1.weight", ((h + "input_layernorm.weight", (D,)),), offset=offset)
        ln2 = "pre_feedforward_layernorm" if config.post_norms else "post_attention_layernorm"
        yield Source(b + "ln2.weight", ((f"{h}{ln2}.weight", (D,)),), offset=offset)
        rows = {"q": H * Dh, "k": Hkv * Dh, "v": Hkv * Dh}
        # Our qkv Linear is q, k and v stacked along the output dim, in that order (Phi-3's file has it so).
        if model_type == "phi3":
            yield Source(b + "qkv.weight", ((h + "self_attn.qkv_proj.weight", (sum(rows.values()), D)),))
        else:
            yield Source(b + "qkv.weight", tuple((f"{h}self_attn.{n}_proj.weight", (r, D)) for n, r in rows.items()))
        if config.attn_bias or config.qkv_bias:
            yield Source(b + "qkv.bias", tuple((f"{h}self_attn.{n}_proj.bias", (r,)) for n, r in rows.items()))
        yield Source(b + "proj.weight", ((h + "self_attn.o_proj.weight", (D, H * Dh)),))
        if config.attn_bias:
            yield Source(b + "proj.bias", ((h + "self_attn.o_proj.bias", (D,)),))
        # SwiGLU's gate and up stack into ffn.0, gate first, as our FeedForward splits them (Phi-3's gate_up too).
        if model_type == "phi3":
            yield Source(b + "ffn.0.weight", ((h + "mlp.gate_up_proj.weight", (2 * F, D)),))
        else:
            yield Source(b + "ffn.0.weight", ((h + "mlp.gate_proj.weight", (F, D)), (h + "mlp.up_proj.weight", (F, D))))
        if config.ffn_bias:
            yield Source(b + "ffn.0.bias", ((h + "mlp.gate_proj.bias", (F,)), (h + "mlp.up_proj.bias", (F,))))
        yield Source(b + "ffn.2.weight", ((h + "mlp.down_proj.weight", (D, F)),))
        if config.ffn_bias:
            yield Source(b + "ffn.2.bias", ((h + "mlp.down_proj.bias", (D,)),))
        if config.qk_norm:
            for n in ("q", "k"):
                yield Source(f"{b}{n}_norm.weight", ((f"{h}self_attn.{n}_norm.weight", (Dh,)),), offset=offset)
        if config.post_norms:
            yield Source(b + "ln1_post.weight", ((h + "post_attention_layernorm.weight", (D,)),), offset=offset)
            yield Source(b + "ln2_post.weight", ((h + "post_feedforward_layernorm.weight", (D,)),), offset=offset)
        yield Extra(h + "self_attn.rotary_emb.inv_freq", (Dh // 2,), "inv_freq")
    yield Source("ln.weight", (("norm.weight", (D,)),), offset=offset)
    yield from head(config)


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
