"""The one exception type that means "the user gave us something wrong", and how a message
shows the value it refuses."""

from __future__ import annotations

MAX_ECHO = 60  # characters of a refused value a message repeats
MAX_PATH_ECHO = 300  # characters of a path: the user's own, and worth showing whole
MAX_MESSAGE = 1000  # characters of a whole message: an echo of a caught exception could be any length


class UserError(ValueError):
    """A bad input. The command line prints it as one `error: ...` line and exits 2: the
    message is made one line (a caught library error may hold newlines) and bounded."""

    def __init__(self, message: str):
        line = " ".join(str(message).split())
        super().__init__(line if len(line) <= MAX_MESSAGE else line[: MAX_MESSAGE - 3] + "...")


def echo(value: object, limit: int = MAX_ECHO) -> str:
    """repr(value), shortened: a 5000-digit id or a megabyte of JSON is named, not printed."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**limit:
        # repr of a huge int is slow (and refused past 4300 digits): say how long it is instead.
        return f"<an integer of about {value.bit_length() * 3 // 10 + 1} digits>"
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[: limit - 3]}... ({len(text)} characters)"


def echo_path(path: object) -> str:
    """A path as a message shows it: quoted (a newline in it stays escaped), shortened only
    when very long."""
    return echo(str(path), MAX_PATH_ECHO)


class NonFiniteLogits(UserError):
    """A forward pass whose logits hold an inf or a NaN: the model's weights, at this dtype, overflow
    (finite weights can), so every token chosen from that step on would be noise. A UserError, not
    a bug: it is the model's data and the dtype the user chose, and the user's remedy is a flag (a
    wider dtype, other weights), so it is one `error:` line and exit 2 like any refused input.
    `where`: "row 0" in a generation, "request 'a'" in a batch; `dtype_hint`: how the caller names
    the wider dtype (the command line's flag, the API's argument)."""

    def __init__(self, step: int, where: str, dtype: str, dtype_hint: str = "--dtype float64"):
        self.step, self.where, self.dtype = step, where, dtype
        remedy = f"try {dtype_hint}" if dtype != "float64" else "the weights are too large for this model"
        super().__init__(
            f"step {step} produced a non-finite logit ({where}): the forward pass overflowed at {dtype}; {remedy}"
        )
