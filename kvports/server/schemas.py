"""Request bodies of the OpenAI API, checked field by field before anything reaches the engine.

Every refusal is an `ApiError`: an HTTP status and the OpenAI error object
`{"error": {"message", "type", "param", "code"}}`, its message naming the field and the limit.
Framework-free, and free of FastAPI: the app turns an ApiError into its response.
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvports.batching.constraint import FormatError, ResponseFormat, json_type, parse_response_format
from kvports.batching.request import Chat, PromptError, Request, chat_prompt, check_request
from kvports.formats.chat import check_text
from kvports.shared.checks import MAX_SEED, SERVER
from kvports.shared.config import ModelConfig
from kvports.shared.errors import UserError, echo
from kvports.shared.generation import GenerationConfig

MAX_BODY_BYTES = 4 << 20  # a request body; a chat's content is at most 2**20 characters (kvports.formats.chat)
MAX_JSON_DEPTH = 64  # nesting of a body's arrays and objects (a chat is 3 deep)
MAX_N = 8  # choices per request
MAX_STOP = 4  # stop strings, as OpenAI allows
MAX_STOP_CHARACTERS = 256  # of one stop string
DEFAULT_COMPLETION_TOKENS = 16  # /v1/completions' max_tokens when none is given, as OpenAI's
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions' logprobs: likeliest tokens per step, as OpenAI's legacy API
MAX_TOP_LOGPROBS = 20  # /v1/chat/completions' top_logprobs, as OpenAI's

# Fields the server takes; a field it does not implement is accepted only at its no-op value.
COMMON = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream", "stream_options")
NO_OPS: dict[str, tuple[object, ...]] = {
    "frequency_penalty": (0, 0.0, None),
    "presence_penalty": (0, 0.0, None),
    "logit_bias": (None, {}),
    "suffix": (None,),
    "best_of": (None, 1),
}
CHAT_NO_OPS: dict[str, tuple[object, ...]] = {
    "echo": (None, False),
    "tool_choice": (None, "none"),
    "modalities": (None, ["text"]),
}
# Fields OpenAI's clients send that change nothing here, taken at any value of their JSON type:
# who calls (user, safety_identifier), OpenAI's storage and billing (store, metadata, service_tier,
# prompt_cache_key, prompt_cache_retention), and a tool setting with no tools.
IGNORED: dict[str, type] = {"user": str}
CHAT_IGNORED: dict[str, type] = {
    **IGNORED,
    "safety_identifier": str,
    "store": bool,
    "metadata": dict,
    "service_tier": str,
    "prompt_cache_key": str,
    "prompt_cache_retention": str,
    "parallel_tool_calls": bool,
}
REFUSED = {  # known to OpenAI's clients and not done here: a 400 that says so, not "unknown field"
    "tools": "this server does no tool calling",
    "functions": "this server does no function calling",
    "function_call": "this server does no function calling",
}
EXTENSIONS = ("return_token_ids",)  # vLLM's: each choice carries its token ids
CHAT_FIELDS = (
    *COMMON,
    *("messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format"),
    *NO_OPS,
    *CHAT_NO_OPS,
    *CHAT_IGNORED,
    *EXTENSIONS,
)
COMPLETION_FIELDS = (*COMMON, "prompt", "logprobs", "echo", *NO_OPS, *IGNORED, *EXTENSIONS)
TEXT_PART = "text"  # the one content part type a text-only model takes
ROLES = {"developer": "system"}  # OpenAI's newer name for the system message


class ApiError(Exception):
    """A refused request: its status and the OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        message, param = encodable(message), None if param is None else encodable(param)
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def encodable(text: str) -> str:
    """`text` with what UTF-8 cannot encode (a lone surrogate, from JSON's "\\ud800") written as its
    escape: a message or a field name that echoes the client's text is always a response."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def bad(param: str | None, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


@dataclass(frozen=True)
class Limits:
    """What the running engine can take: the model's and the server's bounds."""

    model: str  # the served model's name
    vocab_size: int
    context: int  # the longest sequence, prompt and new tokens (the engine's max length and pool)
    stop_ids: tuple[int, ...]  # the model's end-of-turn ids, where every choice stops
    config: ModelConfig  # the served model's, which every request is checked against


@dataclass(frozen=True)
class Completion:
    """A checked request: its prompt's token ids and each choice's settings."""

    chat: bool
    prompt: tuple[int, ...]
    generations: tuple[GenerationConfig, ...]  # one per choice (n): seeds seed, seed + 1, ... (given or drawn)
    stop: tuple[str, ...]  # stop strings, matched on the decoded text
    stream: bool
    include_usage: bool
    return_token_ids: bool
    logprobs: int | None  # likeliest tokens to report at each step beside the chosen one's; None: no logprobs
    echo: bool = False  # a completion's text and log-probabilities begin with its prompt's
    prompt_only: bool = False  # max_tokens 0 (with echo): the prompt alone, its one computed token dropped
    response_format: ResponseFormat | None = None  # a chat's answer as JSON (an object, or a schema's); None: text


# ---------------------------------------------------------------- the body


def parse_body(raw: bytes) -> dict[str, Any]:
    """A body as a JSON object: bounded, strict JSON (no NaN or Infinity), not nested too deeply."""
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is {len(raw)} bytes, above {MAX_BODY_BYTES}", code="body_too_large")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad(None, "the request body is not UTF-8 text") from None
    if depth(text) > MAX_JSON_DEPTH:
        raise bad(None, f"the request body nests arrays and objects deeper than {MAX_JSON_DEPTH}")
    try:
        data = json.loads(text, parse_constant=refuse_constant)
    except ValueError as exc:
        raise bad(None, f"the request body is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise bad(None, f"the request body must be a JSON object, got {json_type(data)}")
    return data


def depth(text: str) -> int:
    """How deeply `text`'s arrays and objects nest, brackets inside strings left out: checked before
    json.loads, which would recurse once per level."""
    deepest = level = 0
    in_string = escaped = False
    for character in text:
        if in_string:
            if escaped:
                escaped = False
            elif character == "\\":
                escaped = True
            elif character == '"':
                in_string = False
        elif character == '"':
            in_string = True
        elif character in "[{":
            level += 1
            deepest = max(deepest, level)
        elif character in "]}":
            level -= 1
    return deepest


def refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


# ---------------------------------------------------------------- fields


def integer(body: dict[str, Any], name: str, low: int, high: int, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad(name, f"'{name}' must be an integer, got {json_type(value)}")
    if not low <= value <= high:
        raise bad(name, f"'{name}' is {value}; it must be in [{low}, {high}]")
    return value


def number(body: dict[str, Any], name: str, low: float, high: float, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise bad(name, f"'{name}' must be a number, got {json_type(value)}")
    if not low <= value <= high:
        raise bad(name, f"'{name}' is {value}; it must be in [{low:g}, {high:g}]")
    return float(value)


def boolean(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(name, f"'{name}' must be true or false, got {json_type(value)}")
    return value


def check_fields(body: dict[str, Any], chat: bool) -> None:
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for name in body:
        if chat and name in REFUSED:
            raise bad(name, f"'{name}' is not supported: {REFUSED[name]}", "unsupported")
        if name not in known:
            raise bad(name, f"unknown field {echo(name)[:80]} (known: {', '.join(known)})", "unknown_field")
    for name, kind in (CHAT_IGNORED if chat else IGNORED).items():
        if name in body and body[name] is not None and not isinstance(body[name], kind):
            wanted = json_type(kind())
            raise bad(name, f"'{name}' must be {wanted}, got {json_type(body[name])}")
    for name, allowed in (NO_OPS | CHAT_NO_OPS if chat else NO_OPS).items():
        if name not in body:
            continue
        value = body[name]
        if not any(value == option and type(value) is type(option) for option in allowed):
            shown = " or ".join(json.dumps(option) for option in allowed)
            raise bad(name, f"'{name}' is not supported by this server: leave it out or give {shown}", "unsupported")


def check_model(body: dict[str, Any], limits: Limits) -> None:
    model = body.get("model")
    if model is None:
        raise bad("model", f"'model' is missing: this server serves {echo(limits.model)}")
    if model != limits.model:
        shown = echo(model)[:200] if isinstance(model, str) else json_type(model)
        raise ApiError(
            404,
            f"model {shown} is not served here; this server serves {echo(limits.model)}",
            "model",
            "model_not_found",
        )


def stop_strings(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(stop, str) for stop in stops):
        raise bad("stop", f"'stop' must be a string or a list of strings, got {json_type(value)}")
    if len(stops) > MAX_STOP:
        raise bad("stop", f"'stop' holds {len(stops)} strings, above {MAX_STOP}")
    for stop in stops:
        if not 1 <= len(stop) <= MAX_STOP_CHARACTERS:
            raise bad("stop", f"a stop string is {len(stop)} characters; each must be 1 to {MAX_STOP_CHARACTERS}")
    return tuple(stops)


def include_usage(body: dict[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise bad("stream_options", "'stream_options' is only for 'stream': true")
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise bad("stream_options", "'stream_options' must be an object with 'include_usage' (true or false)")
    return boolean(options, "include_usage")


# ---------------------------------------------------------------- prompts

Encode = Callable[[str], list[int]]


def completion_prompt(body: dict[str, Any], encode: Encode | None) -> list[Any]:
    """'prompt': a string (the model's tokenizer encodes it) or one list of token ids (held to the
    prompt rule with the rest of the request, `request.check_request`)."""
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("prompt", "'prompt' is missing: give a string or a list of token ids")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one, as the openai client may send it
    if isinstance(prompt, str):
        if encode is None:
            raise bad("prompt", "this model has no tokenizer: give 'prompt' as a list of token ids")
        try:
            check_text(prompt, "'prompt'")  # as a chat's content is: text a tokenizer takes
        except UserError as exc:
            raise bad("prompt", str(exc)) from None
        return encode(prompt)
    if isinstance(prompt, list):
        if prompt and all(isinstance(item, (str, list)) for item in prompt):
            raise bad("prompt", f"'prompt' holds {len(prompt)} prompts; this server takes one per request")
        return prompt
    raise bad("prompt", f"'prompt' must be a string or a list of token ids, got {json_type(prompt)}")


def messages_prompt(body: dict[str, Any], chat: Chat | None) -> list[int]:
    """'messages' in the model's own chat template, as `kvports generate --chat-file` renders them."""
    if chat is None:
        raise bad("messages", "this model has no chat template (a GGUF file's tokenizer.chat_template)")
    messages = body.get("messages")
    if messages is None:
        raise bad("messages", "'messages' is missing: give a non-empty list of {'role', 'content'} messages")
    try:
        return chat_prompt(openai_messages(messages), chat, SERVER)
    except UserError as exc:
        raise bad("messages", str(exc)) from None


