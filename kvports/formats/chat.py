"""Chat prompts: messages ({"role", "content"}) rendered by a model's own chat template, with
jinja2 as transformers renders it (a sandboxed environment, trim_blocks and lstrip_blocks,
`raise_exception`), and the generation prompt that opens the assistant's turn."""

from __future__ import annotations

import functools
import os
import re
import secrets
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from kvports.shared.errors import UserError, echo, echo_path

MAX_CHAT_FILE = 1 << 20  # bytes of a --chat-file
MAX_MESSAGES = 1000
MAX_CONTENT = 1 << 20  # characters of a chat's messages' contents together, as a --chat-file's bytes
ROLES = ("system", "user", "assistant")
# A template is code from the file: what one rendering may spend.
MAX_RENDER = 4 * MAX_CONTENT  # characters of any value or output: the content, with room to spare
MAX_STEPS = 2_000_000  # loop steps, operators and calls; a real template takes a few thousand
TIME_LIMIT = 10.0  # seconds of one rendering; a real template takes milliseconds


def turns(texts: Sequence[str]) -> list[dict[str, str]]:
    """--chat repeated: alternating user and assistant turns, the user's first."""
    for index, text in enumerate(texts):
        check_text(text, f"--chat {index + 1}")
    check_size(texts, "--chat")
    return [{"role": ROLES[1 + index % 2], "content": text} for index, text in enumerate(texts)]


def check_size(contents: Sequence[str], what: str) -> None:
    """MAX_CONTENT, the one limit on a chat's characters: the template's budget holds it four times."""
    size = sum(map(len, contents))
    if size > MAX_CONTENT:
        raise UserError(f"{what} hold {size} characters of content, above {MAX_CONTENT}")


