"""Request files: one JSON object a line, each a `request.Request` checked by `check_request` before
any framework code runs.

A line holds a prompt as token ids (`"prompt": [1, 2, 3]`), as text (`"text": "..."`,
encoded with --tokenizer) or as a chat (`"messages": [{"role": "user", "content": "..."}]`,
rendered with a GGUF file's chat template, as `kvports generate --chat-file` does), and
optionally `id`, `max_new_tokens`, `temperature`, `top_k`,
`top_p`, `seed` and `stop_ids` (`kvports generate`'s settings; without `stop_ids`, the
model's eos ids, as `kvports generate` stops), and `response_format` (OpenAI's object, as the
server takes it: the answer JSON; it needs the model's tokenizer). A bad line is one error
naming its line number; the other lines still run.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvports.batching.constraint import parse_response_format
from kvports.batching.request import Chat, Request, chat_prompt, check_request
from kvports.shared.checks import BATCH_LINE
from kvports.shared.config import ModelConfig
from kvports.shared.errors import UserError, echo
from kvports.shared.generation import GenerationConfig

SETTINGS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop_ids")
FIELDS = ("id", "prompt", "text", "messages", *SETTINGS, "response_format")

Encode = Callable[[str], list[int]]


@dataclass(frozen=True)
class BadLine:
    line: int  # 1-based, as an editor counts
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


def parse_line(
    text: str,
    line: int,
    default_new_tokens: int,
    default_stops: tuple[int, ...],
    encode: Encode | None,
    chat: Chat | None = None,
) -> Request:
    """One line as a Request (not yet checked against a model), or a UserError."""
    try:
        data = json.loads(text)
    except RecursionError:
        raise UserError("not valid JSON (nested too deeply)") from None
    except ValueError as exc:
        raise UserError(f"not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise UserError(f"a request is a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise UserError(f"unknown field {echo(unknown[0])} (known: {', '.join(FIELDS)})")
    if sum(name in data for name in ("prompt", "text", "messages")) != 1:
        raise UserError("give exactly one of 'prompt' (token ids), 'text' and 'messages' (a chat)")
    if "messages" in data:
        if chat is None:
            raise UserError("'messages' renders a GGUF file's chat template: give --model NAME or --weights FILE.gguf")
        prompt = chat_prompt(data["messages"], chat, BATCH_LINE)
    elif "text" in data:
        if not isinstance(data["text"], str):
            raise UserError(f"'text' must be a string, got {type(data['text']).__name__}")
        if encode is None:
            raise UserError("a 'text' prompt needs --tokenizer DIR")
        try:
            data["text"].encode("utf-8")
        except UnicodeEncodeError:  # JSON allows a lone surrogate escape, which no tokenizer takes
            raise UserError(f"'text' {echo(data['text'])} is not valid UTF-8") from None
        prompt = encode(data["text"])
    else:
        if not isinstance(data["prompt"], list):
            raise UserError(f"'prompt' must be a list of token ids, got {type(data['prompt']).__name__}")
        prompt = data["prompt"]
    response_format = parse_response_format(data.get("response_format"), BATCH_LINE)
    if response_format is not None and encode is None:
        raise UserError("'response_format' needs the model's tokenizer (a GGUF file's own, or --tokenizer DIR)")
    request_id = data.get("id", str(line))
    if not isinstance(request_id, (str, int)) or isinstance(request_id, bool):
        raise UserError(f"'id' must be a string or an integer, got {echo(request_id)}")
    return Request(
        id=str(request_id),
        prompt=tuple(prompt),
        generation=generation_of(data, default_new_tokens, default_stops),
        text=data.get("text"),
        response_format=response_format,
    )


def generation_of(data: dict[str, Any], default_new_tokens: int, default_stops: tuple[int, ...]) -> GenerationConfig:
    stop_ids = data.get("stop_ids", list(default_stops))
    if not isinstance(stop_ids, list):
        raise UserError(f"'stop_ids' must be a list of token ids, got {type(stop_ids).__name__}")
    settings = {name: data[name] for name in SETTINGS[:-1] if name in data}
    settings.setdefault("max_new_tokens", default_new_tokens)
    return GenerationConfig(**settings, stop_ids=tuple(stop_ids))


def split_lines(text: str) -> list[str]:
    """A request file's lines: split at "\\n" alone, as JSONL is. str.splitlines would also split
    at U+2028 and the other Unicode line breaks, which a JSON string may hold raw."""
    return text.split("\n")


def parse_requests(
    lines: Iterable[str],
    config: ModelConfig,
    default_new_tokens: int,
    encode: Encode | None = None,
    max_tokens: int | None = None,
    chat: Chat | None = None,
) -> tuple[list[Request], list[BadLine]]:
    """Every good line's request, and every bad line's error (blank lines are skipped). A line
    without stop ids stops at the model's eos ids, as `kvports generate` does. A line without
    an id is named by its number: a line that gives another line's number as its id is refused,
    not the line that gave none."""
    parsed: list[tuple[int, Request | BadLine]] = []
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            request = parse_line(text, number, default_new_tokens, config.eos_token_ids, encode, chat)
            parsed.append((number, check_request(request, config, BATCH_LINE, max_tokens)))
        except UserError as exc:
            parsed.append((number, BadLine(number, str(exc))))
    # Ids that name their own line (given or not): no other line may take them.
    own = {result.id: number for number, result in parsed if isinstance(result, Request) and result.id == str(number)}
    requests: list[Request] = []
    bad: list[BadLine] = []
    first: dict[str, int] = {}
    for number, result in parsed:
        if isinstance(result, Request):
            owner = own.get(result.id, number)
            if owner != number:
                result = BadLine(
                    number, f"id {echo(result.id)} is line {owner}'s (a line without an id is named by its number)"
                )
            elif result.id in first:
                result = BadLine(number, f"id {echo(result.id)} is already used by line {first[result.id]}")
        if isinstance(result, BadLine):
            bad.append(result)
            continue
        first[result.id] = number
        requests.append(result)
    return requests, bad
