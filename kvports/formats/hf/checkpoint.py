"""Reading a Hugging Face directory's files: config.json, and the safetensors checkpoint (one
file or shards) through the one reader every safetensors file goes through
(`kvports.formats.weights.SafetensorsFile`). Pickles (`*.bin`) are never opened."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from kvports.formats.weights import SAFETENSORS_DTYPES, Closing, SafetensorsFile, cast_checked, check_finite
from kvports.limits import check_bytes, fmt_bytes
from kvports.shared.config import DTYPES
from kvports.shared.errors import UserError, echo, echo_path

READABLE = ("F32", "F64", "F16", "BF16")  # the float dtypes a checkpoint may hold
KEEPABLE = {"F32": "float32", "F64": "float64"}  # the dtypes our weights file stores as they are


# What a JSON file of a checkpoint may be, checked before it is read: far above any published
# one (a config.json is a few KiB, the index of a 405B model's shards well under 1 MiB; the
# largest tokenizer.json files are tens of MiB), and parsed it takes up to this many times its size.
MAX_JSON_BYTES = 64 * 2**20
MAX_TOKENIZER_BYTES = 512 * 2**20
PARSED_BYTES_PER_BYTE = 10


def check_file_size(path: Path, what: str, cap: int) -> int:
    """A file's size, refused (one `error:` line) past `cap` or past what the memory limit
    allows for reading and parsing it, before a byte of it is read."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise UserError(f"cannot read {what} {echo_path(path)} ({exc.strerror or exc})") from None
    if size > cap:
        raise UserError(f"{what} {echo_path(path)} is {fmt_bytes(size)}, above the {fmt_bytes(cap)} such a file may be")
    check_bytes({what: size, f"parsed {what}": PARSED_BYTES_PER_BYTE * size}, f"reading {echo_path(path)}")
    return size


def read_json(path: Path, what: str) -> Any:
    """A JSON file's value, or one `error:` line: too large, unreadable, not UTF-8, not JSON,
    nested too deep."""
    size = check_file_size(path, what, MAX_JSON_BYTES)
    try:
        with open(path, "rb") as handle:
            raw = handle.read(size)  # what was checked, even of a file that has grown since
        return json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise UserError(f"{what} {echo_path(path)} is not valid JSON (nested too deeply)") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"{what} {echo_path(path)} is not valid JSON ({exc})") from None
    except OSError as exc:
        raise UserError(f"cannot read {what} {echo_path(path)} ({exc.strerror or exc})") from None


def read_hf_config(directory: Path) -> dict:
    path = directory / "config.json"
    try:
        if not directory.is_dir():
            raise UserError(f"Hugging Face directory {echo_path(directory)} does not exist or is not a folder")
        if not path.is_file():
            raise UserError(f"{echo_path(directory)} has no config.json")
    except OSError as exc:  # a name too long, say
        raise UserError(f"cannot read {echo_path(directory)} ({exc.strerror or exc})") from None
    data = read_json(path, "config file")
    if not isinstance(data, dict):
        raise UserError(f"{echo_path(path)} must hold a JSON object")
    return data


def safetensors_files(directory: Path) -> list[Path]:
    """The shards the index names, or every *.safetensors; a pickle-only directory is refused."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        data = read_json(index, "safetensors index")
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(name, str) for name in weight_map.values()):
            raise UserError(f"{echo_path(index)} is not a safetensors index (expected a 'weight_map' object)")
        names = sorted(set(weight_map.values()))
        for name in names:
            if Path(name).name != name or not (directory / name).is_file():
                raise UserError(
                    f"{echo_path(index)} names shard {echo(name)}, which is not a file in {echo_path(directory)}"
                )
        return [directory / name for name in names]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        found = f" (found {', '.join(pickles)}: pickles, which kvports never loads)" if pickles else ""
        raise UserError(f"{echo_path(directory)} has no *.safetensors file{found}; convert it to safetensors first")
    return files


class Checkpoint(Closing):
    """A directory's shards, open: every tensor's dtype and shape from the headers, and each
    tensor read on request, cast and checked, from the shard that holds it."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.stack = contextlib.ExitStack()
        self.where: dict[str, SafetensorsFile] = {}
        try:
            for path in safetensors_files(directory):
                shard = self.stack.enter_context(SafetensorsFile(path, "shard"))
                for name, (dtype, _) in shard.entries.items():
                    if name in self.where:
                        raise UserError(f"tensor {echo(name)} appears in more than one shard of {echo_path(directory)}")
                    if dtype not in READABLE:
                        raise UserError(
                            f"tensor {echo(name)} in {path.name} has dtype {dtype}; kvports reads {', '.join(READABLE)}"
                        )
                    self.where[name] = shard
        except BaseException:
            self.stack.close()
            raise

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: shard.entries[name][1] for name, shard in self.where.items()}

    def target_dtype(self, dtype: str | None) -> str:
        """The dtype the tensors are converted to: `dtype`, or the checkpoint's own (F32 or F64)."""
        if dtype is not None:
            return dtype
        found = sorted({shard.entries[name][0] for name, shard in self.where.items()})
        unkeepable = [dt for dt in found if dt not in KEEPABLE]
        if unkeepable:
            example = next(name for name, shard in self.where.items() if shard.entries[name][0] == unkeepable[0])
            raise UserError(
                f"tensor {echo(example)} has dtype {unkeepable[0]}; our weights hold {', '.join(DTYPES)}: "
                "pass --dtype float32 or --dtype float64 to cast it"
            )
        if len(found) > 1:
            raise UserError(f"{echo_path(self.directory)} mixes dtypes {', '.join(found)}; pass --dtype to choose one")
        return KEEPABLE[found[0]] if found else "float32"

    def read(self, name: str, dtype: str) -> np.ndarray:
        """The tensor at `dtype`, finite there (a float64 value past float32's range is refused)."""
        shard = self.where[name]
        array = shard.read(name)
        source = str(shard.path)
        if array.dtype.name == SAFETENSORS_DTYPES["BF16"]:
            array = array.astype(np.float32)  # bf16 is float32's top half: exact, and NumPy's ufuncs know float32
        check_finite(name, array, source)
        return cast_checked(name, array, dtype, source)

    def close(self) -> None:
        self.stack.close()
