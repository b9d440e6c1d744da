"""What a run may allocate: estimated from the config and the run's sizes alone, and checked
in shared/ before any tensor is read or any port builds anything, the same for every port.

The estimate counts what a run cannot do without:
- the weights twice, at the compute dtype: the arrays read from the file and the
  framework's own copy (torch and JAX copy; NumPy's copy is the cast),
- the KV cache (cached and speculative modes; a ring for a sliding window),
- the logits of the run's widest forward, [B, T, V]: naive mode's whole history, or the
  prompt's prefill, plus the step logits a comparison keeps, [B, N, V],
- that forward's attention scores, [B, H, T, S],
- and for a speculative run with a draft model, the draft's weights, cache and prefill.
One layer's activations, the token buffer and each framework's own overheads come on top:
the estimate is a floor, not a ceiling. Its sum must stay within the limit: the
environment variable KVPORTS_MAX_BYTES (bytes, or with a K, M, G or T suffix: powers of
1024), or else this machine's physical memory. A run past it is one `error:` line giving
the sum, its parts and the limit.

Every size also has its own bound (`config.MAX_SIZE`), stated in its error: JAX computes
ids, positions and cache slots in int32.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
from collections.abc import Sequence

import numpy as np

from kvports.shared.checks import check_count
from kvports.shared.config import ModelConfig, cache_slots, host_dtype, kv_cache_bytes
from kvports.shared.errors import UserError, echo
from kvports.shared.shapes import parameter_count

MAX_BYTES_VARIABLE = "KVPORTS_MAX_BYTES"
FALLBACK_MAX_BYTES = 16 * 2**30  # where the machine's memory cannot be read
UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def fmt_bytes(count: int) -> str:
    if count == 0:
        return "none"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"


def physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows), or no such name
        return None


def max_bytes() -> tuple[int, str]:
    """(the limit, where it comes from)."""
    text = os.environ.get(MAX_BYTES_VARIABLE)
    if text is not None:
        match = re.fullmatch(r"([0-9]{1,20})([KMGT]?)", text.strip(), flags=re.ASCII)
        if match is None:
            raise UserError(
                f"{MAX_BYTES_VARIABLE}={echo(text)} is not a number of bytes (digits, then K, M, G or T if wanted)"
            )
        return int(match[1]) * UNITS[match[2]], f"{MAX_BYTES_VARIABLE}={text.strip()}"
    memory = physical_memory()
    if memory is None:
        return FALLBACK_MAX_BYTES, f"the default; set {MAX_BYTES_VARIABLE} to change it"
    return memory, f"this machine's memory; set {MAX_BYTES_VARIABLE} to change it"


def check_bytes(parts: dict[str, int], what: str) -> None:
    """Refuse `what` if its parts add up past the limit."""
    total = sum(parts.values())
    limit, source = max_bytes()
    if total > limit:
        shown = ", ".join(f"{name} {fmt_bytes(count)}" for name, count in parts.items() if count)
        raise UserError(
            f"{what} would allocate at least {fmt_bytes(total)} ({shown}), above the limit of "
            f"{fmt_bytes(limit)} ({source})"
        )


def model_bytes(
    config: ModelConfig,
    itemsize: int,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    mode: str,
    draft_tokens: int = 0,
) -> dict[str, int]:
    """One model's part of a run in one mode (see the module's docstring)."""
    chunk = draft_tokens + 1 if mode == "speculative" else 1
    total = prompt_len + new_tokens + (draft_tokens + 1 if mode == "speculative" else 0)
    widest = total if mode == "naive" else max(prompt_len, chunk)  # the longest forward's T
    keys = widest if mode == "naive" else cache_slots(config, total, chunk)  # what a forward attends over
    return {
        "weights": 2 * parameter_count(config) * itemsize,
        "KV cache": 0 if mode == "naive" else kv_cache_bytes(config, batch, total, itemsize, chunk),
        "logits": batch * (widest + new_tokens) * config.vocab_size * itemsize,
        "attention scores": batch * config.n_heads * widest * keys * itemsize,
    }


def check_run(
    config: ModelConfig,
    dtype: str,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    modes: Sequence[str],
    draft_tokens: int = 0,
    draft: ModelConfig | None = None,
) -> None:
    """A generation's sizes against their bounds, then the bytes of the largest of its runs
    (`modes`, run one after another) against the limit."""
    check_count("batch", batch)
    check_count("prompt length", prompt_len)
    check_count("new tokens", new_tokens)
    itemsize = np.dtype(host_dtype(dtype)).itemsize  # bfloat16: the float32 arrays read, the larger
    largest: tuple[str, dict[str, int]] = ("", {})
    for mode in modes:
        parts = model_bytes(config, itemsize, batch, prompt_len, new_tokens, mode, draft_tokens)
        if mode == "speculative" and draft is not None:
            drafted = model_bytes(draft, itemsize, batch, prompt_len, new_tokens, mode, draft_tokens)
            parts.update({f"draft {name}": count for name, count in drafted.items() if name != "logits"})
        if sum(parts.values()) > sum(largest[1].values()):
            largest = (mode, parts)
    mode, parts = largest
    check_bytes(parts, f"a {mode} run of {batch} x {prompt_len}-token prompt + {new_tokens} new tokens in {dtype}")


# ---------------------------------------------------------------- prompt files

MAX_PROMPT_FILE_BYTES = 16 * 2**20  # far past any batch a run can hold


def read_lines(source: str, flag: str, cap: int = MAX_PROMPT_FILE_BYTES) -> list[tuple[int, str]]:
    """(1-based line number, text) of each line of a UTF-8 file, or of stdin for "-", that is not
    blank; at most `cap` bytes are read."""
    import sys
    from pathlib import Path

    from kvports.shared.errors import echo_path

    try:
        if source == "-":
            data = sys.stdin.buffer.read(cap + 1)
            where = "stdin"
        else:
            path = Path(source)
            where = f"{flag} {echo_path(path)}"
            if not path.is_file():
                raise UserError(f"{where} {'is not a regular file' if path.exists() else 'does not exist'}")
            with path.open("rb") as file:
                data = file.read(cap + 1)
    except OSError as exc:
        raise UserError(f"cannot read {flag} {echo(source)} ({exc.strerror or exc})") from None
    if len(data) > cap:
        raise UserError(f"{where} holds more than {fmt_bytes(cap)}, the most {flag} reads")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{where} is not UTF-8 text") from None
    lines = [(number, line.removesuffix("\r")) for number, line in enumerate(text.split("\n"), start=1)]
    kept = [(number, line) for number, line in lines if line.strip()]
    if not kept:
        raise UserError(f"{where} has no line to run")
    return kept


def release_freed_memory() -> None:
    """Hands the heap a load has freed back to the system. Loading copies the file's arrays into
    the framework's own memory and layout, then frees the first copies; glibc keeps freed blocks of
    a few MB in its heap (its mmap threshold rises after the first large free), so without this a
    loaded torch model held its weights' size again in freed memory (SmolLM2: 1.09 GB -> 0.68 GB)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # another C library (musl has no malloc_trim): nothing to hand back
        pass
