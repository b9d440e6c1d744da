"""Argument types and the inputs `generate` and `compare` share: weights, prompts, text.

Every refusal here is one `error:` line and exit 2 (see `shared.cli`), raised before any
port is imported.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvports.shared.checks import SEED_PROMPT, check_prompts, parse_prompt
from kvports.shared.config import DTYPES, ModelConfig
from kvports.shared.errors import UserError
from kvports.shared.generation import GenerationConfig
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


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None


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
        help="comma-separated token ids; repeat for a batch (rows may differ in length) "
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
        help="prompt text, encoded with --tokenizer; repeat for a batch",
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
    config, tensors = load_weights_argument(args)
    return config, tensors, prompts_from(args, config)


def load_weights_argument(args: argparse.Namespace) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    return load_weights(args.weights if args.weights is not None else DEFAULT_WEIGHTS)


def prompts_from(args: argparse.Namespace, config: ModelConfig) -> np.ndarray:
    """--prompt (or --text) as one checked batch [B, P]; the seed's prompt when none is given."""
    if getattr(args, "text", None) is not None:
        from kvports.shared.hf.text import encode

        if args.prompt:
            raise UserError("give --prompt (token ids) or --text, not both")
        ids = encode(load_text_tokenizer(args), args.text)
        return check_prompts(ids, config, args.new_tokens)
    texts = args.prompt if args.prompt else [",".join(map(str, SEED_PROMPT))]
    return check_prompts([parse_prompt(text) for text in texts], config, args.new_tokens)


def parse_flags(add_arguments: Callable[[argparse.ArgumentParser], None], argv: list[str]) -> argparse.Namespace:
    """A command's flags parsed from `argv` by the command's own definitions, each refusal a UserError
    with the command line's message: how the Python API checks what it is given."""
    parser = argparse.ArgumentParser(exit_on_error=False, add_help=False)
    add_arguments(parser)
    try:
        return parser.parse_args(argv)
    except argparse.ArgumentError as exc:
        # As shared.cli's Parser words them: an out-of-range integer names the flag and the limit.
        if isinstance(exc.__context__, OutOfRange):
            raise UserError(f"{exc.argument_name} {exc.message}") from None
        raise UserError(str(exc)) from None


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


def add_generation_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling and stopping (the same tokens in every framework)")
    group.add_argument("--temperature", type=number, default=0.0, help="0 (default): greedy; above 0: sample")
    group.add_argument(
        "--top-k", type=non_negative_int, default=0, metavar="K", help="sample from the K likeliest tokens (0: all)"
    )
    group.add_argument(
        "--top-p",
        type=number,
        default=1.0,
        metavar="P",
        help="sample from the fewest likeliest tokens whose probability reaches P (1: all)",
    )
    group.add_argument(
        "--seed", type=non_negative_int, default=0, help="the draws' seed: the same seed, the same tokens everywhere"
    )
    group.add_argument(
        "--stop-id",
        type=non_negative_int,
        action="append",
        default=None,
        metavar="ID",
        help="end a row once it emits this token, kept as its last (repeatable; default: the model's eos ids)",
    )
    group.add_argument("--no-stop", action="store_true", help="generate every new token, ignoring the model's eos ids")


def generation_from(args: argparse.Namespace, config: ModelConfig) -> GenerationConfig:
    """The generation settings the flags ask for, checked (one `error:` line for a bad one)."""
    if args.no_stop and args.stop_id:
        raise UserError("give --stop-id or --no-stop, not both")
    stops = () if args.no_stop else tuple(args.stop_id) if args.stop_id else config.eos_token_ids
    return GenerationConfig(
        args.new_tokens, args.temperature, args.top_k, args.top_p, args.seed, tuple(dict.fromkeys(stops))
    ).validate(config.vocab_size)


MAX_DRAFT_TOKENS = 16  # a verified chunk is K + 1 wide; past this the draft is the bottleneck anyway


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("speculative decoding (mode speculative)")
    group.add_argument(
        "--draft",
        default=None,
        metavar="FILE|ngram",
        help="the draft: a smaller model's weights file with the same vocabulary, or 'ngram' (prompt lookup)",
    )
    group.add_argument(
        "--draft-tokens",
        type=positive_int,
        default=4,
        metavar="K",
        help=f"proposals per round, each round one target forward (default 4, at most {MAX_DRAFT_TOKENS})",
    )
    group.add_argument(
        "--ngram", type=positive_int, default=2, metavar="N", help="prompt lookup matches the last N tokens (default 2)"
    )


def load_draft(
    args: argparse.Namespace, config: ModelConfig, prompts: np.ndarray
) -> tuple[ModelConfig, dict[str, np.ndarray]] | None:
    """The draft model's config and weights, or None for prompt lookup; checked against the target."""
    if args.draft is None:
        raise UserError("--mode speculative needs --draft FILE (a smaller model) or --draft ngram")
    if args.draft_tokens > MAX_DRAFT_TOKENS:
        raise UserError(f"--draft-tokens {args.draft_tokens} is above {MAX_DRAFT_TOKENS}")
    models, draft = [("the model", config)], None
    if args.draft != "ngram":
        draft = load_weights(Path(args.draft))
        if draft[0].vocab_size != config.vocab_size:
            raise UserError(
                f"the draft's vocab_size {draft[0].vocab_size} differs from the model's {config.vocab_size}: "
                "a draft must propose the target's tokens"
            )
        models.append(("the draft", draft[0]))
    needed = prompts.shape[1] + args.new_tokens + args.draft_tokens  # a round writes up to K past what it keeps
    for name, model_config in models:
        if needed > model_config.max_seq_len:
            raise UserError(
                f"prompt length {prompts.shape[1]} + new tokens {args.new_tokens} + draft tokens "
                f"{args.draft_tokens} = {needed} exceeds {name}'s max_seq_len {model_config.max_seq_len}"
            )
    return draft