def check_text(text: str, what: str) -> None:
    """Text a tokenizer can take: no byte that was not UTF-8 (Python reads such a byte in argv as a
    surrogate) and no lone surrogate (JSON's "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        if 0xDC80 <= code <= 0xDCFF:
            raise UserError(f"{what} holds the byte {code - 0xDC00:#04x} at character {exc.start}, not UTF-8") from None
        raise UserError(f"{what} holds a lone surrogate U+{code:04X} at character {exc.start}, not text") from None


def read_chat_file(path: os.PathLike) -> list[dict[str, str]]:
    """A JSON list of {"role", "content"} messages, size-bounded and checked."""
    from kvports.formats.hf.checkpoint import read_json

    path = Path(path)
    try:
        if not path.is_file():
            raise UserError(f"--chat-file {echo_path(path)} does not exist or is not a regular file")
        size = path.stat().st_size
    except OSError as exc:
        raise UserError(f"cannot read --chat-file {echo_path(path)} ({exc.strerror or exc})") from None
    if size > MAX_CHAT_FILE:
        raise UserError(f"--chat-file {echo_path(path)} is {size} bytes, above {MAX_CHAT_FILE}")
    return check_messages(read_json(path, "--chat-file"), f"--chat-file {echo_path(path)}")


def check_messages(data: Any, what: str) -> list[dict[str, str]]:
    if not isinstance(data, list) or not data:
        raise UserError(f"{what} must hold a non-empty JSON list of {{'role', 'content'}} messages")
    if len(data) > MAX_MESSAGES:
        raise UserError(f"{what} holds {len(data)} messages, above {MAX_MESSAGES}")
    for index, message in enumerate(data):
        if (
            not isinstance(message, dict)
            or set(message) != {"role", "content"}
            or not all(isinstance(value, str) for value in message.values())
        ):
            raise UserError(f"{what}: message {index} is {echo(message)}; each is {{'role': str, 'content': str}}")
        if message["role"] not in ROLES:
            raise UserError(f"{what}: message {index} has role {echo(message['role'])}; roles: {', '.join(ROLES)}")
        check_text(message["content"], f"{what}: message {index}'s content")
    check_size([message["content"] for message in data], what)
    return data


def raise_exception(message: str) -> NoReturn:
    raise UserError(f"the chat template refuses these messages: {message}")


class TemplateLimit(Exception):
    """A template ran past a limit: carried out of jinja2 as one message."""


@dataclass
class Budget:
    """What one rendering may spend: loop steps, seconds, and characters in any one value or output."""

    max_chars: int
    steps: int = 0
    deadline: float = 0.0

    def step(self) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise TemplateLimit(f"runs more than {MAX_STEPS} loop steps")
        if self.steps % 1024 == 0 and time.monotonic() > self.deadline:
            raise TemplateLimit(f"runs longer than {TIME_LIMIT:g} seconds")

    def size(self, length: int) -> None:
        if length > self.max_chars:
            raise TemplateLimit(f"makes a string or list of {length} items, above {self.max_chars}")

    def number(self, value: Any) -> None:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_RENDER:
            raise TemplateLimit(f"uses the number {echo(value)}, above {MAX_RENDER} (a size it could allocate)")


def sized(value: Any) -> int:
    return len(value) if isinstance(value, (str, list, tuple)) else 0


def template_environment(budget: Budget) -> Any:
    """jinja2's immutable sandbox (no Python internals), with every loop stepped through the budget,
    every operator that can grow a value or a number checked before it runs, every call's numbers
    bounded, and `~` joins sized."""
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def steps(iterable: Any) -> Iterator[Any]:
        for item in iterable:
            budget.step()
            yield item

    def concat(*parts: Any) -> str:
        texts = [str(part) for part in parts]
        budget.size(sum(map(len, texts)))
        return "".join(texts)

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["+", "*", "**", "%", "//", "/"])

        def _parse(self, source: str, name: str | None, filename: str | None) -> Any:
            tree = super()._parse(source, name, filename)
            for loop in tree.find_all(nodes.For):
                loop.iter = nodes.Call(nodes.Name("_kvports_steps", "load"), [loop.iter], [], None, None)
                loop.iter.set_lineno(loop.lineno)
            for node in list(tree.find_all(nodes.Concat)):
                call = nodes.Call(nodes.Name("_kvports_concat", "load"), node.nodes, [], None, None)
                node.nodes = [call.set_lineno(node.lineno)]
            tree.set_environment(self)
            return tree

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            budget.step()
            if operator == "*":
                for sequence, times in ((left, right), (right, left)):
                    if sized(sequence) and isinstance(times, int):
                        budget.size(sized(sequence) * max(times, 0))
                if isinstance(left, int) and isinstance(right, int):
                    budget.size((left.bit_length() + right.bit_length()) // 3)
            elif operator == "+":
                budget.size(sized(left) + sized(right))
            elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
                budget.size(left.bit_length() * max(right, 0) // 3)
            elif operator == "%" and isinstance(left, str):
                for value in right if isinstance(right, tuple) else (right,):
                    budget.number(value)
                for width in re.findall(r"\d+", left):
                    budget.number(int(width))
            return super().call_binop(context, operator, left, right)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
            budget.step()
            for value in (*args, *kwargs.values()):
                budget.number(value)
            bound = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)  # the sandbox wraps str.format
            if isinstance(bound, str) and getattr(__obj, "__name__", "") in ("format", "format_map"):
                for width in re.findall(r"\d+", bound):
                    budget.number(int(width))
            result = super().call(__context, __obj, *args, **kwargs)
            budget.size(sized(result))
            return result

    environment = Bounded(trim_blocks=True, lstrip_blocks=True)
    environment.globals.update(raise_exception=raise_exception, _kvports_steps=steps, _kvports_concat=concat)
    for name in ("center", "indent", "wordwrap", "batch", "slice", "replace", "format", "truncate"):
        environment.filters[name] = bounded_filter(environment.filters[name], budget)
    return environment


def bounded_filter(function: Callable[..., Any], budget: Budget) -> Callable[..., Any]:
    """A filter whose numbers are bounded before it runs and whose result is sized after."""

    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget.step()
        for value in (*args, *kwargs.values()):
            budget.number(value)
        if function.__name__ == "do_replace" and len(args) >= 3:
            budget.size(sized(args[0]) * max(1, sized(args[2])))
        if function.__name__ == "do_format" and args and isinstance(args[0], str):
            for width in re.findall(r"\d+", args[0]):
                budget.number(int(width))
        result = function(*args, **kwargs)
        budget.size(sized(result))
        return result

    return functools.update_wrapper(bounded, function)


def render_chat(
    template: str,
    messages: Sequence[dict[str, str]],
    special: dict[str, str] | None = None,
    name: str = "the chat template",
    max_chars: int = MAX_RENDER,
) -> str:
    """The prompt the template makes of `messages`, ending with the generation prompt, under limits:
    loop steps, seconds, and `max_chars` characters in any value and in the output.
    special: the bos_token / eos_token strings a template may use; name: how a message names it."""
    try:
        from jinja2 import TemplateError
    except ImportError:
        raise UserError("a chat prompt needs the jinja2 package (pip install jinja2)") from None
    budget = Budget(max_chars, deadline=time.monotonic() + TIME_LIMIT)
    chunks, length = [], 0
    try:
        compiled = template_environment(budget).from_string(template)
        for chunk in compiled.generate(messages=list(messages), add_generation_prompt=True, **(special or {})):
            length += len(chunk)
            budget.size(length)
            budget.step()
            chunks.append(chunk)
    except UserError:
        raise
    except TemplateLimit as exc:
        raise UserError(f"{name} {exc}: refusing it") from None
    except RecursionError:
        raise UserError(f"{name} recurses without end") from None
    except MemoryError:
        raise UserError(f"{name} ran out of memory") from None
    except TemplateError as exc:
        where = f" (line {exc.lineno})" if getattr(exc, "lineno", None) else ""
        raise UserError(f"{name} cannot be rendered{where}: {type(exc).__name__}: {exc}") from None
    except (ArithmeticError, TypeError, ValueError, LookupError, AttributeError) as exc:
        raise UserError(f"{name} cannot be rendered ({type(exc).__name__}: {exc})") from None
    text = "".join(chunks)
    if not text:
        raise UserError(f"{name} renders these messages as nothing: no prompt to give the model")
    return text


def chat_messages(chat: Sequence[str] | None, chat_file: os.PathLike | None) -> list[dict[str, str]] | None:
    """--chat (alternating user/assistant turns) or --chat-file's messages; None when neither is given."""
    if chat and chat_file is not None:
        raise UserError("give --chat or --chat-file, not both")
    if chat_file is not None:
        return read_chat_file(chat_file)
    return turns(chat) if chat else None


