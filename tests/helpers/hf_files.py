"""Hugging Face directories written by hand (no transformers): a small Llama's (or Mistral's)
config.json, as transformers 5 writes it, and its tensors in transformers' names."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

D, H, F, V, L = 16, 4, 24, 40, 2  # a small Llama: width, heads, FFN width, vocabulary, layers


def llama_config(**changes) -> dict:
    """A config.json as transformers 5.24 writes it for LlamaForCausalLM (GQA 4q/2kv)."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "dtype": "float32",
        "eos_token_id": 2,
        "head_dim": D // H,
        "hidden_act": "silu",
        "hidden_size": D,
        "initializer_range": 0.02,
        "intermediate_size": F,
        "max_position_embeddings": 32,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": H,
        "num_hidden_layers": L,
        "num_key_value_heads": 2,
        "pad_token_id": None,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": False,
        "transformers_version": "5.24.0",
        "use_cache": True,
        "vocab_size": V,
    }
    config.update(changes)
    return config


def mistral_config(**changes) -> dict:
    config = llama_config(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=4)
    for name in ("attention_bias", "mlp_bias", "pretraining_tp"):
        del config[name]  # transformers' Mistral has no such fields
    config.update(changes)
    return config


def llama_tensors(config: dict, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    Dh = D // H
    kv = config["num_key_value_heads"] * Dh
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
    for i in range(L):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (D,),
                p + "post_attention_layernorm.weight": (D,),
                p + "self_attn.q_proj.weight": (D, D),
                p + "self_attn.k_proj.weight": (kv, D),
                p + "self_attn.v_proj.weight": (kv, D),
                p + "self_attn.o_proj.weight": (D, D),
                p + "mlp.gate_proj.weight": (F, D),
                p + "mlp.up_proj.weight": (F, D),
                p + "mlp.down_proj.weight": (D, F),
            }
        )
    if config.get("tie_word_embeddings"):
        del shapes["lm_head.weight"]
    return {name: rng.normal(size=shape).astype(np.float32) for name, shape in shapes.items()}


def write_hf_dir(directory: Path, config: dict, tensors: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def hf_dir(tmp_path: Path, **config_changes) -> Path:
    """The small Llama above in its own directory, its config.json changed."""
    return write_hf_dir(tmp_path / "llama", llama_config(**config_changes), llama_tensors(llama_config()))
