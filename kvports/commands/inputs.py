"""The flags `generate` and `compare` share (weights, prompts, text, sampling), and what they
turn into: the run layer's typed inputs (`kvports.generating.RunInputs`), the model read and the
prompts checked by `kvports.generating` and `shared.checks`, before any port is imported."""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvports import generating, loading
from kvports.flags import (
    add_quant_argument,
    add_tensor_parallel_argument,
    add_threads_argument,
    add_weights_arguments,
    non_negative_int,
    number,
    positive_int,
    seeds,
)
from kvports.shared.checks import MAX_TEMPERATURE, MIN_TEMPERATURE
from kvports.shared.config import DTYPES, ModelConfig
from kvports.shared.errors import UserError
from kvports.shared.generation import GenerationConfig
from kvports.validation import SEED_PROMPT, check_draft_source, check_stop_flags, check_text_flags, parse_prompt


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
    add_tensor_parallel_argument(parser)
    add_threads_argument(parser)
    parser.add_argument(
        "--prompt-file",
        default=None,
        metavar="FILE",
        help="prompts from FILE ('-': stdin), one a line, token ids separated by commas or spaces",
    )


def add_text_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--text",
        action="append",
        default=None,
        help="prompt text, encoded with --tokenizer (or a GGUF file's own tokenizer); repeat for a batch",
    )
    parser.add_argument(
        "--text-file",
        default=None,
        metavar="FILE",
        help="prompt texts from FILE ('-': stdin), one a line, encoded as --text",
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
        "--seed",
        type=seeds,
        default=(0,),
        metavar="S[,S...]",
        help="the draws' seed: the same seed, the same tokens everywhere, whatever a row's place in the batch; "
        "or one per prompt, comma-separated",
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

    inputs: generating.RunInputs
    config: ModelConfig
    tensors: loading.Tensors
    prompts: np.ndarray  # [B, P], left-padded
    tokenizer: Any  # None without --tokenizer
    draft: tuple[ModelConfig, loading.Tensors] | None  # a draft model's config and tensors (speculative with a file)
    unable: dict[str, str]  # frameworks asked for that cannot run it -> the reason their rows give (compare)


def read_inputs(
    args: argparse.Namespace,
    framework: str,
    mode: str,
    modes: Sequence[str] | None = None,
    frameworks: Sequence[str] | None = None,
) -> CommandInputs:
    """The flags as typed inputs, checked once against the model (its header: before any tensor
    is read), then the weights and any draft read. `modes`: the modes the command runs (default:
    `mode`); `frameworks`: the frameworks it runs (default: `framework`)."""
    read_prompt_files(args)
    draft = draft_of(args)
    wanted = None if draft is None or draft.source == "ngram" else draft.source
    if wanted is None or "speculative" not in (modes if modes is not None else [mode]):
        return read_checked(args, framework, mode, modes, None, frameworks)
    check_draft_source(wanted)
    with loading.open_model(Path(wanted)) as file:  # its header is checked with the rest, before any tensor is read
        draft_config = loading.header(file, args.dtype)
        given = read_checked(args, framework, mode, modes, draft_config, frameworks)
        return dataclasses.replace(given, draft=(draft_config, loading.read_tensors(file, args.dtype)))


def read_checked(
    args: argparse.Namespace,
    framework: str,
    mode: str,
    modes: Sequence[str] | None,
    draft: ModelConfig | None,
    frameworks: Sequence[str] | None,
) -> CommandInputs:
    """The flags checked against the model's header, then its tensors read."""
    with loading.open_model(args.weights) as file:
        config = loading.header(file, args.dtype)
        tokenizer = text_tokenizer(args, config)
        inputs = generating.RunInputs(
            framework,
            mode,
            generation_of(args, config),
            args.weights,
            args.dtype,
            args.device,
            draft_of(args),
            quant=args.quant,
            tensor_parallel=args.tensor_parallel,
            threads=args.threads,
            logprobs=getattr(args, "logprobs", 0),
            response_format=getattr(args, "json_schema", None),
        )
        inputs, rows = generating.with_samples(inputs, prompt_rows(args, tokenizer), getattr(args, "num_samples", 1))
        check_default_prompt(args, config)
        if inputs.response_format is not None and tokenizer is None:
            raise UserError("--json-schema needs the model's tokenizer: a GGUF file's own, or --tokenizer DIR")
        checked = generating.check_inputs(inputs, config, rows, modes=modes, draft=draft, frameworks=frameworks)
        tensors = loading.read_tensors(file, args.dtype, args.quant)
    return CommandInputs(inputs, config, tensors, checked.prompts, tokenizer, None, checked.unable)


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


def draft_of(args: argparse.Namespace) -> generating.Draft | None:
    return None if args.draft is None else generating.Draft(args.draft, args.draft_tokens, args.ngram)


def generation_of(args: argparse.Namespace, config: ModelConfig) -> GenerationConfig:
    """The sampling and stopping flags as one GenerationConfig (checked by `generating.check_inputs`)."""
    check_stop_flags(args.stop_id, args.no_stop)
    stops = () if args.no_stop else tuple(args.stop_id) if args.stop_id else config.eos_token_ids
    row_seeds = tuple(args.seed)
    return GenerationConfig(
        args.new_tokens,
        args.temperature,
        args.top_k,
        args.top_p,
        row_seeds[0],
        tuple(dict.fromkeys(stops)),
        seeds=row_seeds if len(row_seeds) > 1 else (),
    )


def text_tokenizer(args: argparse.Namespace, config: ModelConfig) -> Any:
    """The tokenizer --text, --chat and decoded output need, checked against the model's
    vocabulary: --tokenizer DIR's, else a GGUF weights file's own; None when there is neither."""
    from kvports.formats.gguf.tokenizer import has_tokenizer

    tokenizer_dir: Path | None = getattr(args, "tokenizer", None)
    weights: Path | None = args.weights
    in_file = (
        tokenizer_dir is None
        and weights is not None
        and (has_tokenizer(weights) or loading.tokenizer_beside(weights) is not None)  # a GGUF file's, or convert's
    )
    check_text_flags(getattr(args, "text", None), tokenizer_dir or in_file, args.prompt, chat_given(args))
    from kvports.formats.hf.text import check_vocabulary, load_tokenizer

    if tokenizer_dir is not None:
        return check_vocabulary(load_tokenizer(tokenizer_dir), config.vocab_size)
    return loading.model_tokenizer(weights, config) if in_file else None


def chat_given(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "chat", None)) or getattr(args, "chat_file", None) is not None


