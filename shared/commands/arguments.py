"""Argument types and the inputs `generate` and `compare` share: weights, prompts, text.

Every refusal here is one `error:` line and exit 2 (see `shared.cli`), raised before any
port is imported.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from kvports.shared.checks import SEED_PROMPT, check_prompts, parse_prompt
from kvports.shared.config import DTYPES, ModelConfig
from kvports.shared.errors import UserError
from kvports.shared.weights import DEFAULT_WEIGHTS, load_weights


class OutOfRange(argparse.ArgumentTypeError):
    """An integer outside what its type's name promises; the command line reports it as
    `error: --flag VALUE is below LIMIT`, one line."""


def integer(text: str) -> int:
    try:
        return int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None


def positive_int(text: str) -> int:
    """1, 2, 3, ...: a count that must be at least one."""
    value = integer(text)
    if value < 1:
        raise OutOfRange(f"{value} is below 1")
    return value


def non_negative_int(text: str) -> int:
    """0, 1, 2, ...: a seed, say."""
    value = integer(text)
    if value < 0:
        raise OutOfRange(f"{value} is below 0")
    return value


def add_input_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--weights",
        type=Path,
        default=None,
        help="safetensors weights file (default: the seed's model, shipped with kvports)",
    )
    parser.add_argument(
        "--prompt",
        action="append",
        default=None,
        metavar="IDS",
        help="comma-separated token ids; repeat for a batch of equal-length prompts "
        f"(default: {','.join(map(str, SEED_PROMPT))})",
    )
    parser.add_argument(
        "--new-tokens", type=positive_int, default=100, metavar="N", help="tokens to generate (default 100)"
    )
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="compute dtype (default float32)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def add_text_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--text",
        action="append",
        default=None,
        help="prompt text, encoded with --tokenizer; repeat for a batch (equal token counts)",
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        metavar="DIR",
        help="folder holding tokenizer.json (e.g. the Hugging Face directory converted with --from-hf)",
    )


def load_inputs(args: argparse.Namespace) -> tuple[ModelConfig, dict[str, np.ndarray], np.ndarray]:
    """Weights and prompts [B, P], checked: everything a port needs, before any port is imported."""
    config, tensors = load_weights(args.weights if args.weights is not None else DEFAULT_WEIGHTS)
    if getattr(args, "text", None) is not None:
        from kvports.shared.hf.text import encode

        if args.prompt:
            raise UserError("give --prompt (token ids) or --text, not both")
        ids = encode(load_text_tokenizer(args), args.text)
        prompts = check_prompts(ids, config, args.new_tokens)
    else:
        texts = args.prompt if args.prompt else [",".join(map(str, SEED_PROMPT))]
        prompts = check_prompts([parse_prompt(text) for text in texts], config, args.new_tokens)
    return config, tensors, prompts


def load_text_tokenizer(args: argparse.Namespace) -> Any:
    """The tokenizer --text and decoded output need; None when neither was asked for."""
    if getattr(args, "tokenizer", None) is None:
        if getattr(args, "text", None) is not None:
            raise UserError("--text needs --tokenizer DIR (a folder holding tokenizer.json)")
        return None
    if not hasattr(args, "_tokenizer"):
        from kvports.shared.hf.text import load_tokenizer

        args._tokenizer = load_tokenizer(args.tokenizer)
    return args._tokenizer
