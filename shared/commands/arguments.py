"""Argument types and the inputs `generate` and `compare` share: weights, prompts, text.

Every refusal here is one `error:` line and exit 2 (see `shared.cli`), raised before any
port is imported.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from kvports.shared.checks import SEED_PROMPT, check_prompts, parse_prompt
from kvports.shared.config import DTYPES, ModelConfig
from kvports.shared.errors import UserError, echo
from kvports.shared.generation import MAX_SEED, GenerationConfig
from kvports.shared.limits import check_bytes, check_run
from kvports.shared.weights import DEFAULT_WEIGHTS, open_weights, parameter_count


class OutOfRange(argparse.ArgumentTypeError):
    """An integer outside what its type's name promises; the command line reports it as
    `error: --flag VALUE is below LIMIT`, one line."""


def parse_integer(text: str) -> int | None:
    """ASCII digits with an optional sign, or None: Python's int() would also take `1_0` and
    Arabic-Indic or fullwidth digits, and thousands of digits only to echo them back."""
    if re.fullmatch(r"[+-]?[0-9]{1,30}", text.strip(), flags=re.ASCII) is None:
        return None
    return int(text)


def integer(text: str) -> int:
    value = parse_integer(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"invalid int value: {echo(text)}")
    return value


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


def seed(text: str) -> int:
    """0 to 2**64 - 1: a Philox key word, and what torch.manual_seed accepts."""
    value = non_negative_int(text)
    if value > MAX_SEED:
        raise OutOfRange(f"{value} is above {MAX_SEED}")
    return value


def number(text: str) -> float:
    try:
        if not text.isascii():  # float() also reads fullwidth and other digits
            raise ValueError(text)
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {echo(text)}") from None


def output_file(text: str) -> Path:
    """--out as a file's path. A trailing separator names a folder: pathlib would drop it, and
    `--out newfile/` would write a file called newfile."""
    if text.endswith(("/", os.sep)):
        raise UserError(f"--out {echo(text)} ends with {text[-1]!r}, so it names a folder; give the file's name")
    return Path(text)


def add_input_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--weights",
        type=Path,
        default=None,
        help="safetensors or GGUF weights file (default: the seed's model, shipped with kvports)",
    )
    parser.add_argument("--model", default=None, metavar="NAME", help="a fetched model by name (kvports fetch smollm2)")
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
        help="prompt text, encoded with --tokenizer (or a GGUF file's own tokenizer); repeat for a batch",
    )
    parser.add_argument(
        "--chat", action="append", default=None, help="a chat turn (user, then assistant, ...), in the model's template"
    )
    parser.add_argument("--chat-file", type=Path, default=None, help="a JSON list of {role, content} messages")
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        metavar="DIR",
        help="folder holding tokenizer.json (e.g. the Hugging Face directory converted with --from-hf)",
    )


def load_inputs(args: argparse.Namespace) -> tuple[ModelConfig, dict[str, np.ndarray], np.ndarray]:
    """Weights (at --dtype) and prompts [B, P], checked: everything a port needs, before any
    port is imported. The file's header gives the config; the prompts, the generation flags
    and the bytes the run will allocate are checked against it before any tensor is read."""
    with open_weights(weights_argument(args)) as weights:
        config = weights.config.validate_at(args.dtype)
        prompts = checked_prompts(args, config)
        return config, weights.read(args.dtype), prompts


def weights_argument(args: argparse.Namespace) -> Path:
    """--weights FILE, --model NAME (a fetched file), or the seed's model."""
    from kvports.shared.fetch import weights_source

    return weights_source(args.weights, getattr(args, "model", None), DEFAULT_WEIGHTS)


def load_weights_argument(args: argparse.Namespace) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """--weights at --dtype, without prompts: the Python API loads a model before it is given any.
    Its weights' bytes are checked against the limit before any tensor is read."""
    with open_weights(weights_argument(args)) as weights:
        config = weights.config.validate_at(args.dtype)
        count = parameter_count(config)
        check_bytes({"weights": 2 * count * np.dtype(args.dtype).itemsize}, f"a model of {count:,} parameters")
        return config, weights.read(args.dtype)