def openai_messages(messages: object) -> object:
    """OpenAI's message forms as the chat template's: content as a list of text parts joined by
    newlines (as vLLM joins them), the developer role as system. Anything else is left for the
    chat rule (`kvports.formats.chat.check_messages`) to judge."""
    if not isinstance(messages, list):
        return messages
    plain = []
    for message in messages:
        if isinstance(message, dict):
            message = dict(message)
            if message.get("role") in ROLES:
                message["role"] = ROLES[message["role"]]
            if isinstance(message.get("content"), list):
                message["content"] = "\n".join(text_part(part) for part in message["content"])
        plain.append(message)
    return plain


def text_part(part: object) -> str:
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise bad("messages", f"a content part must be an object with a 'type', got {json_type(part)}")
    if part["type"] != TEXT_PART:
        shown = echo(part["type"])[:80]
        raise bad("messages", f"content part type {shown} is not supported: this model takes 'text' parts only")
    if not isinstance(part.get("text"), str):
        raise bad("messages", f"a 'text' content part's 'text' must be a string, got {json_type(part.get('text'))}")
    return part["text"]


# ---------------------------------------------------------------- the request


def requested_logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """How many likeliest tokens each step reports, or None for no log-probabilities: a chat's
    `logprobs: true` and `top_logprobs` (0 to 20), a completion's `logprobs` (0 to 5)."""
    if not chat:
        return integer(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS, None)
    top = integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, None)
    if not boolean(body, "logprobs"):
        if top is not None:
            raise bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
        return None
    return 0 if top is None else top


