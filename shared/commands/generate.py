"""`kvports generate`: greedy generation with one framework and mode."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np

from kvports.shared import ports
from kvports.shared.commands.arguments import add_input_arguments, add_text_arguments, load_inputs, load_text_tokenizer
from kvports.shared.contract import Port
from kvports.shared.errors import UserError
from kvports.shared.families import describe

HELP = "greedy generation with one framework and mode"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--framework", choices=ports.PORTS, required=True)
    parser.add_argument("--mode", choices=("naive", "cached"), required=True)
    add_input_arguments(parser)
    add_text_arguments(parser)


def timed_generate(
    port: Port, model: Any, prompts: np.ndarray, new_tokens: int, mode: str, return_logits: bool
) -> tuple[np.ndarray, np.ndarray | None, float]:
    """(tokens, logits or None, seconds until the device is done)."""
    start = time.perf_counter()
    tokens, logits = port.generate(model, prompts, new_tokens, mode, return_logits=return_logits)
    port.synchronize(model)
    return tokens, logits, time.perf_counter() - start


def run(args: argparse.Namespace) -> int:
    config, tensors, prompts = load_inputs(args)
    tokenizer = load_text_tokenizer(args)
    try:
        port = ports.load_port(args.framework)
    except ports.PortUnavailable as exc:
        raise UserError(str(exc)) from None
    model = port.load_model(config, tensors, args.dtype)
    tokens, _, seconds = timed_generate(port, model, prompts, args.new_tokens, args.mode, False)
    texts = None
    if tokenizer is not None:
        from kvports.shared.hf.text import decode

        texts = [decode(tokenizer, row) for row in tokens]
    if args.json:
        result = {
            "framework": args.framework,
            "mode": args.mode,
            "dtype": args.dtype,
            "family": config.family,
            "tokens": tokens.tolist(),
            "seconds": seconds,
        }
        if texts is not None:
            result["text"] = texts
        print(json.dumps(result))
        return 0
    P = prompts.shape[1]
    print(
        f"{args.framework} {args.mode} {args.dtype}, {describe(config)}, {args.new_tokens} new tokens in "
        f"{seconds:.3f} s"
    )
    for index, (row, prompt) in enumerate(zip(tokens, prompts, strict=True)):
        print(f"  prompt    {' '.join(map(str, prompt))}")
        print(f"  generated {' '.join(map(str, row[P:]))}")
        if texts is not None:
            print(f"  text      {texts[index]}")
    return 0
