"""Weights files written by hand: the seed's tensors, a safetensors file written byte by byte
(any header, a hole for its data), and a file of any size that takes no disk."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from kvports.formats.weights import DEFAULT_WEIGHTS

MiB = 2**20
GIB = 2**30


def seed_tensors() -> dict[str, np.ndarray]:
    return load_file(str(DEFAULT_WEIGHTS))


def raw_file(path: Path, header: dict | bytes, data: bytes = b"", size: int | None = None) -> Path:
    """A safetensors file written byte by byte (`header` as JSON, or as given); `size`: the
    data's length, the rest left as a hole, so a file of gigabytes takes no disk."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(raw)) + raw + data)
        if size is not None:
            handle.truncate(8 + len(raw) + size)
    return path


def sparse(path: Path, size: int) -> Path:
    """A file of `size` zero bytes that takes no disk."""
    with open(path, "wb") as handle:
        handle.truncate(size)
    return path
