"""RoPE's frequencies, computed once for every port: a port's model reads the table for a layer
(`rope_frequencies(config, window)`) and only multiplies positions by it. Plain RoPE, Llama 3's
frequency scaling and linear scaling differ here alone, so the model files do not."""

from __future__ import annotations

import math

import numpy as np

from kvports.shared.config import ModelConfig


def rope_frequencies(config: ModelConfig, window: int | None = None) -> np.ndarray:
    """[Dh/2] float64: the angle per position of each pair of dims (i, i + Dh/2), for a layer that
    attends through `window` (Gemma 3's windowed layers have their own base, unscaled)."""
    Dh = config.head_dim
    local = window is not None and config.rope_local_theta is not None
    theta = config.rope_local_theta if local and config.rope_local_theta is not None else config.rope_theta
    inv_freq = 1.0 / (theta ** (np.arange(0, Dh, 2, dtype=np.float64) / Dh))  # [Dh/2]
    if config.rope_freq_factors and not local:  # a GGUF file's divisors, as llama.cpp applies them
        inv_freq = inv_freq / np.asarray(config.rope_freq_factors, dtype=np.float64)  # [Dh/2]
    if local or config.rope_scaling == "none":
        return inv_freq
    if config.rope_scaling == "linear":
        return inv_freq / config.rope_factor  # [Dh/2]: positions stretched by the factor
    # llama3, as transformers' _compute_llama3_parameters: long wavelengths divided by the factor,
    # short ones kept, those between blended smoothly.
    factor, low, high = config.rope_factor, config.rope_low_freq_factor, config.rope_high_freq_factor
    wavelength = 2 * math.pi / inv_freq  # [Dh/2]
    scaled = np.where(wavelength > config.rope_original_len / low, inv_freq / factor, inv_freq)  # [Dh/2]
    smooth = (config.rope_original_len / wavelength - low) / (high - low)  # [Dh/2]
    blended = (1 - smooth) * scaled / factor + smooth * scaled  # [Dh/2]
    medium = (wavelength >= config.rope_original_len / high) & (wavelength <= config.rope_original_len / low)
    return np.where(medium, blended, scaled)  # [Dh/2]
