"""The flags of `kvports bench` and their checks: each refusal is one `error:` line."""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Sequence
from pathlib import Path

from kvports.shared.bench.presets import PRESETS
from kvports.shared.bench.runners import DEFAULT_MODES, FRAMEWORKS, MODES
from kvports.shared.checks import SEED_PROMPT
from kvports.shared.commands.arguments import add_speculative_arguments, integer, parse_integer
from kvports.shared.config import DTYPES, MAX_SIZE, ModelConfig
from kvports.shared.devices import add_device_argument
from kvports.shared.errors import UserError, echo, echo_path
from kvports.shared.files import check_writable_folder, os_errors_as_user_errors
from kvports.shared.limits import check_run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset",
        choices=tuple(PRESETS),
        default="seed",
        help="seed: the seed's model; gpt2-small: GPT-2 small as published (124M parameters, tied head, tanh "
        "GELU), random weights (default seed)",
    )
    parser.add_argument(
        "--weights", type=Path, default=None, help="time this safetensors or GGUF file instead of a preset"
    )
    parser.add_argument("--model", default=None, metavar="NAME", help="time a fetched model (kvports fetch smollm2)")
    parser.add_argument("--batch", type=integer, default=1, help="prompts per batch (default 1)")
    parser.add_argument(
        "--prompt-len",
        type=integer,
        default=len(SEED_PROMPT),
        metavar="P",
        help=f"prompt tokens: the seed's prompt, repeated to length P (default {len(SEED_PROMPT)})",
    )
    parser.add_argument("--new-tokens", type=integer, default=100, metavar="N", help="tokens to generate (default 100)")
    parser.add_argument(
        "--frameworks",
        default=",".join(FRAMEWORKS),
        help=f"comma-separated subset of {','.join(FRAMEWORKS)} (default all)",
    )
    parser.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help=f"comma-separated subset of {','.join(MODES)} (default {','.join(DEFAULT_MODES)}; speculative needs "
        "--draft)",
    )
    parser.add_argument("--compile", action="store_true", help="add a torch.compile row (torch cached, compiled)")
    parser.add_argument(
        "--repeats", type=integer, default=3, help="timed runs per figure; figures are medians (default 3)"
    )
    parser.add_argument("--warmup", type=integer, default=1, help="untimed runs before timing (default 1)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="compute dtype (default float32)")
    add_device_argument(parser)
    parser.add_argument(
        "--sweep",
        default=None,
        metavar="N1,N2,...",
        help="also time generate() at these new-token counts, for the total-time log-log plot "
        "(default with --plot: N/16, N/8, N/4, N/2, N)",
    )
    parser.add_argument(
        "--roofline",
        action="store_true",
        help="measure bandwidth and a roofline for any preset (always on for gpt2-small)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object on stdout instead of the table (no progress bar)"
    )
    parser.add_argument(
        "--csv",
        type=Path,
        default=None,
        metavar="FILE",
        help="also write one CSV line per row to FILE ('-': to stdout, instead of the table)",
    )
    parser.add_argument("--plot", type=Path, default=None, metavar="DIR", help="write PNG plots into DIR as they exist")
    parser.add_argument(
        "--targets", action="store_true", help="also print the development speed targets, met or missed"
    )
    add_speculative_arguments(parser)
    batching = parser.add_argument_group("continuous batching (docs/BATCHING.md)")
    batching.add_argument(
        "--requests",
        type=integer,
        default=None,
        metavar="N",
        help="instead of the rows above: N requests of mixed lengths, and N sharing a 256-token prefix, run with "
        "continuous batching over a paged cache against one at a time, per port (kvports batch --bench)",
    )


# What --requests keeps from the bench's flags; every other one must stay at its default.
BATCHING_FLAGS = ("preset", "weights", "frameworks", "dtype", "device", "json", "requests")


def batching_argv(args: argparse.Namespace, parser_defaults: dict[str, object], ports: Sequence[str]) -> list[str]:
    """`kvports bench --requests N ...` as the flags of `kvports batch --bench`."""
    check_at_least("--requests", args.requests, 1)
    if args.requests > MAX_SIZE:
        raise UserError(f"--requests {echo(args.requests)} is above {MAX_SIZE}")
    changed = [
        name
        for name, default in parser_defaults.items()
        if name not in BATCHING_FLAGS and getattr(args, name) != default
    ]
    if changed:
        flags = ", ".join("--" + name.replace("_", "-") for name in changed)
        raise UserError(f"--requests runs the batching workloads, which take no {flags}")
    chosen = [name for name in parse_choices(args.frameworks, FRAMEWORKS, "frameworks") if name in ports]
    if not chosen:
        raise UserError(
            f"--requests times the ports ({','.join(ports)}); --frameworks {echo(args.frameworks)} names none"
        )
    argv = ["--bench", "--count", str(args.requests), "--frameworks", ",".join(chosen)]
    argv += ["--dtype", args.dtype, "--device", args.device]
    argv += ["--weights", str(args.weights)] if args.weights is not None else ["--preset", args.preset]
    return argv + (["--json"] if args.json else [])


def check_counts(args: argparse.Namespace) -> None:
    """The counts the bench needs, before anything loads. (Integers, not argparse types: the
    messages name the rule each limit comes from.)"""
    check_at_least("--batch", args.batch, 1)
    check_at_least("--prompt-len", args.prompt_len, 1)
    check_at_least("new tokens", args.new_tokens, 2, ": decode timing needs a step after the first token")
    check_at_least("--repeats", args.repeats, 1)
    check_at_least("--warmup", args.warmup, 1, ": the first call (and JAX's compile) must stay out of the figures")
    for name in ("--batch", "--prompt-len", "--new-tokens", "--repeats", "--warmup"):
        value = getattr(args, name[2:].replace("-", "_"))
        if value > MAX_SIZE:
            raise UserError(f"{name} {echo(value)} is above {MAX_SIZE}")


def check_bench_run(config: ModelConfig, args: argparse.Namespace, modes: Sequence[str], longest: int) -> None:
    """The run's sizes against the model, and the bytes of its longest generation (`longest`
    new tokens: --new-tokens, or a --sweep value) against the limit: before the prompts are
    built or any tensor is read."""
    total = args.prompt_len + args.new_tokens
    if total > config.max_seq_len:
        raise UserError(
            f"prompt length {args.prompt_len} + new tokens {args.new_tokens} = {total} exceeds "
            f"max_seq_len {config.max_seq_len}"
        )
    check_run(config, args.dtype, args.batch, args.prompt_len, longest, modes)


def check_outputs(args: argparse.Namespace) -> None:
    """--plot and --csv, checked before anything runs: a long run must not fail at its end."""
    if args.plot is not None:
        if importlib.util.find_spec("matplotlib") is None:
            raise UserError("--plot needs matplotlib: pip install 'kvports[plot]'")
        with os_errors_as_user_errors(args.plot):
            if args.plot.exists() and not args.plot.is_dir():
                raise UserError(f"--plot {echo_path(args.plot)} is a file, not a folder")
            check_writable_folder(args.plot.parent, args.plot.name)
    if args.csv is not None and str(args.csv) == "-" and args.json:
        raise UserError("--csv - and --json both print to stdout: give --csv a FILE")
    if args.csv is not None and str(args.csv) != "-":
        with os_errors_as_user_errors(args.csv):
            if args.csv.is_dir():
                raise UserError(f"--csv {echo_path(args.csv)} is a folder; give the file to write")
            check_writable_folder(args.csv.parent, args.csv.name)


def check_at_least(name: str, value: int, limit: int, why: str = "") -> None:
    if value < limit:
        raise UserError(f"{name} {value} is below {limit}{why}")


def parse_choices(text: str, allowed: Sequence[str], what: str) -> list[str]:
    """A comma-separated subset of `allowed`, in `allowed`'s order."""
    chosen = [part.strip() for part in text.split(",") if part.strip()]
    if not chosen:
        raise UserError(f"--{what} is empty: give some of {','.join(allowed)}")
    for name in chosen:
        if name not in allowed:
            raise UserError(f"unknown {what[:-1]} {name!r}; known: {', '.join(allowed)}")
    return [name for name in allowed if name in chosen]


def default_sweep(new_tokens: int) -> list[int]:
    return sorted({max(2, round(new_tokens / 2**k)) for k in range(5)})


def parse_sweep(text: str | None, new_tokens: int, prompt_len: int, config: ModelConfig, plot: bool) -> list[int]:
    """The new-token counts of the total-time sweep: given, the default when plotting, or none."""
    if text is None:
        return default_sweep(new_tokens) if plot else []
    values = []
    for part in text.split(","):
        value = parse_integer(part)
        if value is None:
            raise UserError(f"--sweep value {echo(part.strip())} is not an integer")
        values.append(value)
    for value in values:
        check_at_least("--sweep value", value, 2)
        if prompt_len + value > config.max_seq_len:
            raise UserError(
                f"--sweep value {value} + prompt length {prompt_len} exceeds max_seq_len {config.max_seq_len}"
            )
    return sorted(set(values))
