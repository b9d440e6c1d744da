"""Input checks that run before any framework code.

JAX clamps an out-of-range gather or cache write without a word and NumPy wraps a
negative index, so a bad id would give plausible, wrong tokens. Every check lives
here, once, and every port gets the same message.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from kvports.shared.config import ModelConfig
from kvports.shared.errors import UserError, echo
from kvports.shared.generation import pad_prompts

SEED_PROMPT = (160, 248, 104, 209, 394)
MAX_ID_DIGITS = 30  # far past any vocabulary (config.MAX_SIZE has 10)


def parse_prompt(text: str) -> list[int]:
    """'1,2,3' -> [1, 2, 3]; anything but comma-separated integers in ASCII digits is refused
    (Python's int() would also read `1_0`, Arabic-Indic and fullwidth digits)."""
    parts = [part.strip() for part in text.split(",")]
    if parts == [""]:
        raise UserError("empty prompt: give at least one token id")
    ids = []
    for part in parts:
        if part == "":
            raise UserError(f"prompt {echo(text)} has an empty token id (stray comma?)")
        if re.fullmatch(r"-?[0-9]+", part, flags=re.ASCII) is None:
            raise UserError(f"prompt token {echo(part)} is not an integer")
        if len(part.lstrip("-")) > MAX_ID_DIGITS:  # thousands of digits would only be slow to read and to echo
            raise UserError(f"prompt token {echo(part)} has {len(part.lstrip('-'))} digits: no token id is that long")
        ids.append(int(part))
    return ids


def check_new_tokens(new_tokens: object) -> int:
    if not isinstance(new_tokens, (int, np.integer)) or isinstance(new_tokens, bool):
        raise UserError(f"new tokens {echo(new_tokens)} is not an integer")
    if new_tokens < 1:
        raise UserError(f"new tokens {new_tokens} is below 1")
    return int(new_tokens)


def check_prompts(prompts: Sequence[Sequence[object]], config: ModelConfig, new_tokens: object) -> np.ndarray:
    """The prompts as one int64 batch [B, P] (PAD on the left of shorter rows), or a UserError
    naming the value and the limit."""
    new_tokens = check_new_tokens(new_tokens)
    if len(prompts) == 0:
        raise UserError("no prompt given")
    batch: list[list[int]] = []
    for index, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise UserError(f"prompt {index} is empty: give at least one token id")
        batch.append([])
        for token in prompt:
            if not isinstance(token, (int, np.integer)) or isinstance(token, bool):
                raise UserError(f"token id {echo(token)} in prompt {index} is not an integer")
            if not 0 <= token < config.vocab_size:
                raise UserError(
                    f"token id {echo(int(token))} in prompt {index} is outside [0, {config.vocab_size}) "
                    f"(vocab_size {config.vocab_size})"
                )
            batch[-1].append(int(token))
    longest = max(len(prompt) for prompt in batch)
    total = longest + new_tokens
    if total > config.max_seq_len:
        raise UserError(
            f"prompt length {longest} + new tokens {new_tokens} = {total} exceeds max_seq_len {config.max_seq_len}"
        )
    # Rows of different lengths are left-padded with PAD: every row's last prompt token in the same column.
    return pad_prompts(batch)[0]  # [B, P]


def check_chunk_sizes(chunk_sizes: Sequence[object], length: int) -> list[int]:
    """forward_chunks' chunk sizes: whole numbers >= 1 that add up to the tokens given. A shortfall
    would silently drop the last tokens' logits; an excess would run past the cache."""
    sizes: list[int] = []
    for size in chunk_sizes:
        if not isinstance(size, (int, np.integer)) or isinstance(size, bool):
            raise UserError(f"chunk size {size!r} is not an integer")
        if size < 1:
            raise UserError(f"chunk size {size} is below 1")
        sizes.append(int(size))
    if sum(sizes) != length:
        raise UserError(f"chunk sizes {sizes} add up to {sum(sizes)}, not the {length} tokens given")
    return sizes
