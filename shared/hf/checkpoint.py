"""Reading a Hugging Face directory's files by hand: config.json, and the safetensors
checkpoint (one file or shards) as raw arrays. Pickles (`*.bin`) are never opened."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from kvports.shared.config import DTYPES
from kvports.shared.errors import UserError
from kvports.shared.weights import read_header

# Safetensors dtype -> how the bytes are read. BF16 has no NumPy dtype: its bits are
# the top half of a float32, so it is read as uint16 and shifted (see to_float).
RAW_DTYPES = {"F32": "<f4", "F64": "<f8", "F16": "<f2", "BF16": "<u2"}
KEEPABLE = {"F32": "float32", "F64": "float64"}  # the dtypes our weights file stores as they are


def read_hf_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not directory.is_dir():
        raise UserError(f"Hugging Face directory {str(directory)!r} does not exist or is not a folder")
    if not path.is_file():
        raise UserError(f"{str(directory)!r} has no config.json")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"{str(path)!r} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise UserError(f"{str(path)!r} must hold a JSON object")
    return data


def safetensors_files(directory: Path) -> list[Path]:
    """The shards the index names, or every *.safetensors; a pickle-only directory is refused."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
            raise UserError(f"{str(index)!r} is not a safetensors index (expected a 'weight_map' object)") from None
        for name in names:
            if not isinstance(name, str) or Path(name).name != name or not (directory / name).is_file():
                raise UserError(f"{str(index)!r} names shard {name!r}, which is not a file in {str(directory)!r}")
        return [directory / name for name in names]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        found = f" (found {', '.join(pickles)}: pickles, which kvports never loads)" if pickles else ""
        raise UserError(f"{str(directory)!r} has no *.safetensors file{found}; convert it to safetensors first")
    return files


def read_safetensors(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """{name: (safetensors dtype, raw array)}, memory-mapped; bf16 comes back as uint16 bits."""
    header, _ = read_header(path)
    with path.open("rb") as handle:
        data_start = 8 + int.from_bytes(handle.read(8), "little")
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    out: dict[str, tuple[str, np.ndarray]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, shape = info.get("dtype"), info.get("shape")
        if dtype not in RAW_DTYPES:
            raise UserError(f"tensor {name!r} in {path.name} has dtype {dtype}; kvports reads {', '.join(RAW_DTYPES)}")
        if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
            raise UserError(f"tensor {name!r} in {path.name} has a malformed shape {shape!r}")
        start, end = info["data_offsets"]
        numpy_dtype = np.dtype(RAW_DTYPES[dtype])
        if end - start != math.prod(shape) * numpy_dtype.itemsize:
            raise UserError(
                f"tensor {name!r} in {path.name}: shape {shape} of {dtype} needs "
                f"{math.prod(shape) * numpy_dtype.itemsize} bytes, its offsets hold {end - start}"
            )
        out[name] = (dtype, raw[data_start + start : data_start + end].view(numpy_dtype).reshape(shape))
    return out


def to_float(dtype: str, array: np.ndarray, target: str) -> np.ndarray:
    if dtype == "BF16":
        array = (array.astype(np.uint32) << 16).view(np.float32)  # bf16 is float32's top 16 bits
    return np.array(array, dtype=target)  # a copy: the memmap closes with the file


def load_hf_tensors(directory: Path, dtype: str | None) -> tuple[dict[str, np.ndarray], str]:
    """All tensors of the directory as float arrays of one dtype: the file's own (F32 or
    F64) or, if `dtype` is given, that one. Half-precision files need `dtype`."""
    raw: dict[str, tuple[str, np.ndarray]] = {}
    for path in safetensors_files(directory):
        for name, item in read_safetensors(path).items():
            if name in raw:
                raise UserError(f"tensor {name!r} appears in more than one shard of {str(directory)!r}")
            raw[name] = item
    found = sorted({dt for dt, _ in raw.values()})
    if dtype is None:
        unkeepable = [dt for dt in found if dt not in KEEPABLE]
        if unkeepable:
            example = next(name for name, (dt, _) in raw.items() if dt == unkeepable[0])
            raise UserError(
                f"tensor {example!r} has dtype {unkeepable[0]}; our weights hold {', '.join(DTYPES)}: "
                "pass --dtype float32 or --dtype float64 to cast it"
            )
        if len(found) > 1:
            raise UserError(f"{str(directory)!r} mixes dtypes {', '.join(found)}; pass --dtype to choose one")
        dtype = KEEPABLE[found[0]] if found else "float32"
    return {name: to_float(dt, array, dtype) for name, (dt, array) in raw.items()}, dtype