def check_body(
    body: dict[str, Any], limits: Limits, chat: bool, encode: Encode | None, render: Chat | None
) -> Completion:
    """A body as the engine's requests, or the ApiError that names the first bad field: the body's
    own fields here, then the request every door makes (`request.check_request`, in the body's words)."""
    check_fields(body, chat)
    check_model(body, limits)
    stream = boolean(body, "stream")
    echo = not chat and boolean(body, "echo")
    if echo and stream:
        raise bad("echo", "'echo' is not supported with 'stream': true; ask for the whole answer")
    usage = include_usage(body, stream)
    return_ids = boolean(body, "return_token_ids")
    logprobs = requested_logprobs(body, chat)
    stop = stop_strings(body)
    n = integer(body, "n", 1, MAX_N, 1)
    temperature = number(body, "temperature", 0.0, 2.0, 1.0)
    top_p = number(body, "top_p", 0.0, 1.0, 1.0)
    if top_p == 0.0:
        raise bad("top_p", "'top_p' is 0; it must be in (0, 1] (1 means no nucleus filter)")
    top_k = integer(body, "top_k", 0, limits.vocab_size, 0)
    seed = integer(body, "seed", 0, MAX_SEED - MAX_N, None)
    if seed is None:  # a fresh draw, as OpenAI's: each choice says its seed, so it can be repeated
        seed = secrets.randbelow(MAX_SEED - MAX_N + 1)
    response_format = requested_format(body, encode is not None) if chat else None
    prompt = messages_prompt(body, render) if chat else completion_prompt(body, encode)
    room = limits.context - len(prompt)
    field = "messages" if chat else "prompt"
    if room < 1:
        raise bad(
            field,
            f"the prompt is {len(prompt)} tokens; this server's context is {limits.context} tokens, "
            "prompt and new tokens together",
            "context_length_exceeded",
        )
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    default = room if chat else min(DEFAULT_COMPLETION_TOKENS, room)
    # max_tokens 0 asks for the prompt's echo alone (lm-eval's log-likelihoods); the engine still
    # computes one token, which the answer drops.
    max_tokens = integer(body, name, 0 if echo else 1, limits.context, default)
    assert max_tokens is not None and n is not None and seed is not None and top_k is not None
    prompt_only = max_tokens == 0
    max_tokens = max(max_tokens, 1)
    if len(prompt) + max_tokens > limits.context:
        raise bad(
            name,
            f"'{name}' {max_tokens} and the prompt's {len(prompt)} tokens make {len(prompt) + max_tokens}, "
            f"above this server's context of {limits.context} tokens",
            "context_length_exceeded",
        )
    greedy = temperature == 0.0
    generations = tuple(
        GenerationConfig(
            max_new_tokens=max_tokens,
            temperature=temperature,
            top_k=0 if greedy else top_k,
            top_p=1.0 if greedy else top_p,
            seed=seed + index,
            stop_ids=limits.stop_ids,
        )
        for index in range(n)
    )
    for generation in generations:
        try:
            request = Request("", tuple(prompt), generation, response_format=response_format)
            check_request(request, limits.config, SERVER, limits.context)
        except PromptError as exc:
            raise bad(field, str(exc)) from None
        except FormatError as exc:
            raise bad("response_format", str(exc)) from None
        except UserError as exc:  # what the ports' shared checks refuse past the bounds above
            raise bad(None, str(exc)) from None
    return Completion(
        chat, tuple(prompt), generations, stop, stream, usage, return_ids, logprobs, echo, prompt_only, response_format
    )


def requested_format(body: dict[str, Any], tokenizer: bool) -> ResponseFormat | None:
    """A chat's 'response_format' (batching.constraint: OpenAI's text, json_object and json_schema);
    its schema is compiled with the rest of the request (`check_request`)."""
    try:
        response_format = parse_response_format(body.get("response_format"), SERVER)
    except UserError as exc:
        raise bad("response_format", str(exc)) from None
    if response_format is not None and not tokenizer:
        raise bad("response_format", "this model has no tokenizer: 'response_format' needs one to follow a grammar")
    return response_format
