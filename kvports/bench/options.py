"""The flags of `kvports bench` and their checks: each refusal is one `error:` line."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from kvports.batching.engine import BatchSettings
from kvports.bench.presets import PRESETS
from kvports.bench.runners import DEFAULT_MODES, FRAMEWORKS, GROUPS, MODES
from kvports.bench.throughput import WORKLOADS, BatchingBench
from kvports.devices import add_device_argument
from kvports.flags import (
    add_model_argument,
    add_speculative_arguments,
    add_tensor_parallel_argument,
    integer,
    parse_integer,
)
from kvports.shared.config import DTYPES, MAX_SIZE, QUANTS, ModelConfig
from kvports.shared.errors import UserError, echo
from kvports.threads import check_threads
from kvports.validation import SEED_PROMPT, check_at_least

NEW_TOKENS = 100
PEERS_NEW_TOKENS = 128  # llama-bench's tg128
PEERS_PROMPT = 512  # llama-bench's pp512


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`kvports bench`'s flags, in --help's order."""
    add_run_arguments(parser)
    add_row_arguments(parser)
    add_output_arguments(parser)
    add_batching_arguments(parser)


def bench_defaults() -> dict[str, object]:
    """Every bench flag at its default: what `--serve` and `--requests` hold the other flags to."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return vars(parser.parse_args([]))


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """What runs: the model, the prompt and generation shapes, the frameworks and modes."""
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
    add_model_argument(parser)
    parser.add_argument("--batch", type=integer, default=1, help="prompts per batch (default 1)")
    parser.add_argument(
        "--prompt-len",
        type=integer,
        default=len(SEED_PROMPT),
        metavar="P",
        help=f"prompt tokens: the seed's prompt, repeated to length P (default {len(SEED_PROMPT)})",
    )
    parser.add_argument(
        "--new-tokens",
        "--tg",
        dest="new_tokens",
        type=integer,
        default=None,
        metavar="N",
        help=f"tokens to generate; tg, generated tokens/s, is timed over them (default {NEW_TOKENS}; with --peers "
        f"{PEERS_NEW_TOKENS}, llama-bench's tg{PEERS_NEW_TOKENS})",
    )
    parser.add_argument(
        "--pp",
        type=integer,
        default=None,
        metavar="P",
        help=f"also time each row's prefill of a P-token prompt (the seed's prompt repeated), as prompt tokens/s "
        f"(llama-bench's pp; default with --peers {PEERS_PROMPT}, or the longest prompt the model takes, else none; "
        "0: none)",
    )
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


def add_row_arguments(parser: argparse.ArgumentParser) -> None:
    """The rows beside the ports' (torch.compile, the peers), the chat prompt, the warm-up, the formats."""
    parser.add_argument("--compile", action="store_true", help="add a torch.compile row (torch cached, compiled)")
    parser.add_argument(
        "--peers",
        action="store_true",
        help="add rows for other engines: llama.cpp on the GGUF file itself and on F16 and F32 files written from "
        "the same weights, CTranslate2 float32 and int8 (pip install 'kvports[peers]'), their tokens compared step "
        "by step with the float32 reference's",
    )
    parser.add_argument(
        "--chat",
        default=None,
        metavar="TEXT",
        help="a real prompt: TEXT as one user turn in the GGUF file's own chat template, tokenized by its own "
        "tokenizer (instead of the seed's prompt repeated to --prompt-len)",
    )
    parser.add_argument(
        "--repeats", type=integer, default=3, help="timed runs per figure; figures are medians (default 3)"
    )
    parser.add_argument("--warmup", type=integer, default=1, help="untimed runs before timing (default 1)")
    parser.add_argument(
        "--dtype",
        default="float32",
        metavar="D1,D2,...",
        help=f"compute dtype, or a comma-separated list of {','.join(DTYPES)}: each port runs each one it offers, "
        "a row per format (default float32)",
    )
    parser.add_argument(
        "--quant",
        default="none",
        metavar="Q1,Q2,...",
        help=f"weight-only quantization, or a comma-separated list of {','.join(QUANTS)}, crossed with --dtype: "
        "int8 (per output channel, at load) or q4 (a Q4_0/Q4_1 GGUF file's own 4-bit blocks; a file without any "
        "is refused, listed or not); each port runs the formats it offers, a row each, weights named "
        "float32, bfloat16+int8, float32+q4, ...; a single value a port lacks is refused, a listed one skipped; "
        "--compile's row runs every format torch runs; the baselines and --peers run once, at the first format "
        "(default none)",
    )


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """Where and how it runs (device, split, draft, threads, rounds), the sweep and roofline, and where
    its results go."""
    add_device_argument(parser)
    add_tensor_parallel_argument(parser, several=True)
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
    parser.add_argument(
        "--threads",
        default=None,
        metavar="N1,N2,...",
        help="threads for every framework (torch, NumPy's BLAS, JAX's pool, the peers), at most 4 per CPU, or a "
        "comma-separated list: each count (and each --rounds) runs in a process of its own, interleaved, and "
        "every row is given at each count (default: each framework's own, a thread per CPU)",
    )
    parser.add_argument(
        "--rounds",
        type=integer,
        default=1,
        metavar="R",
        help="run every row R times over, interleaved with the other rows and thread counts so the machine's "
        "load falls on all alike; figures are medians over every round's repeats (default 1)",
    )
    parser.add_argument(  # set by bench.rounds on its children: one framework's rows, or the peers', alone
        "--group", default=None, choices=GROUPS, help=argparse.SUPPRESS
    )