# The GGUF file's own template, here rather than in kvports.formats.gguf: the reader (which weights imports)
# stays clear of jinja2 and of this module's file reading.
@dataclass
class ChatTemplate:
    """A GGUF file's chat template, the bos_token / eos_token strings it may use, and how a message
    names it (never by where the file lies: a server's clients read it). It may render MAX_RENDER
    characters, four times the content a chat may hold (MAX_CONTENT): a message the context cannot
    hold is refused for its tokens, by the caller, not by the template's budget."""

    source: str
    special: dict[str, str]
    name: str

    def render(self, messages: Sequence[dict[str, str]]) -> str:
        return render_chat(self.source, messages, self.special, self.name)


def gguf_chat_prompt(path: os.PathLike, messages: list[dict[str, str]]) -> str:
    """The messages as the file's own chat template renders them, with the generation prompt."""
    return gguf_template(path).render(messages)


TOKENIZER_CONFIG = "tokenizer_config.json"  # beside converted weights: the template, as Hugging Face keeps it


def template_beside(path: os.PathLike) -> ChatTemplate | None:
    """The chat template `kvports convert` keeps beside the weights it writes (in the Hugging Face
    directory with --to-hf), as tokenizer_config.json's chat_template, bos_token and eos_token."""
    from kvports.formats.hf.checkpoint import read_json

    folder = Path(path) if Path(path).is_dir() else Path(path).parent
    if not (folder / TOKENIZER_CONFIG).is_file():
        return None
    saved = read_json(folder / TOKENIZER_CONFIG, TOKENIZER_CONFIG)
    template = saved.get("chat_template") if isinstance(saved, dict) else None
    if not isinstance(template, str):
        return None
    check_text(template, f"the chat template in {echo_path(folder / TOKENIZER_CONFIG)}")
    special = {name: saved[name] for name in ("bos_token", "eos_token") if isinstance(saved.get(name), str)}
    return ChatTemplate(template, special, f"the chat template in {TOKENIZER_CONFIG}")


def gguf_template(path: os.PathLike) -> ChatTemplate:
    """A GGUF file's chat template, checked to be text, and the special token strings it may use
    (through the load cache: read from the file's metadata once), or the one `kvports convert`
    kept beside converted weights."""
    from kvports.formats.gguf.reader import is_gguf
    from kvports.formats.gguf.tokenizer import gguf_text

    if not is_gguf(path):
        beside = template_beside(path)
        if beside is not None:
            return beside
        raise UserError(
            "--chat renders the model's own chat template: give --model NAME, --weights FILE.gguf, or weights "
            "kvports convert wrote from one (tokenizer_config.json beside them)"
        )
    text = gguf_text(path)
    # Said to a server's clients too: the file's name, never where it lies.
    name = f"the chat template of GGUF file {echo(Path(path).name)}"
    if text.template_error is not None:
        raise UserError(f"{name} (metadata tokenizer.chat_template) {text.template_error}")
    if text.template is None:
        raise UserError(f"GGUF file {echo_path(path)} has no chat template (metadata tokenizer.chat_template)")
    return ChatTemplate(text.template, text.special, name)


def chat_ids(path: os.PathLike, messages: list[dict[str, str]], tokenizer: Any) -> list[int]:
    """The chat prompt's token ids: the template writes every special token itself, so none is added
    (as transformers' apply_chat_template tokenizes), and no message's content is ever one."""
    return chat_encoder(path, tokenizer)(messages)


def chat_encoder(path: os.PathLike, tokenizer: Any) -> Callable[[list[dict[str, str]]], list[int]]:
    """`chat_ids` for many chats of one file (kvports batch's "messages" lines, the server's chats):
    its metadata read once."""
    template = gguf_template(path)
    return lambda messages: encode_chat(template, messages, tokenizer)


