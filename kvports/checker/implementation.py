"""What the checks call: an implementation, NumPy in and NumPy out, the same for both interfaces.
Its driver (plugin.py) calls the implementation's code, in this process or, under `kvports check`,
in a child process (isolate.py's Remote); either way only values come back, and they are held
here to what they must be (the logits' shape, type and finiteness, the tokens' shape) before
any check compares them. The loops of a cached run and of an adapter's generators run here,
one driver call per step, so that each call is timed on its own."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

from kvports.checker.plugin import Calls, ImplementationError
from kvports.shared.config import ModelConfig
from kvports.shared.errors import UserError


class Driver(Protocol):
    kind: str
    framework: str
    full_name: str
    step_name: str

    def build(self, config: ModelConfig, weights: dict[str, np.ndarray], dtype: str) -> Any: ...
    def full(self, model: Any, tokens: np.ndarray) -> tuple[np.ndarray, str]: ...
    def step(self, model: Any, tokens: np.ndarray, state: Any) -> tuple[np.ndarray, str, Any]: ...
    def generate(self, model: Any, prompt: np.ndarray, n: int, mode: str) -> np.ndarray: ...
    def can_step(self, model: Any) -> bool: ...
    def training(self, model: Any) -> bool: ...
    def to_eval(self, model: Any) -> None: ...
    def prefill(self, model: Any, prompt: np.ndarray) -> tuple[str, Calls | None]: ...


@contextlib.contextmanager
def marked(start: int) -> Iterator[None]:
    """An error raised by a cached call after the first (the prefill) says so: the cache broke it."""
    try:
        yield
    except ImplementationError as error:
        error.after_first_chunk = start > 0
        raise


class Implementation:
    def __init__(self, driver: Driver):
        self.driver = driver
        self.kind, self.framework = driver.kind, driver.framework
        self.logits_dtype = ""  # bfloat16 or float16 where the implementation's logits come back in one
        self.last_only = False  # step gave a prompt's last position only: the others are not compared

    def build(self, config: ModelConfig, weights: dict[str, np.ndarray], dtype: str) -> Any:
        self.V = config.vocab_size
        return self.driver.build(config, weights, dtype)

    def full(self, model: Any, tokens: np.ndarray) -> np.ndarray:
        logits, low = self.driver.full(model, tokens)
        return self.checked_logits(self.driver.full_name, logits, low, tokens.shape[0], tokens.shape[1])

    def can_step(self, model: Any) -> bool:
        return self.driver.can_step(model)

    def one_step(self, model: Any, tokens: np.ndarray, state: Any) -> tuple[np.ndarray, Any]:
        logits, low, state = self.driver.step(model, tokens, state)
        B, T = tokens.shape
        if self.kind == "adapter" and T > 1 and logits.shape[:2] == (B, 1):  # a prompt's last position only
            self.last_only = True
            full = np.full((B, T, self.V), np.nan)  # [B, T, V]: NaN where nothing came back, never compared
            full[:, -1:] = self.checked_logits(self.driver.step_name, logits, low, B, 1)
            return full, state
        return self.checked_logits(self.driver.step_name, logits, low, B, T), state

    def cached(self, model: Any, tokens: np.ndarray, chunks: list[int]) -> np.ndarray:
        """tokens [B, T] fed in chunks into one cache (the first chunk the prefill); logits [B, T, V]."""
        state, pieces, start = None, [], 0
        for size in chunks:
            with marked(start):
                logits, state = self.one_step(model, tokens[:, start : start + size], state)
            pieces.append(logits)
            start += size
        return np.concatenate(pieces, axis=1)

    def generators(self) -> tuple[str, ...]:
        return ("naive", "cached")

    def generate(self, model: Any, prompt: np.ndarray, n: int, mode: str) -> np.ndarray:
        """Greedy tokens [B, P + n]: the post's own generator, or an adapter's loop over full or step."""
        if self.kind == "post":
            return self.tokens(f"generate_{mode}", self.driver.generate(model, prompt, n, mode), prompt, n)
        tokens = np.array(prompt, dtype=np.int64)
        if mode == "naive":
            for _ in range(n):
                token = self.full(model, tokens)[:, -1].argmax(-1)[:, None]  # [B, 1]
                tokens = np.concatenate([tokens, token], axis=1)
            return tokens
        logits, state = self.one_step(model, tokens, None)
        for i in range(n):
            token = logits[:, -1].argmax(-1)[:, None]  # [B, 1]
            tokens = np.concatenate([tokens, token], axis=1)
            if i < n - 1:
                logits, state = self.one_step(model, token, state)
        return tokens

    @staticmethod
    def tokens(function: str, tokens: np.ndarray, prompt: np.ndarray, n: int) -> np.ndarray:
        """A generator's tokens as [B, P + n] (the n new ones alone are taken with the prompt before them)."""
        B, P = prompt.shape
        if tokens.shape == (B, n):
            tokens = np.concatenate([prompt, tokens], axis=1)
        if tokens.shape != (B, P + n):
            message = f"returned tokens of shape {list(tokens.shape)}, not {[B, P + n]}"
            raise ImplementationError(function, "ValueError", message, what="value")
        if tokens.dtype == object or not np.isfinite(tokens.astype(np.float64)).all():
            raise ImplementationError(function, "ValueError", "returned tokens that are not numbers", what="value")
        return tokens

    def prefill(self, model: Any, prompt: np.ndarray) -> tuple[str, Calls | None]:
        return self.driver.prefill(model, prompt)

    def training(self, model: Any) -> bool:
        return self.driver.training(model)

    def to_eval(self, model: Any) -> None:
        self.driver.to_eval(model)

    def checked_logits(self, function: str, logits: np.ndarray, low: str, B: int, T: int) -> np.ndarray:
        """The logits a call returned, [B, T, V], or a UserError: the wrong shape, not floats, not finite."""
        if low:  # held at its own precision, and told so
            self.logits_dtype = low
        V = self.V
        if logits.shape != (B, T, V):
            raise UserError(
                f"{function} returned logits of shape {list(logits.shape)}, expected [B, T, V] = {[B, T, V]}"
            )
        if not np.issubdtype(logits.dtype, np.floating):
            raise UserError(f"{function} returned logits of dtype {logits.dtype}, expected floats")
        if not np.isfinite(logits).all():
            b, t, v = np.argwhere(~np.isfinite(logits))[0]
            raise UserError(
                f"{function} returned non-finite logits ({logits[b, t, v]} at row {b}, position {t}, id {v})"
            )
        return logits
