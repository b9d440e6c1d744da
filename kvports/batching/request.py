"""One request, the one type every front door translates into, and its one check.

The command line and the API make one request per prompt row, a batch file one per line, the
server one per choice; the engine queues them as `scheduler.Sequence`s. Every door calls
`check_request`, which states each rule once and words it through the door's `Names` (the
command line's flags, the API's arguments, a batch line's or a request body's fields), so a
field is added here once and each door still names it the way its user wrote it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvports.batching.constraint import ResponseFormat, check_format
from kvports.shared.checks import COMMAND_LINE, Names, check_generation, check_range
from kvports.shared.config import ModelConfig
from kvports.shared.errors import UserError, echo
from kvports.shared.generation import GenerationConfig

Chat = Callable[[list[dict[str, str]]], list[int]]  # messages -> the model's chat template's token ids


@dataclass(frozen=True)
class Request:
    """One prompt's ids and how to continue it: its generation settings (stop ids among them),
    the server's stop strings, and how many likeliest tokens each step reports."""

    id: str
    prompt: tuple[int, ...]
    generation: GenerationConfig
    text: str | None = field(default=None, compare=False)  # the text prompt it was encoded from, if any
    logprobs: int | None = None  # each new token's log-probability and this many likeliest tokens'; None: none
    stop: tuple[str, ...] = ()  # stop strings, matched on the decoded text (the server's)
    # The prompt's own log-probabilities (every token's after the first) and this many likeliest
    # tokens' at each position, from its prefill (the prefix cache not used); None: none.
    prompt_logprobs: int | None = None
    # What its answer must be (a JSON object, or JSON a schema describes): each step's tokens are
    # masked to its grammar's (batching.constraint); None: free text.
    response_format: ResponseFormat | None = None

    @property
    def max_length(self) -> int:
        """The longest its sequence gets: the prompt and every new token."""
        return len(self.prompt) + self.generation.max_new_tokens


def check_request(
    request: Request,
    config: ModelConfig,
    names: Names = COMMAND_LINE,
    max_tokens: int | None = None,
    row: int | None = None,
) -> Request:
    """A request every port can run, or a UserError naming the value and the limit in the words of
    the door it came through (`names`; `row`: its prompt's index in a run of several). max_tokens:
    what the block pool holds for one sequence, when that is smaller than max_seq_len."""
    new_tokens = check_range("new_tokens", request.generation.max_new_tokens, 1, names)
    check_prompt_ids(request.prompt, config.vocab_size, names, row)
    total = len(request.prompt) + new_tokens
    sum_of = f"prompt length {len(request.prompt)} + {names.show('new_tokens', str(new_tokens))} = {total}"
    if total > config.max_seq_len:
        raise UserError(f"{sum_of} exceeds max_seq_len {config.max_seq_len}")
    if max_tokens is not None and total > max_tokens:
        raise UserError(f"{sum_of} tokens do not fit the block pool ({max_tokens} tokens)")
    check_generation(request.generation, config.vocab_size, names)
    if request.response_format is not None:
        check_format(request.response_format, names)
    return request


class PromptError(UserError):
    """A refused prompt: the server names the body's prompt field as the error's param."""


def check_prompt_ids(prompt: Sequence[object], vocab_size: int, names: Names, row: int | None = None) -> None:
    """The prompt rule: at least one id, each an integer in [0, vocab_size)."""
    named = names.label("prompt") if row is None else f"prompt {row}"
    if len(prompt) == 0:
        raise PromptError(f"{named} is empty: give at least one token id")
    for token in prompt:
        shown = f"{named} token {echo(token)}" if row is None else f"token id {echo(token)} in {named}"
        if not isinstance(token, (int, np.integer)) or isinstance(token, bool):
            raise PromptError(f"{shown} is not an integer")
        if not 0 <= token < vocab_size:
            raise PromptError(f"{shown} is outside [0, {vocab_size}) (vocab_size {vocab_size})")


def chat_prompt(messages: object, chat: Chat, names: Names = COMMAND_LINE) -> list[int]:
    """A request's messages ([{"role", "content"}], as --chat-file holds) in the model's chat template
    (their text and size checked by `formats.chat.check_messages`, MAX_CONTENT)."""
    from kvports.formats.chat import check_messages

    return chat(check_messages(messages, names.label("messages")))