def encode_chat(template: ChatTemplate, messages: Sequence[dict[str, str]], tokenizer: Any) -> list[int]:
    """The rendered chat's ids, each message's content as text: a user's "<|im_end|>\n<|im_start|>system"
    stays those characters, never the control tokens that would forge a system turn. The rendering
    is encoded whole, as transformers encodes it, so ordinary text gets exactly its ids. Content that
    holds a control token's text, or begins or ends with part of one (which the template's text
    around it could complete), is located by rendering once more with placeholders; only when a
    control token of the whole encoding lies within a message's content is the chat encoded again
    by parts: the template's own text with its control tokens, each stretch between them, content
    included, with none parsed."""
    rendered = template.render(messages)
    encoding = tokenizer.encode(rendered, add_special_tokens=False)
    ids: list[int] = encoding.ids
    specials = special_tokens(tokenizer)
    if not any(touches(message["content"], specials) for message in messages):
        return ids
    parts = template_parts(template, messages, rendered)
    if parts is None:
        held = [token for message in messages for token in specials if token in message["content"]]
        if held:
            raise UserError(
                f"a message's content holds {echo(held[0])}, a control token of this model, and {template.name} "
                "changes content as it renders it, so it cannot be kept as text: remove it from the message"
            )
        return ids  # the template's own doing, if its text completes a token the content began
    spans, start = [], 0
    for text, content in parts:
        if content:
            spans.append((start, start + len(text)))
        start += len(text)
    control = set(specials.values())
    forged = any(
        index in control and any(begin < stop and end > first for first, stop in spans)
        for index, (begin, end) in zip(ids, encoding.offsets, strict=True)
    )
    return encode_parts(parts, specials, tokenizer) if forged else ids


def touches(content: str, specials: Mapping[str, int]) -> bool:
    """Whether `content` holds a control token's text, or begins with the end of one or ends with
    the start of one: text the template's around it could make a control token of."""
    return any(
        token in content
        or any(content.endswith(token[:cut]) or content.startswith(token[cut:]) for cut in range(1, len(token)))
        for token in specials
    )


def special_tokens(tokenizer: Any) -> dict[str, int]:
    """The tokenizer's control tokens (its special added tokens) by their text."""
    return {token.content: index for index, token in tokenizer.get_added_tokens_decoder().items() if token.special}


def template_parts(
    template: ChatTemplate, messages: Sequence[dict[str, str]], rendered: str
) -> list[tuple[str, bool]] | None:
    """The rendering as (text, is content) parts: rendered again with a placeholder for each message's
    content, split at them; None when the template does not pass content through as it is (it trims
    or changes it, or tells the placeholders from the text), so the parts do not make `rendered`."""
    mark = f"\ue000{secrets.token_hex(8)}"  # private-use characters and a random tag: in no message
    placeholders = [{**message, "content": f"{mark}{index}\ue001"} for index, message in enumerate(messages)]
    try:
        shaped = template.render(placeholders)
    except UserError:
        return None
    pieces = re.split(re.escape(mark) + "([0-9]+)\ue001", shaped)  # text, index, text, ...
    parts = [
        (messages[int(piece)]["content"], True) if odd else (piece, False)
        for piece, odd in zip(pieces, [False, True] * len(pieces), strict=False)
    ]
    return parts if "".join(text for text, _ in parts) == rendered else None


def encode_parts(parts: list[tuple[str, bool]], specials: dict[str, int], tokenizer: Any) -> list[int]:
    """The template's parts cut at their control tokens; every stretch between two of them (its
    content and the template's text around it, as one string: split where the whole would be)
    encoded with no control token parsed."""
    pattern = re.compile("|".join(map(re.escape, sorted(specials, key=len, reverse=True))))
    plain = as_text(tokenizer)
    ids: list[int] = []
    stretch: list[str] = []

    def flush() -> None:
        if stretch:
            ids.extend(plain.encode("".join(stretch), add_special_tokens=False).ids)
            stretch.clear()

    for text, content in parts:
        start = 0
        for match in () if content else pattern.finditer(text):
            stretch.append(text[start : match.start()])
            flush()
            ids.append(specials[match.group()])
            start = match.end()
        stretch.append(text[start:])
    flush()
    return ids


@functools.lru_cache(maxsize=4)
def as_text(tokenizer: Any) -> Any:
    """A copy of the tokenizer that reads control tokens' text as text (`encode_special_tokens`), made
    once per tokenizer: the flag is the tokenizer's own, so it is never flipped on one in use."""
    copy = type(tokenizer).from_str(tokenizer.to_str())
    copy.encode_special_tokens = True
    return copy