def prompt_rows(args: argparse.Namespace, tokenizer: Any) -> list[list[int]]:
    """--chat rendered in the model's own template, --text encoded, or --prompt's ids, or the seed's prompt."""
    if chat_given(args):
        from kvports.formats.chat import chat_ids, chat_messages

        messages = chat_messages(args.chat, args.chat_file)
        assert messages is not None and args.weights is not None  # check_text_flags: a chat needs a GGUF file
        return [chat_ids(args.weights, messages, tokenizer)]
    if getattr(args, "text", None) is not None:
        from kvports.formats.hf.text import encode

        return encode(tokenizer, args.text)
    texts = args.prompt if args.prompt else [",".join(map(str, SEED_PROMPT))]
    return [parse_prompt(text) for text in texts]


def check_default_prompt(args: argparse.Namespace, config: ModelConfig) -> None:
    """The seed's prompt, the default, is the seed's ids: another model's vocabulary may not hold them."""
    given = args.prompt or getattr(args, "text", None) is not None or chat_given(args)
    if not given and max(SEED_PROMPT) >= config.vocab_size:
        raise UserError(
            f"the default prompt is the seed model's ids {','.join(map(str, SEED_PROMPT))}, outside this model's "
            f"vocabulary [0, {config.vocab_size}): give --prompt IDS or --text TEXT"
        )


def read_prompt_files(args: argparse.Namespace) -> None:
    """--prompt-file and --text-file become --prompt and --text, a line each; every bad line of a
    prompt file is its own `error:` line naming its number."""
    from kvports.limits import read_lines

    if getattr(args, "prompt_file", None) is not None:
        if args.prompt:
            raise UserError("give --prompt or --prompt-file, not both")
        args.prompt, bad = [], []
        for number, line in read_lines(args.prompt_file, "--prompt-file"):
            try:
                ids = parse_prompt(",".join(part for part in re.split(r"[\s,]+", line.strip()) if part))
            except UserError as exc:
                bad.append(f"--prompt-file line {number}: {exc}")
                continue
            args.prompt.append(",".join(map(str, ids)))
        for line in bad[:-1]:  # one `error:` line each, as `kvports batch` reports its bad lines
            print(f"error: {line}", file=sys.stderr)
        if bad:
            raise UserError(bad[-1])
    if getattr(args, "text_file", None) is not None:
        if args.text is not None:
            raise UserError("give --text or --text-file, not both")
        args.text = [line for _, line in read_lines(args.text_file, "--text-file")]
