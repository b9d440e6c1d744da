"""Our weights -> a gpt2-type directory transformers can load (config.json, model.safetensors)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from kvports.shared.config import ModelConfig
from kvports.shared.errors import UserError
from kvports.shared.files import write_folder_atomic
from kvports.shared.hf.config import gpt2_hf_config, gpt2_refusal
from kvports.shared.hf.tensors import gpt2_hf_tensors


def export_gpt2(config: ModelConfig, tensors: dict[str, np.ndarray], directory: os.PathLike) -> None:
    """Write config.json and model.safetensors for transformers' GPT2LMHeadModel, as one new
    directory that replaces `directory` whole: never new weights beside an old config."""
    from safetensors.numpy import save

    why = gpt2_refusal(config)
    if why is not None:
        raise UserError(f"cannot write a gpt2 model: {why}")
    dtype = str(next(iter(tensors.values())).dtype)
    # "format": "pt" is what transformers checks before it loads a safetensors file.
    payload = save(gpt2_hf_tensors(config, tensors), metadata={"format": "pt"})
    hf_config = json.dumps(gpt2_hf_config(config, dtype), indent=2, sort_keys=True, allow_nan=False) + "\n"
    write_folder_atomic(Path(directory), {"model.safetensors": payload, "config.json": hf_config.encode()})
