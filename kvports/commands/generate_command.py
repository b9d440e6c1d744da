"""`kvports generate`: one framework, one mode (naive, cached or speculative), greedy or
sampled, with stop tokens, prompts of different lengths and streaming."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from kvports import registry
from kvports.batching import constraint
from kvports.batching.constraint import MAX_SCHEMA_BYTES, ResponseFormat
from kvports.bench.formats import format_name
from kvports.commands.inputs import (
    add_generation_arguments,
    add_input_arguments,
    add_text_arguments,
    read_inputs,
    warn_unused,
)
from kvports.devices import add_device_argument, tensor_parallel_layout
from kvports.families import describe
from kvports.flags import OutOfRange, add_speculative_arguments, integer, positive_int
from kvports.generating import Generation, generate
from kvports.loading import JAX_CACHE_VARIABLE, load_model
from kvports.shared.errors import UserError, echo
from kvports.shared.generation import PAD, GenerationConfig
from kvports.threads import describe_threads, use_threads
from kvports.validation import MAX_LOGPROBS, MAX_SAMPLES, MODES

HELP = "generate with one framework and mode: greedy or sampled, stop tokens, streaming"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--framework", choices=registry.PORTS, required=True)
    parser.add_argument("--mode", choices=MODES, required=True)
    add_input_arguments(parser)
    add_device_argument(parser)
    add_text_arguments(parser)
    add_generation_arguments(parser)
    add_speculative_arguments(parser)
    parser.add_argument(
        "--num-samples",
        type=positive_int,
        default=1,
        metavar="N",
        help=f"N samples of each prompt, seeded S, S+1, ..., S+N-1 (S its --seed; at most {MAX_SAMPLES})",
    )
    parser.add_argument(
        "--no-jax-cache", action="store_true", help="compile again rather than use JAX's cache in $KVPORTS_HOME"
    )
    parser.add_argument(
        "--stream", action="store_true", help="print tokens as they are made (with --json: one JSON line per step)"
    )
    parser.add_argument(
        "--json-schema",
        type=json_schema_file,
        metavar="FILE",
        help="each answer as JSON the schema in FILE describes (structured output through llguidance; --mode cached)",
    )
    parser.add_argument(
        "--logprobs",
        type=integer,
        default=0,
        metavar="K",
        help=f"print each new token's log-probability and the K likeliest tokens of its step (at most {MAX_LOGPROBS}; "
        "naive and cached modes)",
    )


class Stream:
    """on_token for --stream: each step's tokens as they reach the host. One row with a
    tokenizer prints its answer as it grows, each piece once (tokenizers' DecodeStream: never
    half a character); otherwise one line per step (`-` for a row that has stopped), or with
    --json one JSON object per line."""

    def __init__(self, batch: int, tokenizer: Any, as_json: bool):
        self.batch, self.tokenizer, self.as_json = batch, tokenizer, as_json
        self.step = 0
        self.decoder: Any = None
        if not as_json and batch == 1 and tokenizer is not None:
            from tokenizers.decoders import DecodeStream

            self.decoder = DecodeStream(skip_special_tokens=True)

    @property
    def shows_text(self) -> bool:
        return self.decoder is not None

    def __call__(self, token: np.ndarray) -> None:
        ids = [int(t) for t in token]
        if self.as_json:
            print(json.dumps({"step": self.step, "tokens": ids}), flush=True)
        elif self.decoder is not None:
            piece = self.decoder.step(self.tokenizer, ids[0]) if ids[0] != PAD else None
            if piece:
                print(piece, end="", flush=True)
        else:
            print(f"  step {self.step:>4}  " + " ".join("-" if t == PAD else str(t) for t in ids), flush=True)
        self.step += 1

    def close(self) -> None:
        if self.decoder is not None:
            print(flush=True)


def run(args: argparse.Namespace) -> int:
    if args.no_jax_cache:
        os.environ[JAX_CACHE_VARIABLE] = "0"
    given = read_inputs(args, args.framework, args.mode)
    warn_unused(args, args.mode == "speculative")
    use_threads(given.inputs.threads)
    loaded = load_model(
        args.framework,
        given.config,
        given.tensors,
        args.dtype,
        args.device,
        quant=args.quant,
        tensor_parallel=args.tensor_parallel,
    )
    if given.draft is not None:
        loaded.add_draft(args.draft, *given.draft)
    stream = Stream(given.prompts.shape[0], given.tokenizer, args.json) if args.stream else None
    # A listener times the first token; but a listener sends JAX to its stepwise loop, so without
    # --stream a compiling port keeps its one compiled loop, and its first token goes untimed.
    listen = stream is not None or args.framework not in registry.COMPILES
    heard = stream if stream is not None else (lambda token: None) if listen else None
    result = generate(loaded, given.prompts, given.inputs, on_token=heard, tokenizer=given.tokenizer)
    if stream is not None:
        stream.close()
    generation = given.inputs.generation
    speed = speed_of(result)
    if args.json:
        output: dict[str, Any] = {
            "framework": args.framework,
            "mode": args.mode,
            "dtype": args.dtype,
            "quant": args.quant,
            "linear_route": loaded.route,
            "device": args.device,
            "threads": given.inputs.threads,
            "family": given.config.family,
            "tensor_parallel": args.tensor_parallel,
            "generation": dataclasses.asdict(generation),
            "tokens": result.tokens,
            "finish_reason": result.finish_reason,
            "seconds": result.seconds,
            **speed,
        }
        if args.tensor_parallel > 1:
            output["tensor_parallel_layout"] = tensor_parallel_layout(given.config, args.tensor_parallel)
        if result.speculative is not None:
            output["speculative"] = result.speculative
        if result.text is not None:
            output["text"] = result.text
            output["answer"] = answers(given.tokenizer, result.generated)
        if result.logprobs is not None:
            output["logprobs"] = result.logprobs
        print(json.dumps(output))
        return 0
    print(
        f"{args.framework} {args.mode} {format_name(args.dtype, args.quant)} via {loaded.route} on the {args.device}, "
        f"{describe(given.config)}, "
        f"{describe_generation(generation)}, {args.new_tokens} new tokens at most, "
        f"{describe_threads(given.inputs.threads)}, in {result.seconds:.3f} s"
    )
    if args.tensor_parallel > 1:
        print(f"  tensor parallel: {tensor_parallel_layout(given.config, args.tensor_parallel)}")
    for index, (row, generated) in enumerate(zip(result.tokens, result.generated, strict=True)):
        print(f"  prompt    {' '.join(map(str, row[: len(row) - len(generated)]))}")
        print(f"  generated {' '.join(map(str, generated))}  ({result.finish_reason[index]})")
        if result.text is not None and not (stream is not None and stream.shows_text):  # streamed: shown once
            print(f"  text      {result.text[index]}")
            print(f"  answer    {answers(given.tokenizer, [generated])[0]}")
        if result.logprobs is not None:
            for line in logprob_lines(result.logprobs[index]):
                print(line)
    summary = result.speculative
    if summary is not None:
        print(
            f"  speculative: draft {summary['draft']}, K = {summary['draft_tokens']}: {summary['accepted']} of "
            f"{summary['proposed']} proposals accepted ({summary['acceptance_rate']:.0%}), "
            f"{summary['target_forwards']} target forwards, {summary['target_forwards_per_token']:.2f} per token"
        )
    first = speed["first_token_seconds"]
    print(
        f"time to first token {first:.3f} s"
        if first is not None
        else f"time to first token not measured ({args.framework}'s compiled loop returns every token at once; "
        "--stream measures it)",
        f"{speed['tokens_per_second']:.1f} tokens/s",
        sep=", ",
        file=sys.stderr,
    )
    return 0


def speed_of(result: Generation) -> dict[str, float | None]:
    """Time to the first token (None where nothing listened for it), and the tokens every row
    generated per second of the whole run."""
    made = sum(len(row) for row in result.generated)
    return {"first_token_seconds": result.first_token_seconds, "tokens_per_second": made / result.seconds}


def answers(tokenizer: Any, generated: list[list[int]]) -> list[str]:
    """Each row's generated tokens as text, without special tokens (the end of turn a chat stops at)."""
    from kvports.formats.hf.text import decode_answer

    return [decode_answer(tokenizer, row) for row in generated]


