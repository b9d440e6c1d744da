"""A local Hugging Face directory -> our config and tensors. Nothing is fetched."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from kvports.formats.hf.checkpoint import Checkpoint, read_hf_config
from kvports.formats.hf.hf_config import config_from_hf
from kvports.formats.hf.tensors import HFTensors, Step, gpt2_plan, llama_plan
from kvports.formats.weights import check_tensors
from kvports.limits import check_bytes
from kvports.shared.config import ModelConfig
from kvports.shared.errors import echo_path
from kvports.shared.shapes import parameter_count


def import_hf(directory: os.PathLike, dtype: str | None = None) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """A local Hugging Face directory -> (config, tensors in our names, at `dtype`, None: the
    checkpoint's own). Names and shapes are checked from the headers, and the bytes against
    the limit, before any tensor is read."""
    directory = Path(directory)
    data = read_hf_config(directory)
    config = config_from_hf(data)
    gpt2 = config.positions == "learned"
    model_type = str(data["model_type"])

    def plan(config: ModelConfig) -> Iterator[Step]:
        return gpt2_plan(config) if gpt2 else llama_plan(config, model_type)

    with Checkpoint(directory) as checkpoint:
        hf = HFTensors(checkpoint.shapes(), "transformer." if gpt2 else "model.")
        hf.check(plan(config))
        target = checkpoint.target_dtype(dtype)
        config.validate_at(target)
        size = parameter_count(config) * np.dtype(target).itemsize
        # The tensors, and the weights file's bytes made from them before it is written.
        check_bytes({"tensors": size, "file": size}, f"converting {echo_path(directory)} to {target}")
        ours = hf.build(plan(config), lambda name: checkpoint.read(name, target), config)
    check_tensors(ours, config, source=str(directory))
    return config, ours
