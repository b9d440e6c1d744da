"""Chat prompts: messages ({"role", "content"}) rendered by a model's own chat template, with
jinja2 as transformers renders it (a sandboxed environment, trim_blocks and lstrip_blocks,
`raise_exception`), and the generation prompt that opens the assistant's turn."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from kvports.shared.errors import UserError, echo, echo_path

MAX_CHAT_FILE = 1 << 20  # bytes of a --chat-file
MAX_MESSAGES = 1000
ROLES = ("system", "user", "assistant")


def turns(texts: Sequence[str]) -> list[dict[str, str]]:
    """--chat repeated: alternating user and assistant turns, the user's first."""
    return [{"role": ROLES[1 + index % 2], "content": text} for index, text in enumerate(texts)]


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
    return data


def raise_exception(message: str) -> NoReturn:
    raise UserError(f"the chat template refuses these messages: {message}")


def render_chat(template: str, messages: Sequence[dict[str, str]], special: dict[str, str] | None = None) -> str:
    """The prompt the template makes of `messages`, ending with the generation prompt.
    special: the bos_token / eos_token strings a template may use."""
    try:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise UserError("a chat prompt needs the jinja2 package (pip install jinja2)") from None
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = raise_exception
    try:
        return environment.from_string(template).render(
            messages=list(messages), add_generation_prompt=True, **(special or {})
        )
    except UserError:
        raise
    except (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
        raise UserError(f"the chat template cannot be rendered ({type(exc).__name__}: {exc})") from None


def chat_messages(chat: Sequence[str] | None, chat_file: os.PathLike | None) -> list[dict[str, str]] | None:
    """--chat (alternating user/assistant turns) or --chat-file's messages; None when neither is given."""
    if chat and chat_file is not None:
        raise UserError("give --chat or --chat-file, not both")
    if chat_file is not None:
        return read_chat_file(chat_file)
    return turns(chat) if chat else None


# The GGUF file's own template, here rather than in kvports.formats.gguf: the reader (which weights imports)
# stays clear of jinja2 and of this module's file reading.
def gguf_chat_prompt(path: os.PathLike, messages: list[dict[str, str]]) -> str:
    """The messages as the file's own chat template renders them, with the generation prompt."""
    template, special = gguf_template(path)
    return render_chat(template, messages, special)


TOKENIZER_CONFIG = "tokenizer_config.json"  # beside converted weights: the template, as Hugging Face keeps it


def template_beside(path: os.PathLike) -> tuple[str, dict[str, str]] | None:
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
    special = {name: saved[name] for name in ("bos_token", "eos_token") if isinstance(saved.get(name), str)}
    return template, special


def gguf_template(path: os.PathLike) -> tuple[str, dict[str, str]]:
    """A GGUF file's chat template and the bos_token / eos_token strings it may use (through the
    load cache: read from the file's metadata once), or the one `kvports convert` kept beside
    converted weights."""
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
    if text.template is None:
        raise UserError(f"GGUF file {echo_path(path)} has no chat template (metadata tokenizer.chat_template)")
    return text.template, text.special


def chat_ids(path: os.PathLike, messages: list[dict[str, str]], tokenizer: Any) -> list[int]:
    """The chat prompt's token ids: the template writes every special token itself, so none is added
    (as transformers' apply_chat_template tokenizes)."""
    return chat_encoder(path, tokenizer)(messages)


def chat_encoder(path: os.PathLike, tokenizer: Any) -> Callable[[list[dict[str, str]]], list[int]]:
    """`chat_ids` for many chats of one file (kvports batch's "messages" lines): its metadata read once."""
    template, special = gguf_template(path)
    return lambda messages: tokenizer.encode(render_chat(template, messages, special), add_special_tokens=False).ids
