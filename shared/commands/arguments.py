"""The flags `generate` and `compare` share (weights, prompts, text, sampling), and what they
turn into: the run layer's typed inputs (`shared.run.RunInputs`), the model read and the
prompts checked by `shared.run` and `shared.checks`, before any port is imported."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvports.shared import run
from kvports.shared.arguments import (
    add_quant_argument,
    add_weights_arguments,
    non_negative_int,
    number,
    positive_int,
    seed,
)
from kvports.shared.checks import (
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    SEED_PROMPT,
    check_draft_source,
    check_stop_flags,
    check_text_flags,
    parse_prompt,
)
from kvports.shared.config import DTYPES, ModelConfig
from kvports.shared.generation import GenerationConfig
from kvports.shared.weights import open_weights


def add_input_arguments(parser: argparse.ArgumentParser) -> None:
    add_weights_arguments(parser)
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
    add_quant_argument(parser)
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


def add_generation_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling and stopping (the same tokens in every framework)")
    group.add_argument(
        "--temperature",
        type=number,
        default=0.0,
        help=f"0 (default): greedy; else sample, in [{MIN_TEMPERATURE:.3g}, {MAX_TEMPERATURE:g}] "
        "(logits divided by less lose float64's exactness)",
    )
    group.add_argument(
        "--top-k",
        type=non_negative_int,
        default=0,
        metavar="K",
        help="sample from the K likeliest tokens (0: all); greedy (temperature 0) ignores it, with a warning",
    )
    group.add_argument(
        "--top-p",
        type=number,
        default=1.0,
        metavar="P",
        help="sample from the fewest likeliest tokens whose probability reaches P (1: all); greedy (temperature 0) "
        "ignores it, with a warning",
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


@dataclass(frozen=True)
class CommandInputs:
    """What `generate` and `compare` run: the typed inputs, the model read and the prompts checked."""

    inputs: run.RunInputs
    config: ModelConfig
    tensors: run.Tensors
    prompts: np.ndarray  # [B, P], left-padded
    tokenizer: Any  # None without --tokenizer
    draft: tuple[ModelConfig, run.Tensors] | None  # a draft model's config and tensors (speculative with a file)


def read_inputs(
    args: argparse.Namespace, framework: str, mode: str, modes: Sequence[str] | None = None
) -> CommandInputs:
    """The flags as typed inputs, checked once against the model (its header: before any tensor
    is read), then the weights and any draft read. `modes`: the modes the command runs (default: `mode`)."""
    draft = draft_of(args)
    wanted = None if draft is None or draft.source == "ngram" else draft.source
    if wanted is None or "speculative" not in (modes if modes is not None else [mode]):
        return read_checked(args, framework, mode, modes, None)
    check_draft_source(wanted)
    with open_weights(Path(wanted)) as file:  # its header is checked with the rest, before any tensor is read
        given = read_checked(args, framework, mode, modes, file.config)
        return dataclasses.replace(given, draft=(file.config, file.read(args.dtype)))


def read_checked(
    args: argparse.Namespace, framework: str, mode: str, modes: Sequence[str] | None, draft: ModelConfig | None
) -> CommandInputs:
    def check(config: ModelConfig) -> tuple[run.RunInputs, Any, np.ndarray]:
        tokenizer = text_tokenizer(args, config)
        inputs = run.RunInputs(
            framework, mode, generation_of(args, config), args.weights, args.dtype, args.device, draft_of(args)
        )
        inputs = dataclasses.replace(inputs, quant=args.quant)
        rows = prompt_rows(args, tokenizer)
        return inputs, tokenizer, run.check_inputs(inputs, config, rows, modes=modes, draft=draft)

    config, tensors, checked = run.read_model(args.weights, args.dtype, check, args.quant)
    assert checked is not None
    inputs, tokenizer, prompts = checked
    return CommandInputs(inputs, config, tensors, prompts, tokenizer, None)


def warn_unused(args: argparse.Namespace, speculative: bool) -> None:
    """Flags given that change nothing in this run: one `warning:` line on stderr, and the run goes on
    (exit 0). speculative: whether the run has a speculative mode, the one --draft serves."""
    unused = []
    if args.temperature == 0:
        flags = [flag for flag, given in (("--top-k", args.top_k != 0), ("--top-p", args.top_p != 1)) if given]
        if flags:
            unused.append(f"{' and '.join(flags)} {'does' if len(flags) == 1 else 'do'} nothing without --temperature")
    if args.draft is not None and not speculative:
        unused.append("--draft does nothing without --mode speculative")
    if unused:
        print(f"warning: {'; '.join(unused)}", file=sys.stderr)


def draft_of(args: argparse.Namespace) -> run.Draft | None:
    return None if args.draft is None else run.Draft(args.draft, args.draft_tokens, args.ngram)


def generation_of(args: argparse.Namespace, config: ModelConfig) -> GenerationConfig:
    """The sampling and stopping flags as one GenerationConfig (checked by `run.check_inputs`)."""
    check_stop_flags(args.stop_id, args.no_stop)
    stops = () if args.no_stop else tuple(args.stop_id) if args.stop_id else config.eos_token_ids
    return GenerationConfig(
        args.new_tokens, args.temperature, args.top_k, args.top_p, args.seed, tuple(dict.fromkeys(stops))
    )


def text_tokenizer(args: argparse.Namespace, config: ModelConfig) -> Any:
    """The tokenizer --text, --chat and decoded output need, checked against the model's
    vocabulary: --tokenizer DIR's, else a GGUF weights file's own; None when there is neither."""
    from kvports.shared.gguf.tokenizer import gguf_tokenizer, has_tokenizer

    tokenizer_dir: Path | None = getattr(args, "tokenizer", None)
    weights: Path | None = args.weights
    in_file = tokenizer_dir is None and weights is not None and has_tokenizer(weights)
    check_text_flags(getattr(args, "text", None), tokenizer_dir or in_file, args.prompt, chat_given(args))
    from kvports.shared.hf.text import check_vocabulary, load_tokenizer

    if tokenizer_dir is not None:
        return check_vocabulary(load_tokenizer(tokenizer_dir), config.vocab_size)
    if weights is not None and in_file:
        return check_vocabulary(gguf_tokenizer(weights), config.vocab_size)
    return None


def chat_given(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "chat", None)) or getattr(args, "chat_file", None) is not None


def prompt_rows(args: argparse.Namespace, tokenizer: Any) -> list[list[int]]:
    """--chat rendered in the model's own template, --text encoded, or --prompt's ids, or the seed's prompt."""
    if chat_given(args):
        from kvports.shared.chat import chat_ids, chat_messages

        messages = chat_messages(args.chat, args.chat_file)
        assert messages is not None and args.weights is not None  # check_text_flags: a chat needs a GGUF file
        return [chat_ids(args.weights, messages, tokenizer)]
    if getattr(args, "text", None) is not None:
        from kvports.shared.hf.text import encode

        return encode(tokenizer, args.text)
    texts = args.prompt if args.prompt else [",".join(map(str, SEED_PROMPT))]
    return [parse_prompt(text) for text in texts]
