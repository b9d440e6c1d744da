"""config.json <-> ModelConfig, for model types gpt2, llama and mistral.

Every config field is either mapped, checked against the one value we implement, or
on a list of fields that cannot change the forward pass (ids, bookkeeping, training
dropout). Anything else is refused, naming the field: a field we skipped silently
could change the model's output without a word.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from kvports.shared.config import ModelConfig, finite_number
from kvports.shared.errors import MAX_ECHO, UserError, echo

MODEL_TYPES = ("gpt2", "llama", "mistral")

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


def rope_theta(fields: Fields) -> float:
    """transformers 5 writes `rope_parameters: {rope_theta, rope_type}`; 4.x wrote top-level
    `rope_theta` and `rope_scaling`. Only plain RoPE (type "default", full head dim) is ours."""
    scaling = fields.get("rope_scaling")
    if scaling is not None:
        raise refuse("rope_scaling", scaling, "kvports implements plain RoPE only (no scaling)")
    theta = fields.get("rope_theta", 10000.0)
    params = fields.get("rope_parameters", {})
    if not isinstance(params, dict):
        raise refuse("rope_parameters", params, "must be an object")
    for key, value in params.items():
        if key in ("rope_type", "type"):
            if value != "default":
                raise refuse(f"rope_parameters.{key}", value, "kvports implements plain RoPE only (type 'default')")
        elif key == "partial_rotary_factor":
            if value != 1 and value != 1.0:
                raise refuse("rope_parameters.partial_rotary_factor", value, "kvports rotates the full head dim (1.0)")
        elif key != "rope_theta":
            raise refuse(f"rope_parameters.{key}", value, "kvports implements plain RoPE only")
    theta = params.get("rope_theta", theta)
    if not finite_positive(theta):
        raise refuse("rope_theta", theta, "must be a finite number > 0")
    factor = fields.get("partial_rotary_factor", 1.0)
    if factor != 1 and factor != 1.0:
        raise refuse("partial_rotary_factor", factor, "kvports rotates the full head dim (1.0)")
    return float(theta)


def llama_config(fields: Fields) -> ModelConfig:
    mistral = fields.model_type == "mistral"
    fields.require("hidden_act", ("silu", "swish"), "kvports' SwiGLU uses silu")
    # SmolLM2 writes rope_interleaved=false: rotating the two halves, as transformers and kvports do.
    fields.require(
        "rope_interleaved", (False,), "kvports' RoPE rotates the two halves of each head, not adjacent pairs"
    )
    hidden = fields.integer("hidden_size", 4096)
    heads = fields.integer("num_attention_heads", 32)
    # Absent fields take transformers' defaults for the class: the model it would build.
    kv_heads = fields.integer("num_key_value_heads", 8 if mistral else heads)
    if hidden % heads:
        raise refuse("hidden_size", hidden, f"is not divisible by num_attention_heads={heads}")
    head_dim = fields.get("head_dim")
    if head_dim is not None and head_dim != hidden // heads:
        raise refuse(
            "head_dim", head_dim, f"kvports needs head_dim = hidden_size / num_attention_heads = {hidden // heads}"
        )
    if heads % kv_heads:
        raise refuse("num_key_value_heads", kv_heads, f"must divide num_attention_heads={heads}")
    layer_types = fields.get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list) or len(set(map(str, layer_types))) > 1):
        raise refuse("layer_types", layer_types, "kvports runs one attention type in every layer")
    if mistral:
        # transformers' Mistral has no biases: a flag saying otherwise does not mean what it says.
        for name in ("attention_bias", "mlp_bias"):
            fields.require(name, (False,), "transformers' Mistral has no biases; kvports will not guess")
        window = fields.get("sliding_window")
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise refuse(
                "sliding_window", window, "must be null or an integer >= 1 (the keys a query sees, itself included)"
            )
        attn_bias = ffn_bias = False
    else:
        # Llama's attention_bias puts a bias on q, k, v and o alike: our qkv and proj
        # biases. mlp_bias puts one on gate, up and down: our ffn.0 and ffn.2.
        attn_bias, ffn_bias, window = fields.flag("attention_bias", False), fields.flag("mlp_bias", False), None
    return ModelConfig(
        vocab_size=fields.integer("vocab_size", 32000),
        d_model=hidden,
        n_heads=heads,
        n_layers=fields.integer("num_hidden_layers", 32),
        max_seq_len=fields.integer("max_position_embeddings", 4096 * 32 if mistral else 2048),
        n_kv_heads=kv_heads,
        activation="swiglu",
        ffn_hidden=fields.integer("intermediate_size", 14336 if mistral else 11008),
        norm="rmsnorm",
        norm_eps=fields.number("rms_norm_eps", 1e-6),
        positions="rope",
        rope_theta=rope_theta(fields),
        tie_embeddings=fields.flag("tie_word_embeddings", False),
        attn_bias=attn_bias,
        ffn_bias=ffn_bias,
        sliding_window=window,
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
    return None


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
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
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