def describe_generation(generation: GenerationConfig) -> str:
    how = "greedy" if generation.greedy else f"sampled at temperature {generation.temperature:g}"
    if not generation.greedy and generation.top_k:
        how += f", top-k {generation.top_k}"
    if not generation.greedy and generation.top_p < 1:
        how += f", top-p {generation.top_p:g}"
    if not generation.greedy:
        how += (
            f", seed {generation.seed}" if not generation.seeds else f", seeds {', '.join(map(str, generation.seeds))}"
        )
    if generation.stop_ids:
        how += f", stop at {', '.join(map(str, generation.stop_ids))}"
    return how


def logprob_lines(steps: list[dict[str, Any]]) -> list[str]:
    """One row's --logprobs, a line per step: the token (and its text, with a tokenizer) and its
    log-probability, then the likeliest tokens of that step, rounded to 4 decimals (the ports
    differ in float rounding only)."""
    return [
        f"    step {step:>4}  {entry['token']:>6}{spelled(entry)} {entry['logprob']:9.4f}   top: "
        + ", ".join(
            f"{alternative['token']}{spelled(alternative)} {alternative['logprob']:.4f}" for alternative in entry["top"]
        )
        for step, entry in enumerate(steps)
    ]


def spelled(entry: dict[str, Any]) -> str:
    """A token's text beside its id, quoted as JSON quotes it (a space or a newline shows): ' "Hello"'."""
    return f" {json.dumps(entry['text'], ensure_ascii=False)}" if "text" in entry else ""


def json_schema_file(text: str) -> ResponseFormat:
    """--json-schema FILE: a regular file of at most MAX_SCHEMA_BYTES holding one JSON schema (an
    object), read as strict JSON; whether structured output can follow it is `check_request`'s."""
    path = Path(text)
    try:
        if not path.is_file():
            raise argparse.ArgumentTypeError(f"{echo(text)} is not a regular file")
        size = path.stat().st_size
        if size > MAX_SCHEMA_BYTES:
            raise OutOfRange(f"{echo(text)} is {size} bytes, above {MAX_SCHEMA_BYTES}")
        with path.open("rb") as file:
            raw = file.read(MAX_SCHEMA_BYTES + 1)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {echo(text)} ({exc.strerror or exc})") from None
    try:
        schema = json.loads(raw.decode("utf-8"), parse_constant=no_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"{echo(text)} is not valid JSON ({str(exc).splitlines()[0][:120]})") from None
    try:
        return constraint.json_schema(schema)
    except UserError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")
