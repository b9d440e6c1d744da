"""The model and the prompts the bench times: the seed's model, GPT-2 small as published
(random weights: timing needs the sizes, not the training), or a weights file."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np

from kvports.shared.checks import SEED_PROMPT, check_prompts
from kvports.shared.config import ModelConfig
from kvports.shared.weights import DEFAULT_WEIGHTS, gpt2_init_weights, open_weights

PRESETS: dict[str, ModelConfig | None] = {
    "seed": None,  # the seed's model, shipped as the default weights file
    # GPT-2 small as published (124M parameters: tanh GELU, the head tied to the embedding), random weights.
    "gpt2-small": ModelConfig(
        vocab_size=50257,
        d_model=768,
        n_heads=12,
        n_layers=12,
        max_seq_len=1024,
        activation="gelu_tanh",
        tie_embeddings=True,
    ),
}


def load_bench_model(
    args: argparse.Namespace, check: Callable[[ModelConfig], None]
) -> tuple[str, ModelConfig, dict[str, np.ndarray]]:
    """(the name the results go by, config, tensors at --dtype) for --weights or --preset;
    check(config) runs before any tensor is read or drawn."""
    if getattr(args, "model", None) is not None:  # --model NAME: the fetched file, as --weights
        from kvports.shared.fetch import weights_source

        args.weights = weights_source(args.weights, args.model, DEFAULT_WEIGHTS)
    preset = PRESETS[args.preset]
    if args.weights is not None or preset is None:
        with open_weights(args.weights if args.weights is not None else DEFAULT_WEIGHTS) as weights:
            check(weights.config)
            name = args.weights.name if args.weights is not None else args.preset
            return name, weights.config, weights.read(args.dtype)
    check(preset)
    tensors = {name: array.astype(args.dtype, copy=False) for name, array in gpt2_init_weights(preset).items()}
    return args.preset, preset, tensors


def bench_prompts(config: ModelConfig, batch: int, prompt_len: int, new_tokens: int) -> np.ndarray:
    # The seed's prompt, repeated to length; ids past a small vocab wrap into it.
    row = [int(token) % config.vocab_size for token in np.resize(np.asarray(SEED_PROMPT), prompt_len)]
    return check_prompts([row] * batch, config, new_tokens)  # [B, P]
