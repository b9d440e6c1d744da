"""`kvports generate`: one framework, one mode (naive, cached or speculative), greedy or
sampled, with stop tokens, prompts of different lengths and streaming."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
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
from kvports.shared.config import ModelConfig
from kvports.shared.contract import Port
from kvports.shared.devices import add_device_argument, check_device
from kvports.shared.errors import UserError
from kvports.shared.families import describe
from kvports.shared.generation import PAD, GenerationConfig, finish_reasons, row_tokens

HELP = "generate with one framework and mode: greedy or sampled, stop tokens, streaming"
MODES = ("naive", "cached", "speculative")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--framework", choices=ports.PORTS, required=True)
    parser.add_argument("--mode", choices=MODES, required=True)
    add_input_arguments(parser)
    add_device_argument(parser)
    add_text_arguments(parser)
    add_generation_arguments(parser)
    add_speculative_arguments(parser)
    parser.add_argument(
        "--stream", action="store_true", help="print tokens as they are made (with --json: one JSON line per step)"
    )


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


def load_port_for(args: argparse.Namespace) -> Port:
    """The framework --framework names, on the device --device names: a missing one is an error."""
    try:
        port = ports.load_port(args.framework)
    except ports.PortUnavailable as exc:
        raise UserError(str(exc)) from None
    check_device(port, args.device)
    return port


@dataclass
class Generated:
    tokens: np.ndarray  # [B, P + N], PAD after a row stops
    logits: np.ndarray | None  # [B, steps, V] when asked for (naive and cached only)
    counts: dict[str, int] | None  # speculative: rounds, target_forwards, proposed, accepted
    seconds: float  # until the device was done, the draft model's loading excluded


def run_generation(
    port: Port,
    model: Any,
    prompts: np.ndarray,
    generation: GenerationConfig,
    args: argparse.Namespace,
    draft_weights: tuple[ModelConfig, dict[str, np.ndarray]] | None,
    return_logits: bool = False,
    on_token: Callable[[np.ndarray], None] | None = None,
) -> Generated:
    """One generation as `generate` (and the Python API) runs it: --mode, and the draft for speculative."""
    if args.mode == "speculative":
        draft = None if draft_weights is None else port.load_model(*draft_weights, args.dtype, args.device)
        start = time.perf_counter()
        tokens, counts = port.generate_speculative(
            model, draft, prompts, generation, args.draft_tokens, args.ngram, on_token=on_token
        )
        logits = None
    else:
        start = time.perf_counter()
        tokens, logits = port.generate(model, prompts, generation, args.mode, return_logits, on_token=on_token)
        counts = None
    port.synchronize(model)
    return Generated(tokens, logits, counts, time.perf_counter() - start)


def run(args: argparse.Namespace) -> int:
    config, tensors, prompts = load_inputs(args)
    generation = generation_from(args, config)
    draft_weights = load_draft(args, config, prompts) if args.mode == "speculative" else None
    tokenizer = load_text_tokenizer(args, config)  # loaded and checked by load_inputs
    port = load_port_for(args)
    model = port.load_model(config, tensors, args.dtype, args.device)
    stream = Stream(prompts.shape[0], tokenizer, args.json) if args.stream else None
    generated = run_generation(port, model, prompts, generation, args, draft_weights, on_token=stream)
    tokens, counts, seconds = generated.tokens, generated.counts, generated.seconds
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
            "device": args.device,
            "family": config.family,
            "generation": dataclasses.asdict(generation),
            "tokens": rows,
            "finish_reason": reasons,
            "seconds": seconds,
        }
        if counts is not None:
            result["speculative"] = speculative_summary(counts, str(args.draft), args.draft_tokens, tokens, P)
        if texts is not None:
            result["text"] = texts
        print(json.dumps(result))
        return 0
    print(
        f"{args.framework} {args.mode} {args.dtype} on the {args.device}, {describe(config)}, "
        f"{describe_generation(generation)}, {args.new_tokens} new tokens at most, in {seconds:.3f} s"
    )
    for index, (row, prompt) in enumerate(zip(rows, prompt_rows, strict=True)):
        print(f"  prompt    {' '.join(map(str, prompt))}")
        print(f"  generated {' '.join(map(str, row[len(prompt) :]))}  ({reasons[index]})")
        if texts is not None:
            print(f"  text      {texts[index]}")
    if counts is not None:
        summary = speculative_summary(counts, str(args.draft), args.draft_tokens, tokens, P)
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


def speculative_summary(counts: dict[str, int], draft: str, draft_tokens: int, tokens: np.ndarray, P: int) -> dict:
    """The counts a user wants: proposals, acceptances, their rate, and target forwards per
    generated token (of the longest row: every row moves with the batch). draft: "ngram" or the
    draft's weights file."""
    generated = int((tokens[:, P:] != PAD).sum(axis=1).max())
    return {
        "draft": draft,
        "draft_tokens": draft_tokens,
        **counts,
        "acceptance_rate": counts["accepted"] / counts["proposed"] if counts["proposed"] else 0.0,
        "target_forwards_per_token": counts["target_forwards"] / max(generated, 1),
    }
