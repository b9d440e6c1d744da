"""Our weights -> a Hugging Face directory transformers can load (config.json, model.safetensors):
gpt2-type for a model GPT-2 can express, llama-type (mistral-type with a window) for RoPE models."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from kvports.formats.hf.hf_config import gpt2_hf_config, gpt2_refusal, llama_hf_config, llama_refusal
from kvports.formats.hf.tensors import gpt2_hf_tensors, llama_hf_tensors
from kvports.shared.config import ModelConfig
from kvports.shared.errors import UserError
from kvports.shared.files import write_folder_atomic


def hf_refusal(config: ModelConfig) -> str | None:
    """Why no Hugging Face class we write can express this model, or None."""
    return gpt2_refusal(config) if config.positions == "learned" else llama_refusal(config)


def export_hf(config: ModelConfig, tensors: dict[str, np.ndarray], directory: os.PathLike) -> str:
    """Write config.json and model.safetensors for GPT2LMHeadModel or LlamaForCausalLM (MistralForCausalLM
    with a window), as one new directory that replaces `directory` whole: never new weights beside an
    old config. Returns the model type written."""
    from safetensors.numpy import save

    why = hf_refusal(config)
    if why is not None:
        raise UserError(f"cannot write a Hugging Face model: {why}")
    dtype = str(next(iter(tensors.values())).dtype)
    gpt2 = config.positions == "learned"
    fields = gpt2_hf_config(config, dtype) if gpt2 else llama_hf_config(config, dtype)
    hf_tensors = gpt2_hf_tensors(config, tensors) if gpt2 else llama_hf_tensors(config, tensors)
    # "format": "pt" is what transformers checks before it loads a safetensors file.
    payload = save(hf_tensors, metadata={"format": "pt"})
    hf_config = json.dumps(fields, indent=2, sort_keys=True, allow_nan=False) + "\n"
    write_folder_atomic(Path(directory), {"model.safetensors": payload, "config.json": hf_config.encode()})
    return str(fields["model_type"])


def export_gpt2(config: ModelConfig, tensors: dict[str, np.ndarray], directory: os.PathLike) -> None:
    """A gpt2-type directory, or a refusal saying why GPT-2 cannot express the model."""
    why = gpt2_refusal(config)
    if why is not None:
        raise UserError(f"cannot write a gpt2 model: {why}")
    export_hf(config, tensors, directory)
