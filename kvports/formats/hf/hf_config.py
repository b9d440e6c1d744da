"""config.json <-> ModelConfig, for model types gpt2, llama, mistral, qwen2, qwen3, gemma3_text and phi3.

Every config field is either mapped, checked against the one value we implement, or
on a list of fields that cannot change the forward pass (ids, bookkeeping, training
dropout). Anything else is refused, naming the field: a field we skipped silently
could change the model's output without a word.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import numpy as np

from kvports.shared.config import ModelConfig, finite_number
from kvports.shared.errors import MAX_ECHO, UserError, echo

MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3")

# Fields that never change the forward pass of a causal LM at inference: identity,
# token ids, bookkeeping, training-only dropout, generation defaults (we are greedy).
# Besides these, every `*_token_id` and every key starting with `_` only names things.
IGNORED_COMMON = {
    "_name_or_path",
    "architectures",
    "model_type",
    "dtype",
    "torch_dtype",
    "transformers_version",
    "pad_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "initializer_range",
    "use_cache",
    "tokenizer_class",
    "id2label",
    "label2id",
    "num_labels",
    "problem_type",
    "task_specific_params",
    "prefix",
    "return_dict",
    "output_hidden_states",
    "output_attentions",
    "torchscript",
    "use_bfloat16",
    "tf_legacy_loss",
    "finetuning_task",
    "gradient_checkpointing",
    "chunk_size_feed_forward",
    "is_decoder",
    "is_encoder_decoder",
    "tie_encoder_decoder",
    "cross_attention_hidden_size",
    "max_length",
    "min_length",
    "do_sample",
    "early_stopping",
    "num_beams",
    "num_beam_groups",
    "diversity_penalty",
    "temperature",
    "top_k",
    "top_p",
    "typical_p",
    "repetition_penalty",
    "length_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "bad_words_ids",
    "num_return_sequences",
    "output_scores",
    "return_dict_in_generate",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "remove_invalid_values",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
    # Another runtime's settings (transformers.js: the dtype it keeps its KV cache in).
    "transformers.js_config",
}
IGNORED = {
    # Dropout is training-only; summary_* configure GPT2DoubleHeadsModel's extra head;
    # n_ctx is the pre-2020 duplicate of n_positions; reorder_and_upcast_attn only
    # changes the order of a float32 upcast used in mixed-precision training.
    "gpt2": {
        "attn_pdrop",
        "embd_pdrop",
        "resid_pdrop",
        "summary_type",
        "summary_use_proj",
        "summary_activation",
        "summary_proj_to_labels",
        "summary_first_dropout",
        "n_ctx",
        "reorder_and_upcast_attn",
        # OpenAI GPT's flag for its special-token head, which GPT-2 never reads.
        "predict_special_tokens",
    },
    # pretraining_tp only split matmuls into slices (same result) and is unused in transformers 5.
    # is_llama_config: SmolLM2's marker for its conversion tooling; it names, it does not configure.
    "llama": {"attention_dropout", "pretraining_tp", "is_llama_config"},
    "mistral": {"attention_dropout"},
    "qwen2": {"attention_dropout"},
    "qwen3": {"attention_dropout"},
    # cache_implementation: which cache class transformers' generate makes, not the model.
    "gemma3_text": {"attention_dropout", "cache_implementation"},
    # original_max_position_embeddings only matters to the longrope scaling kvports refuses;
    # auto_map names the remote code older transformers ran, the same model as the class that ships.
    "phi3": {"attention_dropout", "resid_pdrop", "embd_pdrop", "original_max_position_embeddings", "auto_map"},
}


def refuse(field: str, value: Any, why: str) -> UserError:
    try:
        shown = json.dumps(value)
    except (ValueError, RecursionError):  # an int past Python's 4300 digits, a list nested too deep
        shown = echo(value)
    if len(shown) > MAX_ECHO:  # the value as config.json spells it, cut short
        shown = f"{shown[: MAX_ECHO - 3]}... ({len(shown)} characters)"
    return UserError(f"config.json field {field}={shown}: {why}")


def finite_positive(value: Any) -> bool:
    return finite_number(value) and value > 0


class Fields:
    """config.json read field by field; whatever was not read at the end is refused."""

    def __init__(self, data: dict, model_type: str):
        self.data, self.model_type = data, model_type
        self.seen = set(IGNORED_COMMON) | IGNORED[model_type]

    def get(self, name: str, default: Any = None) -> Any:
        self.seen.add(name)
        value = self.data.get(name, default)
        return default if value is None else value

    def integer(self, name: str, default: Any = None) -> int:
        value = self.get(name, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise refuse(name, value, "must be an integer >= 1")
        return value

    def number(self, name: str, default: Any = None) -> float:
        value = self.get(name, default)
        if not finite_positive(value):  # JSON's 1e999 is inf
            raise refuse(name, value, "must be a finite number > 0")
        return float(value)

    def flag(self, name: str, default: bool) -> bool:
        value = self.get(name, default)
        if not isinstance(value, bool):
            raise refuse(name, value, "must be true or false")
        return value

    def require(self, name: str, allowed: tuple[Any, ...], why: str) -> Any:
        """A field we implement for one value (or a few) only."""
        self.seen.add(name)
        value = self.data.get(name, allowed[0])
        if value not in allowed:
            raise refuse(name, value, why)
        return value

    def refuse_unread(self) -> None:
        for name in sorted(self.data):
            if name not in self.seen and not name.startswith("_") and not name.endswith("_token_id"):
                raise refuse(
                    name,
                    self.data[name],
                    f"kvports does not model this {self.model_type} field; refusing rather than ignoring it",
                )


def gpt2_config(fields: Fields) -> ModelConfig:
    activations = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
    # GPT2Config's default is "gelu_new" (tanh); "gelu" is the exact erf form.
    activation = fields.require(
        "activation_function", ("gelu_new", "gelu", "gelu_pytorch_tanh"), f"supported: {', '.join(activations)}"
    )
    fields.require("scale_attn_weights", (True,), "kvports always scales attention by 1/sqrt(head_dim)")
    fields.require("scale_attn_by_inverse_layer_idx", (False,), "kvports does not scale attention by layer index")
    fields.require("add_cross_attention", (False,), "kvports is decoder-only, without cross-attention")
    fields.require("pruned_heads", ({},), "pruned heads are not supported")
    # OpenAI GPT's count of extra special embeddings; GPT-2's files say 0 when they say anything.
    fields.require("n_special", (0,), "GPT-2 has no extra special-token embeddings")
    n_embd = fields.integer("n_embd", 768)
    n_inner = fields.get("n_inner")
    return ModelConfig(
        vocab_size=fields.integer("vocab_size", 50257),
        d_model=n_embd,
        n_heads=fields.integer("n_head", 12),
        n_layers=fields.integer("n_layer", 12),
        max_seq_len=fields.integer("n_positions", 1024),
        activation=activations[activation],
        ffn_hidden=None if n_inner is None else fields.integer("n_inner"),
        norm="layernorm",
        norm_eps=fields.number("layer_norm_epsilon", 1e-5),
        positions="learned",
        tie_embeddings=fields.flag("tie_word_embeddings", True),
        attn_bias=True,
        ffn_bias=True,
    )


def rope_fields(fields: Fields, params: Any, where: str) -> dict[str, Any]:
    """One RoPE parameter set as ModelConfig fields: plain RoPE over the full head dim, or scaled
    ("linear"; "llama3", Llama 3.x's). transformers 5 writes `rope_parameters: {rope_theta,
    rope_type, ...}`; 4.x wrote top-level `rope_theta` and `rope_scaling`. `where` names the field."""
    if not isinstance(params, dict):
        raise refuse(where, params, "must be an object")
    kind = str(params.get("rope_type", params.get("type", "default")))
    keys = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    keys |= {"linear": {"factor"}, "llama3": set(LLAMA3_ROPE)}.get(kind, set())
    if kind not in ("default", "linear", "llama3"):
        raise refuse(f"{where}.rope_type", kind, "kvports implements RoPE types default, linear and llama3")
    for key, value in params.items():
        if key not in keys:
            raise refuse(f"{where}.{key}", value, f"kvports does not model this for rope_type {kind!r}")
    factor = params.get("partial_rotary_factor", 1.0)
    if factor != 1 and factor != 1.0:
        raise refuse(f"{where}.partial_rotary_factor", factor, "kvports rotates the full head dim (1.0)")
    out: dict[str, Any] = {"rope_scaling": "none" if kind == "default" else kind}
    names = {"linear": {"factor": "rope_factor"}, "llama3": LLAMA3_ROPE}.get(kind, {})
    for key, ours in {"rope_theta": "rope_theta", **names}.items():
        if key not in params:
            if key != "rope_theta":  # rope_theta may stand at the top level instead
                raise refuse(f"{where}.{key}", None, f"rope_type {kind!r} needs it")
            continue
        value = params[key]
        if not finite_positive(value) or (ours == "rope_original_len" and not isinstance(value, int)):
            raise refuse(f"{where}.{key}" if key != "rope_theta" else key, value, "must be a finite number > 0")
        out[ours] = value if ours == "rope_original_len" else float(value)
    return out


# Llama 3's RoPE scaling parameters and the ModelConfig fields they set.
LLAMA3_ROPE = {
    "factor": "rope_factor",
    "low_freq_factor": "rope_low_freq_factor",
    "high_freq_factor": "rope_high_freq_factor",
    "original_max_position_embeddings": "rope_original_len",
}


def rope_config(fields: Fields) -> dict[str, Any]:
    """The RoPE fields of ModelConfig: from `rope_parameters` (transformers 5; Gemma 3's has one set
    per layer type) or `rope_theta` and `rope_scaling` (4.x; Gemma 3's `rope_local_base_freq`)."""
    params = fields.get("rope_parameters", {})
    gemma = fields.model_type == "gemma3_text"
    theta = fields.get("rope_theta", 1000000.0 if gemma else 10000.0)
    local = fields.get("rope_local_base_freq", 10000.0) if gemma else None
    if gemma and isinstance(params, dict) and set(params) <= {"full_attention", "sliding_attention"} and params:
        local_params = params.get("sliding_attention", {})
        if isinstance(local_params, dict) and local_params.get("rope_type", "default") != "default":
            raise refuse("rope_parameters.sliding_attention.rope_type", local_params["rope_type"], "must be default")
        local = rope_fields(fields, local_params, "rope_parameters.sliding_attention").get("rope_theta", local)
        params = params.get("full_attention", {})
    scaling = fields.get("rope_scaling")
    if scaling is not None and params:
        raise refuse("rope_scaling", scaling, "given beside rope_parameters; kvports will not choose between them")
    where = "rope_scaling" if scaling else "rope_parameters"
    out = {"rope_theta": theta, **rope_fields(fields, scaling or params, where)}
    if not finite_positive(out["rope_theta"]):
        raise refuse("rope_theta", out["rope_theta"], "must be a finite number > 0")
    factor = fields.get("partial_rotary_factor", 1.0)
    if factor != 1 and factor != 1.0:
        raise refuse("partial_rotary_factor", factor, "kvports rotates the full head dim (1.0)")
    if local is not None:
        if not finite_positive(local):
            raise refuse("rope_local_base_freq", local, "must be a finite number > 0")
        out["rope_local_theta"] = float(local)
    return {**out, "rope_theta": float(out["rope_theta"])}


def layer_windows(fields: Fields, layers: int) -> tuple[int | None, tuple[int, ...]]:
    """The sliding window and the layers that attend to every key despite it, from `sliding_window`,
    `layer_types` (or Gemma 3's `sliding_window_pattern`) and Qwen's `use_sliding_window`."""
    model_type = fields.model_type
    window = fields.get("sliding_window")
    if model_type in ("qwen2", "qwen3"):
        fields.require("use_sliding_window", (False,), "kvports runs Qwen with full attention in every layer")
        fields.get("max_window_layers")  # which layers a window would apply to: none, without one
        window = None
    elif model_type in ("llama",):
        if window is not None:
            raise refuse("sliding_window", window, "transformers' Llama has no sliding window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise refuse(
            "sliding_window", window, "must be null or an integer >= 1 (the keys a query sees, itself included)"
        )
    kinds = ("full_attention", "sliding_attention")
    types = fields.get("layer_types")
    if model_type == "gemma3_text" and types is None:
        pattern = fields.integer("sliding_window_pattern", 6)
        types = [kinds[bool((i + 1) % pattern)] for i in range(layers)]
    if types is None:
        return window, ()
    if not isinstance(types, list) or len(types) != layers or any(kind not in kinds for kind in types):
        raise refuse("layer_types", types, f"must list {layers} layers, each of {', '.join(kinds)}")
    if model_type != "gemma3_text":
        if len(set(types)) > 1:
            raise refuse("layer_types", types, "kvports runs one attention type in every layer of this model type")
        return window, ()
    if window is None or "sliding_attention" not in types:
        return None, ()
    return window, tuple(i for i, kind in enumerate(types) if kind == "full_attention")


def llama_config(fields: Fields) -> ModelConfig:
    """Llama and the families built on it: Mistral (a window), Qwen2 (q, k, v biases), Qwen3
    (qk-norm, its own head size), Gemma 3 (scaled embeddings, (1 + w) norms after attention and
    the MLP too, a GELU-gated MLP, windowed and global layers) and Phi-3 (fused tensors only)."""
    model_type = fields.model_type
    mistral, gemma = model_type == "mistral", model_type == "gemma3_text"
    if gemma:
        fields.require("hidden_activation", ("gelu_pytorch_tanh",), "Gemma 3's MLP is GELU(tanh)-gated")
        fields.require("hidden_act", (None,), "Gemma 3 names its activation hidden_activation")
        for name in ("final_logit_softcapping", "attn_logit_softcapping"):
            fields.require(name, (None,), "kvports does not cap logits (Gemma 3 has no softcapping)")
        fields.require("use_bidirectional_attention", (False,), "kvports is causal")
    else:
        fields.require("hidden_act", ("silu", "swish"), "kvports' SwiGLU uses silu")
    if model_type == "qwen2":
        fields.require("use_mrope", (False,), "kvports implements one-dimensional RoPE")
    # SmolLM2 writes rope_interleaved=false: rotating the two halves, as transformers and kvports do.
    fields.require(
        "rope_interleaved", (False,), "kvports' RoPE rotates the two halves of each head, not adjacent pairs"
    )
    hidden = fields.integer("hidden_size", 4096)
    heads = fields.integer("num_attention_heads", 32)
    # Absent fields take transformers' defaults for the class: the model it would build.
    kv_heads = fields.integer("num_key_value_heads", 8 if mistral else 4 if gemma else heads)
    head_dim = fields.get("head_dim")
    if head_dim is None and hidden % heads:
        raise refuse("hidden_size", hidden, f"is not divisible by num_attention_heads={heads}")
    if head_dim is not None:
        head_dim = fields.integer("head_dim")
    if heads % kv_heads:
        raise refuse("num_key_value_heads", kv_heads, f"must divide num_attention_heads={heads}")
    layers = fields.integer("num_hidden_layers", 32)
    window, global_layers = layer_windows(fields, layers)
    attn_bias = ffn_bias = qkv_bias = False
    if mistral or model_type == "phi3":
        # transformers' Mistral and Phi-3 have no biases: a flag saying otherwise does not mean what it says.
        for name in ("attention_bias", "mlp_bias"):
            fields.require(name, (False,), f"transformers' {model_type} has no biases; kvports will not guess")
    elif model_type == "qwen2":
        qkv_bias = True  # always, on q, k and v; never on the output projection
    elif model_type == "llama":
        # Llama's attention_bias puts a bias on q, k, v and o alike: our qkv and proj
        # biases. mlp_bias puts one on gate, up and down: our ffn.0 and ffn.2.
        attn_bias, ffn_bias = fields.flag("attention_bias", False), fields.flag("mlp_bias", False)
    else:  # Qwen3, Gemma 3: attention_bias on q, k, v and o
        attn_bias = fields.flag("attention_bias", False)
    # head_dim = hidden / heads is the default, as Llama's files spell it out: only another is a switch.
    size = head_dim if head_dim is not None and head_dim * heads != hidden else None
    if gemma:
        # transformers rounds sqrt(hidden) to float32 (a tensor), then to the model's dtype.
        gemma_fields: dict[str, Any] = dict(
            embed_scale=float(np.float32(math.sqrt(hidden))),
            attn_scale=fields.number("query_pre_attn_scalar", 256) ** -0.5,
            post_norms=True,
        )
    else:
        gemma_fields = {}
    defaults = {"mistral": (32000, 4096 * 32, 14336), "gemma3_text": (262208, 131072, 9216)}
    vocab, positions, inner = defaults.get(model_type, (32000, 2048, 11008))
    return ModelConfig(
        vocab_size=fields.integer("vocab_size", vocab),
        d_model=hidden,
        n_heads=heads,
        n_layers=layers,
        max_seq_len=fields.integer("max_position_embeddings", positions),
        n_kv_heads=kv_heads,
        activation="geglu_tanh" if gemma else "swiglu",
        ffn_hidden=fields.integer("intermediate_size", inner),
        norm="rmsnorm",
        norm_eps=fields.number("rms_norm_eps", 1e-6),
        positions="rope",
        tie_embeddings=fields.flag("tie_word_embeddings", gemma),
        attn_bias=attn_bias,
        ffn_bias=ffn_bias,
        qkv_bias=qkv_bias,
        qk_norm=model_type in ("qwen3", "gemma3_text"),
        head_size=size,
        sliding_window=window,
        global_layers=global_layers,
        **rope_config(fields),
        **gemma_fields,
    )


def eos_token_ids(fields: Fields) -> tuple[int, ...]:
    """eos_token_id: one id, a list of them (Llama 3), or null."""
    value = fields.get("eos_token_id")
    ids = [] if value is None else value if isinstance(value, list) else [value]
    for token in ids:
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise refuse("eos_token_id", value, "must be null, a token id or a list of token ids")
    return tuple(ids)


def bos_token_id(fields: Fields) -> int | None:
    """bos_token_id: one id or null. Generation never uses it; it is kept for the way back."""
    value = fields.get("bos_token_id")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise refuse("bos_token_id", value, "must be null or a token id")
    return value


def config_from_hf(data: dict) -> ModelConfig:
    model_type = data.get("model_type")
    if model_type not in MODEL_TYPES:
        raise refuse("model_type", model_type, f"supported: {', '.join(MODEL_TYPES)}")
    fields = Fields(data, model_type)
    config = gpt2_config(fields) if model_type == "gpt2" else llama_config(fields)
    config = dataclasses.replace(config, eos_token_ids=eos_token_ids(fields), bos_token_id=bos_token_id(fields))
    fields.refuse_unread()
    return config.validate()


# --- export: what GPT-2 can express, and its config.json ------------------------------


def gpt2_refusal(config: ModelConfig) -> str | None:
    """Why GPT-2 cannot express this model, or None if it can."""
    if config.positions != "learned":
        return f"positions={config.positions!r}: GPT-2 has learned positions"
    if config.norm != "layernorm":
        return f"norm={config.norm!r}: GPT-2 has LayerNorm"
    if config.activation not in ("gelu", "gelu_tanh"):
        return f"activation={config.activation!r}: GPT-2's MLP is not gated (gelu or gelu_tanh only)"
    if config.kv_heads != config.n_heads:
        return f"n_kv_heads={config.n_kv_heads}: GPT-2 has one k/v head per query head (n_heads={config.n_heads})"
    if config.sliding_window is not None:
        return f"sliding_window={config.sliding_window}: GPT-2 attends to every earlier token"
    return None


def gpt2_hf_config(config: ModelConfig, dtype: str) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.max_seq_len,
        "n_embd": config.d_model,
        "n_layer": config.n_layers,
        "n_head": config.n_heads,
        "n_inner": config.ffn_hidden,  # null: 4 * n_embd, as ours
        "activation_function": "gelu" if config.activation == "gelu" else "gelu_new",
        "layer_norm_epsilon": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "add_cross_attention": False,
        "attn_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "resid_pdrop": config.dropout,
        "use_cache": True,
        "dtype": dtype,
        # GPT2Config's default 50256 would point outside a small vocab: only the ids we know.
        **token_ids(config),
    }


def token_ids(config: ModelConfig) -> dict:
    """bos/eos as config.json writes them; a pad id never (our files have none)."""
    eos: int | list[int] | None = list(config.eos_token_ids) if len(config.eos_token_ids) > 1 else None
    if len(config.eos_token_ids) == 1:
        eos = config.eos_token_ids[0]
    return {"bos_token_id": config.bos_token_id, "eos_token_id": eos, "pad_token_id": None}


def llama_refusal(config: ModelConfig) -> str | None:
    """Why transformers' Llama (or, with a window, Mistral) cannot express this model, or None."""
    if config.positions != "rope" or config.norm != "rmsnorm" or config.activation != "swiglu":
        return "Llama and Mistral have RoPE, RMSNorm and SwiGLU"
    if config.sliding_window is not None and (config.attn_bias or config.ffn_bias):
        return "transformers' Mistral has no biases"
    if config.family not in ("llama", "llama3", "mistral"):
        return f"a {config.family} model: kvports writes Llama and Mistral directories only"
    if config.rope_scaling != "none" and config.sliding_window is not None:
        return f"rope_scaling={config.rope_scaling!r}: kvports writes scaled RoPE for Llama only"
    return None


def rope_parameters(config: ModelConfig) -> dict:
    """rope_parameters as transformers 5 writes them: rope_fields, inverted."""
    params: dict[str, Any] = {"rope_type": "default" if config.rope_scaling == "none" else config.rope_scaling}
    params["rope_theta"] = config.rope_theta
    names = {"linear": {"factor": "rope_factor"}, "llama3": LLAMA3_ROPE}.get(config.rope_scaling, {})
    return params | {key: getattr(config, ours) for key, ours in names.items()}


def llama_hf_config(config: ModelConfig, dtype: str) -> dict:
    """config.json for LlamaForCausalLM, or MistralForCausalLM when the model has a sliding window."""
    mistral = config.sliding_window is not None
    fields = {
        "architectures": ["MistralForCausalLM" if mistral else "LlamaForCausalLM"],
        "model_type": "mistral" if mistral else "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.ffn_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_parameters": rope_parameters(config),
        "tie_word_embeddings": config.tie_embeddings,
        "attention_dropout": config.dropout,
        "use_cache": True,
        "dtype": dtype,
        **token_ids(config),
    }
    if mistral:
        fields["sliding_window"] = config.sliding_window
    else:
        fields["attention_bias"] = config.attn_bias
        fields["mlp_bias"] = config.ffn_bias
    return fields
