"""The checks the ports share, before any framework code runs: the generation settings every
port's generators take (`GenerationConfig.validate`), forward_chunks' chunk sizes, and how N
devices hold the key/value heads. Each names its value the way its caller does (`Names`: a
command-line flag, or the Python API's own argument).

JAX clamps an out-of-range gather or cache write without a word and NumPy wraps a negative
index, so a bad value would give plausible, wrong tokens: every port gets the same message.
The application's checks of a whole run (prompts, precision, drafts, devices) are
kvports/validation.py's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvports.shared.config import MAX_SIZE, ModelConfig
from kvports.shared.errors import UserError, echo

if TYPE_CHECKING:  # generation.py imports this module: its validate() is check_generation
    from kvports.shared.generation import GenerationConfig

MAX_SEED = 2**64 - 1  # Philox keys are 64-bit words


# Every port divides the logits, cast to float64, by the temperature, and softmax subtracts
# the largest. XLA computes x / T as x * (1 / T) in one fusion and as x / T in another: the two
# differ by an ulp of x / T, which exp makes a factor e**ulp; once logits / T pass about 6e18
# that is inf or 0, JAX's probabilities NaN and its draws token 0 forever (so does every port
# once they overflow float64, below 1.9e-270). Down to MIN_TEMPERATURE, a logit below
# MAX_EXACT_LOGIT divided by it stays under 2**53, where float64 holds every integer and the
# ulp is at most 1, which exp cannot blow up. Real models' logits are tens, the seed's about 2.
# The top is far past where sampling is already uniform (torch and JAX fail on a whole-number
# temperature past int64, where NumPy runs).
MAX_EXACT_LOGIT = 2**13


MIN_TEMPERATURE = 1e-12  # a round number above MAX_EXACT_LOGIT / 2**53 = MAX_EXACT_LOGIT * finfo(float64).eps / 2


MAX_TEMPERATURE = 1e18


@dataclass(frozen=True)
class Names:
    """How a message names an input: the command line by its flags' wording (`--draft-tokens 17`,
    `top-k -1`), the Python API by its own arguments (`draft_tokens=17`, `top_k=-1`), a batch
    file's line and the server's body by their fields (`max_new_tokens 0`, `'top_k' -1`)."""

    api: bool
    labels: tuple[tuple[str, str], ...] = ()  # the command line's word for a field, where it differs

    def label(self, field: str) -> str:
        return field if self.api else dict(self.labels).get(field, field)

    def show(self, field: str, text: str) -> str:
        """`field` holding the value written as `text`: "new tokens 0" or "new_tokens=0"."""
        return f"{field}={text}" if self.api else f"{self.label(field)} {text}"


COMMAND_LINE = Names(
    api=False,
    labels=(
        ("new_tokens", "new tokens"),
        ("top_k", "top-k"),
        ("top_p", "top-p"),
        ("stop_ids", "stop id"),
        ("draft_tokens", "--draft-tokens"),
        ("ngram", "--ngram"),
        ("draft", "--draft"),
        ("mode", "--mode"),
        ("framework", "--framework"),
        ("dtype", "--dtype"),
        ("device", "--device"),
        ("tensor_parallel", "--tensor-parallel"),
        ("threads", "--threads"),
        ("logprobs", "--logprobs"),
        ("seeds", "--seed"),
        ("num_samples", "--num-samples"),
        ("quant", "--quant"),
        ("response_format", "--json-schema"),
    ),
)


API = Names(api=True)


# A batch file's line: the command line's words, but the line's own field for the new tokens.
BATCH_LINE = Names(
    api=False,
    labels=(
        *COMMAND_LINE.labels,
        ("new_tokens", "max_new_tokens"),
        ("messages", "'messages'"),
        ("response_format", "'response_format'"),
    ),
)


# The server's request bodies: each field by its name in the OpenAI body, quoted as the body writes it.
SERVER = Names(
    api=False,
    labels=(
        ("prompt", "'prompt'"),
        ("messages", "'messages'"),
        ("new_tokens", "'max_tokens'"),
        ("temperature", "'temperature'"),
        ("top_k", "'top_k'"),
        ("top_p", "'top_p'"),
        ("seed", "'seed'"),
        ("seeds", "'seed'"),
        ("stop_ids", "stop id"),
        ("logprobs", "'logprobs'"),
        ("response_format", "'response_format'"),
    ),
)


def python_value(value: object) -> object:
    """A NumPy scalar (np.float32(0.5), np.uint64(3), np.bool_) as the Python number or bool it holds,
    so that every check and every port sees the same value; anything else as given."""
    return value.item() if isinstance(value, np.generic) and not isinstance(value, (np.str_, np.bytes_)) else value


def is_integer(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_range(field: str, value: object, low: int, names: Names, high: int | None = None) -> int:
    """A whole number in [low, high]: "new tokens 0 is below 1", "draft_tokens=17 is above 16"."""
    if not is_integer(value):
        raise UserError(f"{names.show(field, echo(value))} is not an integer")
    assert isinstance(value, (int, np.integer))
    if value < low:
        raise UserError(f"{names.show(field, str(value))} is below {low}")
    if high is not None and value > high:
        raise UserError(f"{names.show(field, str(value))} is above {high}")
    return int(value)


def check_choice(field: str, value: object, choices: Sequence[str], names: Names) -> str:
    if not isinstance(value, str) or value not in choices:
        raise UserError(f"{names.show(field, repr(value))} is not one of {', '.join(choices)}")
    return value


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


def check_generation(generation: GenerationConfig, vocab_size: int, names: Names = COMMAND_LINE) -> None:
    """The same one-line errors for every port, before any framework code runs."""
    check_int(names.label("new_tokens"), generation.max_new_tokens, 1, names.api)
    temperature = generation.temperature
    number = isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
    if not number or not (temperature == 0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE):
        raise UserError(
            f"{names.show('temperature', repr(temperature))} must be a finite number >= 0 (0 means greedy; else in "
            f"[{MIN_TEMPERATURE:.3g}, {MAX_TEMPERATURE:g}]: logits divided by less lose their exactness in "
            "float64, and the ports their agreement)"
        )
    top_k = check_int(names.label("top_k"), generation.top_k, 0, names.api)
    if top_k > MAX_SIZE:  # past the vocabulary it means every token, as 0 does
        raise UserError(f"{names.show('top_k', str(top_k))} is above {MAX_SIZE}")
    top_p = generation.top_p
    if not isinstance(top_p, (int, float)) or isinstance(top_p, bool) or not 0 < top_p <= 1:
        raise UserError(f"{names.show('top_p', repr(top_p))} must be in (0, 1] (1 means no nucleus filter)")
    check_int(names.label("seed"), generation.seed, 0, names.api, MAX_SEED)
    check_count(names.label("seeds"), len(generation.seeds))
    for seed in generation.seeds:
        check_int(names.label("seeds"), seed, 0, names.api, MAX_SEED)
    for stop in generation.stop_ids:
        check_int(names.label("stop_ids"), stop, 0, names.api, vocab_size - 1)


def check_int(name: str, value: object, low: int, api: bool = False, high: int | None = None) -> int:
    shown = f"{name}=" if api else f"{name} "
    if not is_integer(value):
        raise UserError(f"{shown}{value!r} is not an integer")
    assert isinstance(value, (int, np.integer))
    if value < low or (high is not None and value > high):
        limit = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise UserError(f"{shown}{value} must be {limit}")
    return int(value)


def kv_layout(config: ModelConfig, tensor_parallel: int) -> str | None:
    """How N devices hold the key/value heads: "split" (each device its own Hkv / N), "replicate"
    (N a multiple of Hkv: each head copied to the N / Hkv devices whose query heads read it), or None."""
    if config.kv_heads % tensor_parallel == 0:
        return "split"
    return "replicate" if tensor_parallel % config.kv_heads == 0 else None


def check_count(name: str, value: int, high: int = MAX_SIZE) -> None:
    """A count read from the user, bounded before anything is sized by it."""
    if value > high:
        raise UserError(f"{name} {echo(value)} is above {high}")