def add_batching_arguments(parser: argparse.ArgumentParser) -> None:
    """The continuous-batching benchmark's flags (`bench --requests`)."""
    batching = parser.add_argument_group("continuous batching (docs/BATCHING.md)")
    batching.add_argument(
        "--requests",
        type=integer,
        default=None,
        metavar="N",
        help="instead of the rows above: N requests of mixed lengths, and N sharing a 256-token prefix, run with "
        "continuous batching over a paged cache against one at a time, per port (kvports batch --bench)",
    )
    batching.add_argument(
        "--serve",
        action="store_true",
        help="instead of the rows above: a kvports serve per port (and with --peers llama-cpp-python's server) "
        "under 1, 4 and 16 concurrent chat clients: requests/s, tokens/s, TTFT and ITL (docs/SERVING.md)",
    )


# What --requests keeps from the bench's flags; every other one must stay at its default.
BATCHING_FLAGS = ("preset", "weights", "frameworks", "dtype", "device", "json", "requests", "threads")


def batching_inputs(
    args: argparse.Namespace, parser_defaults: dict[str, object], ports: Sequence[str]
) -> BatchingBench:
    """`kvports bench --requests N ...` as the batching bench's inputs (`kvports batch --bench`'s)."""
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
    dtypes = parse_choices(args.dtype, DTYPES, "dtypes", "--dtype")
    if len(dtypes) > 1:
        raise UserError(f"--requests runs the batching workloads at one dtype, not --dtype {echo(args.dtype)}")
    return BatchingBench(
        tuple(chosen),
        WORKLOADS,
        args.requests,
        BatchSettings(),
        args.preset,
        args.weights,
        dtypes[0],
        args.device,
        args.json,
        single_threads(args.threads, "--requests runs the batching workloads at one thread count"),
    )


def parse_threads(text: str | int | None) -> list[int | None]:
    """--threads: None (each framework's own), or one count or a list, each checked as a single --threads."""
    if text is None:
        return [None]
    values = []
    for part in str(text).split(","):
        value = parse_integer(part)
        if value is None:
            raise UserError(f"--threads value {echo(part.strip())} is not an integer")
        values.append(check_threads(value))
    return list(dict.fromkeys(values))


def single_threads(text: str | int | None, why: str) -> int | None:
    counts = parse_threads(text)
    if len(counts) > 1:
        raise UserError(f"{why}, not --threads {echo(text)}")
    return counts[0]


def resolve_counts(args: argparse.Namespace) -> None:
    """--new-tokens at its default (llama-bench's tg128 beside the peers); --pp and --rounds checked."""
    if args.new_tokens is None:
        args.new_tokens = PEERS_NEW_TOKENS if args.peers else NEW_TOKENS
    if args.pp is not None:
        check_at_least("--pp", args.pp, 0)
    check_at_least("--rounds", args.rounds, 1)
    if args.rounds > MAX_SIZE:
        raise UserError(f"--rounds {echo(args.rounds)} is above {MAX_SIZE}")


def resolve_pp(args: argparse.Namespace, config: ModelConfig) -> None:
    """--pp at its default, once the model is known: llama-bench's pp512 beside the peers (or the longest
    prompt the model takes, if shorter), else none."""
    if args.pp is None:
        args.pp = min(PEERS_PROMPT, config.max_seq_len - 1) if args.peers else 0


def parse_choices(text: str, allowed: Sequence[str], what: str, flag: str | None = None) -> list[str]:
    """A comma-separated subset of `allowed`, in `allowed`'s order; `what` names its items (plural),
    `flag` the flag (default --what)."""
    chosen = [part.strip() for part in text.split(",") if part.strip()]
    if not chosen:
        raise UserError(f"{flag or '--' + what} is empty: give some of {','.join(allowed)}")
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
