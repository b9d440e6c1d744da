"""`kvports generate`: one framework, one mode (naive, cached or speculative), greedy or
sampled, with stop tokens, prompts of different lengths and streaming."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

import numpy as np

from kvports.shared import ports
from kvports.shared.commands.arguments import (
    add_generation_arguments,
    add_input_arguments,
    add_speculative_arguments,
    add_text_arguments,
    generation_from,
    load_draft,
    load_inputs,
    load_text_tokenizer,
)
from kvports.shared.contract import Port
from kvports.shared.errors import UserError
from kvports.shared.families import describe
from kvports.shared.generation import PAD, GenerationConfig, finish_reasons, row_tokens

HELP = "generate with one framework and mode: greedy or sampled, stop tokens, streaming"
MODES = ("naive", "cached", "speculative")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--framework", choices=ports.PORTS, required=True)
    parser.add_argument("--mode", choices=MODES, required=True)
    add_input_arguments(parser)
    add_text_arguments(parser)
    add_generation_arguments(parser)
    add_speculative_arguments(parser)
    parser.add_argument(
        "--stream", action="store_true", help="print tokens as they are made (with --json: one JSON line per step)"
    )


def timed_generate(
    port: Port, model: Any, prompts: np.ndarray, generation: int | GenerationConfig, mode: str, return_logits: bool
) -> tuple[np.ndarray, np.ndarray | None, float]:
    """(tokens, logits or None, seconds until the device is done)."""
    start = time.perf_counter()
    tokens, logits = port.generate(model, prompts, generation, mode, return_logits=return_logits)
    port.synchronize(model)
    return tokens, logits, time.perf_counter() - start


class Stream:
    """on_token for --stream: each step's tokens as they reach the host. One row with a
    tokenizer prints its text as it grows; otherwise one line per step (`-` for a row that
    has stopped), or with --json one JSON object per line."""

    def __init__(self, batch: int, tokenizer: Any, as_json: bool):
        self.batch, self.tokenizer, self.as_json = batch, tokenizer, as_json
        self.step, self.shown = 0, ""
        self.generated: list[int] = []

    def __call__(self, token: np.ndarray) -> None:
        ids = [int(t) for t in token]
        if self.as_json:
            print(json.dumps({"step": self.step, "tokens": ids}), flush=True)
        elif self.batch == 1 and self.tokenizer is not None:
            from kvports.shared.hf.text import decode

            if ids[0] != PAD:
                self.generated.append(ids[0])
                text = decode(self.tokenizer, self.generated)  # the whole text again: pieces may merge
                print(text[len(self.shown) :], end="", flush=True)
                self.shown = text
        else:
            print(f"  step {self.step:>4}  " + " ".join("-" if t == PAD else str(t) for t in ids), flush=True)
        self.step += 1

    def close(self) -> None:
        if not self.as_json and self.batch == 1 and self.tokenizer is not None:
            print(flush=True)


def run(args: argparse.Namespace) -> int:
    config, tensors, prompts = load_inputs(args)
    generation = generation_from(args, config)
    draft_weights = load_draft(args, config, prompts) if args.mode == "speculative" else None
    tokenizer = load_text_tokenizer(args, config)  # loaded and checked by load_inputs
    try:
        port = ports.load_port(args.framework)
    except ports.PortUnavailable as exc:
        raise UserError(str(exc)) from None
    model = port.load_model(config, tensors, args.dtype)
    stream = Stream(prompts.shape[0], tokenizer, args.json) if args.stream else None
    counts = None
    start = time.perf_counter()
    if args.mode == "speculative":
        draft = None if draft_weights is None else port.load_model(*draft_weights, args.dtype)
        start = time.perf_counter()
        tokens, counts = port.generate_speculative(
            model, draft, prompts, generation, args.draft_tokens, args.ngram, on_token=stream
        )
    else:
        tokens, _ = port.generate(model, prompts, generation, args.mode, on_token=stream)
    port.synchronize(model)
    seconds = time.perf_counter() - start
    if stream is not None:
        stream.close()
    P = prompts.shape[1]
    rows, reasons = row_tokens(tokens), finish_reasons(tokens, P, generation.stop_ids)
    prompt_rows = row_tokens(prompts)
    texts = None
    if tokenizer is not None:
        from kvports.shared.hf.text import decode

        texts = [decode(tokenizer, row) for row in rows]  # prompt and generated, as `tokens` holds them
    if args.json:
        result: dict[str, Any] = {
            "framework": args.framework,
            "mode": args.mode,
            "dtype": args.dtype,
            "family": config.family,
            "generation": dataclasses.asdict(generation),
            "tokens": rows,
            "finish_reason": reasons,
            "seconds": seconds,
        }
        if counts is not None:
            result["speculative"] = speculative_summary(counts, args, tokens, P)
        if texts is not None:
            result["text"] = texts
        print(json.dumps(result))
        return 0
    print(
        f"{args.framework} {args.mode} {args.dtype}, {describe(config)}, {describe_generation(generation)}, "
        f"{args.new_tokens} new tokens at most, in {seconds:.3f} s"
    )
    for index, (row, prompt) in enumerate(zip(rows, prompt_rows, strict=True)):
        print(f"  prompt    {' '.join(map(str, prompt))}")
        print(f"  generated {' '.join(map(str, row[len(prompt) :]))}  ({reasons[index]})")
        if texts is not None:
            print(f"  text      {texts[index]}")
    if counts is not None:
        summary = speculative_summary(counts, args, tokens, P)
        print(
            f"  speculative: draft {summary['draft']}, K = {summary['draft_tokens']}: {summary['accepted']} of "
            f"{summary['proposed']} proposals accepted ({summary['acceptance_rate']:.0%}), "
            f"{summary['target_forwards']} target forwards, {summary['target_forwards_per_token']:.2f} per token"
        )
    return 0


def describe_generation(generation: GenerationConfig) -> str:
    how = "greedy" if generation.greedy else f"sampled at temperature {generation.temperature:g}"
    if not generation.greedy and generation.top_k:
        how += f", top-k {generation.top_k}"
    if not generation.greedy and generation.top_p < 1:
        how += f", top-p {generation.top_p:g}"
    if not generation.greedy:
        how += f", seed {generation.seed}"
    if generation.stop_ids:
        how += f", stop at {', '.join(map(str, generation.stop_ids))}"
    return how


def speculative_summary(counts: dict[str, int], args: argparse.Namespace, tokens: np.ndarray, P: int) -> dict:
    """The counts a user wants: proposals, acceptances, their rate, and target forwards per
    generated token (of the longest row: every row moves with the batch)."""
    generated = int((tokens[:, P:] != PAD).sum(axis=1).max())
    return {
        "draft": "ngram" if args.draft == "ngram" else args.draft,
        "draft_tokens": args.draft_tokens,
        **counts,
        "acceptance_rate": counts["accepted"] / counts["proposed"] if counts["proposed"] else 0.0,
        "target_forwards_per_token": counts["target_forwards"] / max(generated, 1),
    }
