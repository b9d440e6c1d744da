"""The channel between `kvports check` and its child process: one JSON object a line, an array
as {"array": base64, "dtype": D, "shape": [...]}. What the child sends is the implementation's
values only, and the parent reads it as untrusted: a line is bounded (MAX_LINE), parsed with
JSON's own nesting limit, and every field it expects is checked for its type; anything else is
Malformed, which fails the call it answered (isolate.py), never the checker.

A 16-bit array travels in its own width (bfloat16 as the top 16 bits of each float32), so the
parent holds logits at a 16-bit precision only where the values themselves have no more.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from typing import Any

import numpy as np

# Bytes in one reply: 3 times the largest a check asks for (float64 logits [1, 512, 500] in base64). JSON's
# objects take up to ~20 times their text's bytes (a list of empty lists): 8 MiB stays within ~200 MB.
MAX_LINE = 8 << 20
MAX_ARRAY = 4 << 20  # bytes of an array's values the child sends; a larger one (a wrong shape) goes as its shape
MAX_DIMS = 8
# The types an array may travel in; bfloat16 (no NumPy type of its own) as uint16 bit patterns.
INTEGERS = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
DTYPES = (*INTEGERS, "float16", "float32", "float64", "bfloat16")
LOW_PRECISION = ("bfloat16", "float16")  # logits an implementation may compute in, held at their own precision


class Malformed(Exception):
    """What the child sent is not what the parent asked for: not JSON, the wrong type, too large."""


def encode(message: Any) -> bytes:
    return json.dumps(message, allow_nan=False).encode() + b"\n"


def decode(line: bytes) -> Any:
    """One line's JSON value; Malformed where it is not JSON (or nests past JSON's own limit)."""
    try:
        return json.loads(line)
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise Malformed(f"not a JSON line ({type(error).__name__})") from None


def pack(array: np.ndarray, low: str = "", limit: int | None = MAX_ARRAY) -> dict[str, Any]:
    """An array as it travels: low ("bfloat16", "float16") its values' 16-bit type. A type that cannot
    travel (an object array from ragged lists, complex numbers, text), or an array of more than
    `limit` bytes (the child's replies: MAX_ARRAY; the parent's requests: None), goes as its shape
    alone and arrives as an array of objects: the logits' check then says its shape is not the one
    asked for, or that it is not floats."""
    array = np.asarray(array)
    if (limit is not None and array.nbytes > limit) or array.dtype.name not in DTYPES:
        return {"array": None, "dtype": "object", "shape": list(array.shape)}
    array = np.ascontiguousarray(array)
    if low == "bfloat16":
        bits = (array.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return {"array": base64.b64encode(bits.tobytes()).decode(), "dtype": "bfloat16", "shape": list(array.shape)}
    if low == "float16":
        array = array.astype(np.float16)
    return {"array": base64.b64encode(array.tobytes()).decode(), "dtype": array.dtype.name, "shape": list(array.shape)}


def unpack(spec: Any, what: str) -> tuple[np.ndarray, str]:
    """An array pack() gave, and its 16-bit type ("" for none); Malformed naming `what` otherwise."""
    if not isinstance(spec, dict) or set(spec) != {"array", "dtype", "shape"}:
        raise Malformed(f"{what} is not an array")
    shape, dtype, data = spec["shape"], spec["dtype"], spec["array"]
    if not (isinstance(shape, list) and len(shape) <= MAX_DIMS and all(natural(n) for n in shape)):
        raise Malformed(f"{what}'s shape is not a list of at most {MAX_DIMS} sizes")
    if dtype == "object" and data is None:  # a type that could not travel: its shape, no values (no memory either)
        return np.broadcast_to(np.empty((), dtype=object), shape), ""
    if dtype not in DTYPES or not isinstance(data, str):
        raise Malformed(f"{what} has no values of a numeric type")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise Malformed(f"{what}'s values are not base64") from None
    wire = np.dtype(np.uint16 if dtype == "bfloat16" else dtype)
    if len(raw) != math.prod(shape) * wire.itemsize:
        raise Malformed(f"{what} has {len(raw)} bytes, not the {math.prod(shape) * wire.itemsize} its shape needs")
    array = np.frombuffer(raw, dtype=wire).reshape(shape)
    if dtype == "bfloat16":  # the top 16 bits of a float32: exactly the value
        return (array.astype(np.uint32) << 16).view(np.float32), "bfloat16"
    if dtype == "float16":
        return array.astype(np.float32), "float16"
    return array.copy(), ""  # writable, as the checks' own arrays are


def natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 40


def member(message: Any, name: str, what: str) -> Any:
    """message[name], of any type; Malformed where message is no object holding it."""
    if not isinstance(message, dict) or name not in message:
        raise Malformed(f"{what} has no {name!r}")
    return message[name]


def field(message: Any, name: str, kind: type | tuple[type, ...], what: str) -> Any:
    """message[name], which must be of `kind`; Malformed otherwise."""
    value = member(message, name, what)
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _kinds(kind)):
        raise Malformed(f"{what}'s {name!r} is not a {_kinds(kind)[0].__name__}")
    return value


def _kinds(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)
