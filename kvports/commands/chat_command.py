"""`kvports chat`: a conversation with one loaded model, turn after turn, in its own chat template.

Each answer is streamed as it is made (decoded incrementally, never half a character), then its
tokens/s. The conversation is kept across turns; when it no longer fits the model's context with
the new tokens an answer may take, its oldest turns are dropped, with a notice. `/reset` starts
again, `/exit` or Ctrl-D leaves, Ctrl-C stops the answer being written and the chat goes on. From a
pipe, each line is a user turn. Nothing the user types ends the chat but /exit and the end of input:
a blank line is skipped, an unknown /command, a message too long for the context or the template,
or one the template refuses is a notice, and bytes that are not UTF-8 are read as U+FFFD. The model
is read, checked and loaded once, through the run layer.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Any, TextIO

import numpy as np

from kvports import generating, loading, registry
from kvports.commands.inputs import add_generation_arguments, generation_of
from kvports.devices import add_device_argument
from kvports.families import describe
from kvports.flags import add_quant_argument, add_threads_argument, add_weights_arguments, positive_int
from kvports.formats.chat import MAX_CONTENT
from kvports.shared.config import DTYPES
from kvports.shared.errors import UserError, echo
from kvports.threads import use_threads

HELP = "chat with one model, turn after turn: streamed answers, /reset, /exit, Ctrl-C stops an answer"
COMMANDS = "/reset starts again, /exit or Ctrl-D leaves, Ctrl-C stops an answer"
ESCAPED = "//"  # a message that starts with / begins with two: one is dropped


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--framework", choices=registry.PORTS, default="numpy", help="default numpy")
    add_weights_arguments(parser)
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="compute dtype (default float32)")
    add_quant_argument(parser)
    add_device_argument(parser)
    add_threads_argument(parser)
    parser.add_argument(
        "--new-tokens", type=positive_int, default=256, metavar="N", help="tokens an answer may take (default 256)"
    )
    parser.add_argument("--system", default=None, metavar="TEXT", help="a system message opening the conversation")
    parser.add_argument(
        "--no-jax-cache", action="store_true", help="compile again rather than use JAX's cache in $KVPORTS_HOME"
    )
    add_generation_arguments(parser)


@dataclasses.dataclass
class Conversation:
    """The messages so far, the system message (kept when older turns are dropped) first."""

    system: str | None
    messages: list[dict[str, str]] = dataclasses.field(default_factory=list)

    def reset(self) -> None:
        self.messages = []

    def all(self, messages: list[dict[str, str]] | None = None) -> list[dict[str, str]]:
        """The system message, then `messages` (the conversation's own by default)."""
        head = [{"role": "system", "content": self.system}] if self.system is not None else []
        return head + (self.messages if messages is None else messages)


class Chat:
    """One loaded model and its run's inputs, answering a conversation turn by turn."""

    def __init__(self, args: argparse.Namespace, out: TextIO | None = None):
        if args.no_jax_cache:
            os.environ[loading.JAX_CACHE_VARIABLE] = "0"
        self.out = sys.stdout if out is None else out

        def check(config: Any) -> tuple[generating.RunInputs, Any]:
            inputs = generating.RunInputs(
                args.framework,
                "cached",
                generation_of(args, config),
                args.weights,
                args.dtype,
                args.device,
                quant=args.quant,
                threads=args.threads,
            )
            generating.check_inputs(inputs, config, [[0]])  # the flags, once, before anything loads
            return inputs, loading.model_tokenizer(args.weights, config)

        with loading.open_model(args.weights) as file:  # the header, checked before any tensor is read
            config = loading.header(file, args.dtype)
            checked = check(config)
            tensors = loading.read_tensors(file, args.dtype, args.quant)
        self.inputs, self.tokenizer = checked
        port = loading.port_for(args.framework, args.device)  # what only the imported port can tell, as generate
        if self.tokenizer is None:  # said after the rules of the run, which come first in every command
            raise UserError(
                "kvports chat needs a model with a tokenizer and a chat template: --model NAME or "
                "--weights FILE.gguf (or a file kvports convert wrote, with tokenizer.json beside it)"
            )
        use_threads(args.threads)
        self.loaded = loading.load_model(
            args.framework, config, tensors, args.dtype, args.device, quant=args.quant, port=port
        )
        self.config = config
        self.conversation = Conversation(args.system)
        self.prompt_ids(self.conversation.all() + [{"role": "user", "content": "hi"}])  # the template renders

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return loading.chat_ids(self.inputs.weights, messages, self.tokenizer)

    def fitted(self, user: str) -> list[int] | None:
        """The conversation with the user's new turn, as prompt ids that leave room for an answer's
        new tokens: the oldest turns dropped (with a notice) until it fits. None, with a notice and
        the conversation as it was, when even the new turn alone does not fit or the template
        refuses it."""
        messages = [*self.conversation.messages, {"role": "user", "content": user}]
        room = self.config.max_seq_len - self.inputs.generation.max_new_tokens
        dropped = 0
        while True:
            try:
                ids = self.prompt_ids(self.conversation.all(messages))
            except UserError as exc:
                self.notice(f"{exc}; the chat goes on without this message")
                return None
            if len(ids) <= room:
                break
            if len(messages) <= 1:
                self.notice(
                    f"this message is {len(ids)} tokens with the template: with --new-tokens "
                    f"{self.inputs.generation.max_new_tokens} the context holds {room}; say less, or lower --new-tokens"
                )
                return None
            messages.pop(0)
            dropped += 1
        self.conversation.messages = messages
        if dropped:
            self.notice(
                f"the context is full ({self.config.max_seq_len} tokens): the oldest {dropped} "
                f"message{'s' if dropped > 1 else ''} dropped"
            )
        return ids

    def notice(self, text: str) -> None:
        print(f"[{text}]", file=sys.stderr, flush=True)

    def answer(self, user: str) -> None:
        """One turn: the answer streamed to `out` and kept in the conversation (as far as it got, when
        Ctrl-C stopped it)."""
        from tokenizers.decoders import DecodeStream

        ids = self.fitted(user)
        if ids is None:
            return
        batch = generating.check_and_prepare(self.loaded, self.inputs, [ids])  # [1, P]
        batch = generating.session_shape(self.loaded, batch, self.inputs.generation.max_new_tokens)  # [1, P']
        decoder = DecodeStream(skip_special_tokens=True)
        made: list[int] = []
        text: list[str] = []

        def heard(token: np.ndarray) -> None:  # token [1]
            made.append(int(token[0]))
            piece = decoder.step(self.tokenizer, made[-1])
            if piece:
                text.append(piece)
                self.out.write(piece)
                self.out.flush()

        start = time.perf_counter()
        stopped = False
        try:
            generating.generate(self.loaded, batch, self.inputs, on_token=heard)
        except KeyboardInterrupt:
            stopped = True
        seconds = time.perf_counter() - start
        self.out.write("\n")
        self.out.flush()
        self.conversation.messages.append({"role": "assistant", "content": "".join(text)})
        rate = len(made) / seconds if seconds > 0 else 0.0
        self.notice(f"{'stopped: ' if stopped else ''}{len(made)} tokens, {rate:.1f} tokens/s")


def read_turn(interactive: bool) -> str | None:
    """The user's next line, without its newline; None at the end of input (Ctrl-D), and only then.
    From a pipe a line is read up to MAX_CONTENT + 1 characters, the rest of a longer one dropped
    unkept (the caller refuses it by its length)."""
    if interactive:
        try:
            return input("> ")
        except EOFError:
            return None
    line = sys.stdin.readline(MAX_CONTENT + 1)
    if not line:
        return None
    if len(line) > MAX_CONTENT and not line.endswith("\n"):
        while (rest := sys.stdin.readline(MAX_CONTENT)) and not rest.endswith("\n"):
            pass
    return line.removesuffix("\n")


def run(args: argparse.Namespace) -> int:
    chat = Chat(args)
    if callable(getattr(sys.stdin, "reconfigure", None)):
        sys.stdin.reconfigure(errors="replace")  # type: ignore[union-attr]  # a byte that is not UTF-8: U+FFFD
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"kvports chat: {args.framework}, {describe(chat.config)}; {COMMANDS}", file=sys.stderr, flush=True)
    while True:
        try:
            line = read_turn(interactive)
        except KeyboardInterrupt:  # at the prompt: a fresh line, the chat goes on
            print(f"\n[{COMMANDS}]", file=sys.stderr, flush=True)
            continue
        if line is None:
            if interactive:
                print(file=sys.stderr)
            return 0
        command = line.strip()
        if command == "/exit":
            return 0
        if command == "/reset":
            chat.conversation.reset()
            chat.notice("the conversation starts again")
        elif not command:
            continue  # a blank line: only the end of input ends the chat
        elif command.startswith("/") and not command.startswith(ESCAPED):
            chat.notice(
                f"unknown command {echo(command.split()[0])}: {COMMANDS}; a message that starts with / begins with //"
            )
        elif len(line) > MAX_CONTENT:
            chat.notice(f"this message is more than {MAX_CONTENT} characters, the most a chat holds: say less")
        else:
            chat.answer(line.lstrip()[1:] if command.startswith(ESCAPED) else line)
