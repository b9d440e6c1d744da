"""A choice's new tokens as text, decoded as they come.

The tokenizers library's `DecodeStream` turns one token at a time into the text it adds, holding
back a token that ends inside a multi-byte character until the character is whole: a stream never
splits one. Stop strings are matched on the decoded text: the text ends before the first one, and
while a stop string could still be completing, the characters that could begin it are held back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class Detokenizer:
    def __init__(self, tokenizer: Any, stop: Sequence[str], stop_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.stop_ids = frozenset(stop_ids)
        self.hold = max((len(text) for text in self.stop), default=1) - 1  # characters a stop string may still take
        self.stream: Any = None
        if tokenizer is not None:
            from tokenizers.decoders import DecodeStream

            self.stream = DecodeStream(skip_special_tokens=True)
        self.text = ""
        self.sent = 0  # characters of `text` handed out
        self.tokens = 0  # tokens taken, up to the one that completed a stop string
        self.stopped = False  # a stop string was found: the text ends before it

    def add(self, ids: Sequence[int]) -> str:
        """Take new tokens; the text now safe to send. A model's stop id adds no text."""
        for token in ids:
            if self.stopped:
                break
            self.tokens += 1
            if self.stream is None or token in self.stop_ids:
                continue
            piece = self.stream.step(self.tokenizer, token)
            if not piece:
                continue
            searched = max(0, len(self.text) - self.hold)
            self.text += piece
            self.find_stop(searched)
        end = len(self.text) if self.stopped or not self.stop else max(self.sent, len(self.text) - self.hold)
        return self.take(end)

    def finish(self) -> str:
        """The text held back, once the choice has ended."""
        return self.take(len(self.text))

    def find_stop(self, start: int) -> None:
        found = [index for index in (self.text.find(stop, start) for stop in self.stop) if index >= 0]
        if found:
            self.text = self.text[: min(found)]
            self.stopped = True

    def take(self, end: int) -> str:
        piece = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return piece