def checked_prompts(args: argparse.Namespace, config: ModelConfig) -> np.ndarray:
    """--prompt (or --text; the seed's prompt when neither) as one batch [B, P], with everything
    else a run is checked for against the model: the generation flags, the draft's flags, and
    the bytes the run will allocate."""
    tokenizer = load_text_tokenizer(args, config)
    from kvports.shared.chat import chat_messages

    messages = chat_messages(getattr(args, "chat", None), getattr(args, "chat_file", None))
    if messages is not None:
        from kvports.shared.gguf.tokenizer import chat_ids

        if args.prompt or getattr(args, "text", None):
            raise UserError("give --chat/--chat-file, --text or --prompt, not two of them")
        prompts = check_prompts([chat_ids(weights_argument(args), messages, tokenizer)], config, args.new_tokens)
    elif getattr(args, "text", None) is not None:
        from kvports.shared.hf.text import encode

        if args.prompt:
            raise UserError("give --prompt (token ids) or --text, not both")
        ids = encode(tokenizer, args.text)
        prompts = check_prompts(ids, config, args.new_tokens)
    else:
        texts = args.prompt if args.prompt else [",".join(map(str, SEED_PROMPT))]
        prompts = check_prompts([parse_prompt(text) for text in texts], config, args.new_tokens)
    generation_from(args, config)
    modes = run_modes(args)
    if "speculative" in modes:
        check_draft_flags(args)
        check_needed(args, prompts, [("the model", config)])
    B, P = prompts.shape
    check_run(config, args.dtype, B, P, args.new_tokens, modes, args.draft_tokens if "speculative" in modes else 0)
    return prompts


def run_modes(args: argparse.Namespace) -> list[str]:
    """The modes the command runs: generate's --mode, or compare's naive and cached (and
    speculative, given --draft)."""
    if hasattr(args, "mode"):
        return [args.mode]
    return ["naive", "cached"] + (["speculative"] if args.draft is not None else [])


def load_text_tokenizer(args: argparse.Namespace, config: ModelConfig) -> Any:
    """The tokenizer --text and decoded output need, checked against the model's vocabulary;
    None when neither was asked for."""
    from kvports.shared.gguf.tokenizer import has_tokenizer

    gguf = getattr(args, "tokenizer", None) is None and hasattr(args, "text") and has_tokenizer(weights_argument(args))
    if getattr(args, "tokenizer", None) is None and not gguf:
        if getattr(args, "text", None) is not None or getattr(args, "chat", None) or getattr(args, "chat_file", None):
            raise UserError("--text and --chat need --tokenizer DIR (a folder holding tokenizer.json) or a GGUF file")
        return None
    if not hasattr(args, "_tokenizer"):
        from kvports.shared.gguf.tokenizer import gguf_tokenizer
        from kvports.shared.hf.text import check_vocabulary, load_tokenizer

        found = gguf_tokenizer(weights_argument(args)) if gguf else load_tokenizer(args.tokenizer)
        args._tokenizer = check_vocabulary(found, config.vocab_size)
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
        "--seed", type=seed, default=0, help="the draws' seed: the same seed, the same tokens everywhere"
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
    check_draft_flags(args)
    if args.draft == "ngram":
        check_needed(args, prompts, [("the model", config)])
        return None
    with open_weights(Path(args.draft)) as weights:
        if weights.config.vocab_size != config.vocab_size:
            raise UserError(
                f"the draft's vocab_size {weights.config.vocab_size} differs from the model's "
                f"{config.vocab_size}: a draft must propose the target's tokens"
            )
        check_needed(args, prompts, [("the model", config), ("the draft", weights.config)])
        B, P = prompts.shape
        check_run(config, args.dtype, B, P, args.new_tokens, ["speculative"], args.draft_tokens, weights.config)
        return weights.config, weights.read(args.dtype)


def check_draft_flags(args: argparse.Namespace) -> None:
    if args.draft is None:
        raise UserError("--mode speculative needs --draft FILE (a smaller model) or --draft ngram")
    if args.draft_tokens > MAX_DRAFT_TOKENS:
        raise UserError(f"--draft-tokens {args.draft_tokens} is above {MAX_DRAFT_TOKENS}")


def check_needed(args: argparse.Namespace, prompts: np.ndarray, models: list[tuple[str, ModelConfig]]) -> None:
    needed = prompts.shape[1] + args.new_tokens + args.draft_tokens  # a round writes up to K past what it keeps
    for name, model_config in models:
        if needed > model_config.max_seq_len:
            raise UserError(
                f"prompt length {prompts.shape[1]} + new tokens {args.new_tokens} + draft tokens "
                f"{args.draft_tokens} = {needed} exceeds {name}'s max_seq_len {model_config.max_seq_len}"
            )
