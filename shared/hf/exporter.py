"""Our weights -> a gpt2-type directory transformers can load (config.json, model.safetensors)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from kvports.shared.config import ModelConfig
from kvports.shared.errors import UserError
from kvports.shared.files import write_atomic
from kvports.shared.hf.config import gpt2_hf_config, gpt2_refusal
from kvports.shared.hf.tensors import gpt2_hf_tensors


def export_gpt2(config: ModelConfig, tensors: dict[str, np.ndarray], directory: os.PathLike) -> None:
    """Write config.json and model.safetensors for transformers' GPT2LMHeadModel."""
    from safetensors.numpy import save

    why = gpt2_refusal(config)
    if why is not None:
        raise UserError(f"cannot write a gpt2 model: {why}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = str(next(iter(tensors.values())).dtype)
    # "format": "pt" is what transformers checks before it loads a safetensors file.
    payload = save(gpt2_hf_tensors(config, tensors), metadata={"format": "pt"})
    # Weights first, config last: a directory with a config.json is a complete one.
    write_atomic(directory / "model.safetensors", payload)
    write_atomic(
        directory / "config.json", (json.dumps(gpt2_hf_config(config, dtype), indent=2, sort_keys=True) + "\n").encode()
    )
