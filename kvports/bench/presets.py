"""The model and the prompts the bench times: the seed's model, GPT-2 small as published
(random weights: timing needs the sizes, not the training), or a weights file."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from kvports.formats.weights import DEFAULT_WEIGHTS, cast_checked, gpt2_init_weights, open_weights
from kvports.run import check_prompts
from kvports.shared.config import ModelConfig, host_dtype
from kvports.shared.errors import UserError
from kvports.shared.generation import GenerationConfig, pad_prompts
from kvports.shared.quantization import float_tensors
from kvports.validation import SEED_PROMPT, check_q4_file

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
    preset: str,
    weights: Path | None,
    dtype: str,
    check: Callable[[ModelConfig], None],
    quant: str = "none",
    cast_to: Sequence[str] = (),
) -> tuple[str, ModelConfig, dict[str, np.ndarray]]:
    """(the name the results go by, config, tensors at `dtype`) for a weights file or a preset;
    check(config) runs before any tensor is read or drawn. quant "q4": a GGUF file's 4-bit blocks too.
    cast_to: the other dtypes the rows will cast these tensors to, each checked here (a float64 value
    beyond float32's range is refused now, not when its row loads)."""
    config = PRESETS[preset]
    if weights is not None or config is None:
        with open_weights(weights if weights is not None else DEFAULT_WEIGHTS) as file:
            check(file.config)
            check_q4_file(quant, file.has_q4(), file.source)
            name = weights.name if weights is not None else preset
            tensors = file.read(dtype, quant)
            check_casts(file.config, tensors, dtype, cast_to, file.source)
            return name, file.config, tensors
    check(config)
    if quant == "q4":
        raise UserError(f"--quant q4 needs a GGUF file with Q4_0 or Q4_1 matrices; preset {preset} has none")
    tensors = {name: array.astype(host_dtype(dtype), copy=False) for name, array in gpt2_init_weights(config).items()}
    return preset, config, tensors


def check_casts(
    config: ModelConfig, tensors: dict[str, np.ndarray], dtype: str, cast_to: Sequence[str], source: str
) -> None:
    """Every float tensor, read at `dtype`, stays finite at each of `cast_to`; nothing is kept."""
    for other in dict.fromkeys(host_dtype(name) for name in cast_to if host_dtype(name) != host_dtype(dtype)):
        config.validate_at(other)
        for name, array in float_tensors(tensors).items():
            cast_checked(name, array, other, source)


def chat_turn_ids(weights: Path | None, text: str) -> list[int]:
    """--chat TEXT: one user turn in the GGUF file's own template, as its own tokenizer encodes it."""
    from kvports.formats.chat import chat_ids
    from kvports.formats.gguf.tokenizer import gguf_tokenizer
    from kvports.shared.errors import UserError

    if weights is None:
        raise UserError("--chat renders a GGUF file's own chat template: give --model NAME or --weights FILE.gguf")
    return chat_ids(weights, [{"role": "user", "content": text}], gguf_tokenizer(weights))


def bench_prompts(
    config: ModelConfig, batch: int, prompt_len: int, new_tokens: int, chat: list[int] | None = None
) -> np.ndarray:
    # The chat prompt's ids, else the seed's prompt repeated to length (ids past a small vocab wrap into it).
    row = (
        chat
        if chat is not None
        else [int(t) % config.vocab_size for t in np.resize(np.asarray(SEED_PROMPT), prompt_len)]
    )
    return pad_prompts(check_prompts([row] * batch, config, GenerationConfig(new_tokens)))[0]  # [B, P]
