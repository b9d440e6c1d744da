"""The argparse types every command shares (counts, seeds, numbers, output files) and the
speculative flags `generate`, `compare` and `bench` take. They only turn strings into values:
the checks of what those values mean are `shared.checks`'.

A refusal here is one `error:` line and exit 2 (see `kvports.cli`)."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from kvports.shared.checks import MAX_SEED, check_count
from kvports.shared.errors import UserError, echo
from kvports.validation import MAX_DRAFT_TOKENS, MAX_NGRAM, MAX_TENSOR_PARALLEL


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


def seeds(text: str) -> tuple[int, ...]:
    """One seed for every row, or a comma-separated list, one per row (`shared.checks.check_seeds`
    counts them against the prompts): each a Philox key word, 0 to 2**64 - 1."""
    parts = text.split(",")
    check_count("--seed values", len(parts))  # a megabyte of commas is refused before it is read
    return tuple(seed(part) for part in parts)


def number(text: str) -> float:
    try:
        if not text.isascii() or "_" in text:  # float() also reads fullwidth digits, and 1_0
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


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("speculative decoding (mode speculative)")
    group.add_argument(
        "--draft",
        default=None,
        metavar="FILE|ngram",
        help="the draft: a smaller model's weights file with the same vocabulary, or 'ngram' (prompt lookup); "
        "generate uses it with --mode speculative only, and warns that it does nothing otherwise",
    )
    group.add_argument(
        "--draft-tokens",
        type=positive_int,
        default=4,
        metavar="K",
        help=f"proposals per round, each round one target forward (default 4, at most {MAX_DRAFT_TOKENS})",
    )
    group.add_argument(
        "--ngram",
        type=positive_int,
        default=2,
        metavar="N",
        help=f"prompt lookup matches the last N tokens (default 2, at most {MAX_NGRAM} and the prompt + new tokens)",
    )


def add_tensor_parallel_argument(parser: argparse.ArgumentParser, several: bool = False) -> None:
    """--tensor-parallel N: the model split across N devices (the bench: N,N,..., rows for each)."""
    parser.add_argument(
        "--tensor-parallel",
        type=tensor_parallel_sizes if several else positive_int,
        default=(1,) if several else 1,
        metavar="N,N,..." if several else "N",
        help="split the model across N devices, Megatron-style (torch and jax; on the CPU, N processes or N "
        f"simulated devices; at most {MAX_TENSOR_PARALLEL}; default 1)"
        + ("; rows for each N given" if several else ""),
    )


def tensor_parallel_sizes(text: str) -> tuple[int, ...]:
    return tuple(dict.fromkeys(positive_int(part) for part in text.split(",")))


def add_weights_arguments(parser: argparse.ArgumentParser) -> None:
    """--weights FILE and --model NAME, the model a command runs."""
    parser.add_argument(
        "--weights",
        type=Path,
        default=None,
        help="safetensors or GGUF weights file (default: the seed's model, shipped with kvports)",
    )
    add_model_argument(parser)


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, metavar="NAME", help="a fetched model by name, as --weights (kvports fetch smollm2)"
    )


def resolve_model(args: argparse.Namespace) -> None:
    """--model NAME becomes --weights: the fetched file's path (an error if it is not fetched yet)."""
    if getattr(args, "model", None) is not None:
        from kvports.hub import model_path

        if args.weights is not None:
            raise UserError("give --weights FILE or --model NAME, not both")
        args.weights = model_path(args.model)


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threads",
        type=integer,
        default=None,
        metavar="N",
        help="threads for every framework (torch, NumPy's BLAS, JAX's pool), at most 4 per CPU (default: each "
        "framework's own, a thread per CPU; on a busy machine 1 can be many times faster)",
    )


def add_quant_argument(parser: argparse.ArgumentParser) -> None:
    """--quant, the weight-only quantization (with --dtype float32)."""
    from kvports.shared.config import QUANTS

    parser.add_argument(
        "--quant",
        choices=QUANTS,
        default="none",
        help="weight-only quantization: int8 (symmetric, per output channel, at load) or q4 (a Q4_0/Q4_1 GGUF "
        "file's own 4-bit blocks; its other matrices int8); torch and jax (default none)",
    )
