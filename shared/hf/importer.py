"""A local Hugging Face directory -> our config and tensors. Nothing is fetched."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from kvports.shared.config import ModelConfig
from kvports.shared.hf.checkpoint import load_hf_tensors, read_hf_config
from kvports.shared.hf.config import config_from_hf
from kvports.shared.hf.tensors import HFTensors, gpt2_tensors, llama_tensors
from kvports.shared.weights import check_tensors, expected_shapes


def import_hf(directory: os.PathLike, dtype: str | None = None) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """A local Hugging Face directory -> (config, tensors in our names). Nothing is fetched."""
    directory = Path(directory)
    config = config_from_hf(read_hf_config(directory))
    tensors, dtype = load_hf_tensors(directory, dtype)
    gpt2 = config.positions == "learned"
    hf = HFTensors(tensors, "transformer." if gpt2 else "model.")
    ours = gpt2_tensors(hf, config) if gpt2 else llama_tensors(hf, config)
    hf.refuse_leftovers()
    ours = {name: np.ascontiguousarray(ours[name], dtype=dtype) for name in expected_shapes(config)}
    check_tensors(ours, config, source=str(directory))
    return config, ours
