"""The weights file every port loads: safetensors, the seed's state_dict names and
(out, in) Linear layouts, the ModelConfig as JSON under the metadata key `config`.

Every safetensors file (ours, and a Hugging Face checkpoint's shards) is read by one
reader, `SafetensorsFile`: the safetensors library's `safe_open`, which enforces the
format's rules (a bounded header; offsets in order, in bounds, never overlapping,
covering the data exactly). One open file serves the header, the metadata and the
tensors, so a file replaced while it is read is read whole, the old one or the new one.
Names, dtypes and shapes are checked against the config from the header alone, before
any tensor is read; then each tensor is checked finite at the dtype the run computes
in. Nothing is ever unpickled.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import numpy as np

from kvports.shared.config import STORED_DTYPES, ModelConfig, host_dtype
from kvports.shared.errors import UserError, echo, echo_path
from kvports.shared.files import write_atomic
from kvports.shared.quantization import q4_names
from kvports.shared.shapes import iter_expected

SAFETENSORS_DTYPES = {"F32": "float32", "F64": "float64", "F16": "float16", "BF16": "bfloat16"}
DEFAULT_WEIGHTS = Path(__file__).parent.parent / "data" / "seed_model.safetensors"

# What the library's refusals mean, in the words a user knows the file by.
SAFETENSORS_REFUSALS = {
    "header too small": "shorter than a safetensors header",
    "header too large": "its header length is past the format's 100 MB",
    "invalid JSON": "its header is not the JSON the format allows",
    "invalid UTF-8": "its header is not UTF-8",
    "not fully covered": "truncated, or bytes past its last tensor",
    "invalid offset": "tensors' byte ranges out of order, overlapping or outside the file",
    "invalid shape": "a tensor's shape and dtype do not match its byte range",
    "overflow": "a tensor's shape is too large to address",
}


OPEN = TypeVar("OPEN", bound="Closing")


class Closing:
    """A reader holding files open: `with` closes them."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: OPEN) -> OPEN:
        return self

    def __exit__(self, kind: type | None, value: BaseException | None, traceback: TracebackType | None) -> None:
        self.close()


class SafetensorsFile(Closing):
    """One safetensors file, open: its tensors' dtypes and shapes (from the header, checked by
    the library), its metadata, and each tensor read on request from the same open file."""

    def __init__(self, path: os.PathLike, what: str = "weights file"):
        from safetensors import SafetensorError, safe_open

        self.path, self.what = Path(path), what
        name = f"{what} {echo_path(path)}"
        try:
            status = os.stat(path)
        except FileNotFoundError:
            raise UserError(f"{name} does not exist") from None
        except OSError as exc:  # a name too long, a folder without permission, ...
            raise UserError(f"cannot read {name} ({exc.strerror or exc})") from None
        if not stat.S_ISREG(status.st_mode):
            raise UserError(f"{name} is not a regular file")
        if status.st_size == 0:
            raise UserError(f"{name} is empty")
        try:
            self.handle = safe_open(str(path), framework="numpy")
        except SafetensorError as exc:
            raise UserError(f"{name} is not a valid safetensors file ({explain(str(exc))})") from None
        except OSError as exc:
            raise UserError(f"cannot read {name} ({exc.strerror or exc})") from None
        self.metadata: dict[str, str] = self.handle.metadata() or {}
        # name -> (safetensors dtype, shape); bounded by the header, which the library bounds.
        self.entries: dict[str, tuple[str, tuple[int, ...]]] = {}
        for key in self.handle.offset_keys():
            view = self.handle.get_slice(key)
            self.entries[key] = (view.get_dtype(), tuple(view.get_shape()))

    def read(self, name: str) -> np.ndarray:
        """A tensor as a NumPy array of the file's dtype (bfloat16 through ml_dtypes)."""
        from safetensors import SafetensorError

        if self.entries[name][0] == "BF16":
            try:
                import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy, which safetensors asks for)
            except ImportError:
                raise UserError(
                    f"tensor {echo(name)} is bfloat16, which needs ml_dtypes (pip install ml_dtypes)"
                ) from None
        try:
            return self.handle.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise UserError(
                f"{self.what} {echo_path(self.path)}: tensor {echo(name)} could not be read ({exc})"
            ) from None

    def close(self) -> None:
        self.handle.__exit__(None, None, None)


def explain(message: str) -> str:
    for phrase, meaning in SAFETENSORS_REFUSALS.items():
        if phrase in message:
            return f"{meaning}: {message}"
    return message


def check_entries(entries: Mapping[str, tuple[str, tuple[int, ...]]], config: ModelConfig, source: str) -> str:
    """Names, shapes and dtypes ({name: (dtype, shape)}) against the config; the one dtype
    (float32 or float64). The expected names are walked lazily and the walk stops at the
    first one missing, so it takes at most len(entries) + 1 steps, whatever n_layers says."""
    source = echo_path(source)
    walked: set[str] = set()
    for name, shape in iter_expected(config):
        if name not in entries:
            raise UserError(f"weights {source}: missing tensor {name!r} (expected shape {list(shape)})")
        dtype, found = entries[name]
        if SAFETENSORS_DTYPES.get(dtype, dtype) not in STORED_DTYPES:
            raise UserError(f"tensor {name!r} has dtype {dtype}; supported: {', '.join(STORED_DTYPES)}")
        if found != shape:
            raise UserError(
                f"weights {source}: tensor {name!r} has shape {list(found)}, the config needs {list(shape)}"
            )
        walked.add(name)
    if len(walked) < len(entries):
        extra = sorted(set(entries) - walked)[0]
        raise UserError(f"weights {source}: unexpected tensor {echo(extra)} (not in this config's model)")
    dtypes = sorted({SAFETENSORS_DTYPES.get(dtype, dtype) for dtype, _ in entries.values()})
    if len(dtypes) > 1:
        raise UserError(f"weights {source}: tensors mix dtypes {dtypes}; use one")
    return dtypes[0]


def check_tensors(tensors: Mapping[str, np.ndarray], config: ModelConfig, source: str) -> None:
    """Tensors in memory, checked as a file's are: names, shapes, dtypes, finite values."""
    check_entries({name: (str(array.dtype), tuple(array.shape)) for name, array in tensors.items()}, config, source)
    for name, array in tensors.items():
        check_finite(name, array, source)


def check_finite(name: str, array: np.ndarray, source: str) -> None:
    if not np.isfinite(array).all():
        raise UserError(f"weights {echo_path(source)}: tensor {name!r} has non-finite values")


def cast_checked(name: str, array: np.ndarray, dtype: str, source: str) -> np.ndarray:
    """The array at `dtype`, refused if a finite value overflows there: float64 weights past
    float32's range would be inf in a float32 run, and every logit NaN."""
    dtype = host_dtype(dtype)
    if array.dtype == np.dtype(dtype):
        return array
    with np.errstate(over="ignore"):  # the overflow is the finding, not a warning
        cast = array.astype(dtype)
    if not np.isfinite(cast).all():
        index = int(np.flatnonzero(~np.isfinite(cast))[0])
        value = array.reshape(-1)[index]
        raise UserError(
            f"weights {echo_path(source)}: tensor {name!r} holds {value:.6g}, beyond {dtype}'s range: "
            f"it would be inf at dtype {dtype}"
        )
    return cast


def read_checked(
    config: ModelConfig, dtype: str, read: Callable[[str], np.ndarray], source: str
) -> dict[str, np.ndarray]:
    """Every tensor `read(name)` gives, in state_dict order, checked finite, cast to `dtype`."""
    config.validate_at(dtype)
    tensors = {}
    for name, _ in iter_expected(config):
        array = read(name)
        check_finite(name, array, source)
        tensors[name] = cast_checked(name, array, dtype, source)
    check_first_norm(tensors, dtype, source)
    return tensors


def check_first_norm(tensors: dict[str, np.ndarray], dtype: str, source: str) -> None:
    """The embedding rows the first norm squares and sums: one whose sum of squares is past what `dtype`
    holds overflows the norm's input, and each port answers its own way (a NaN in torch's LayerNorm,
    zeros in RMSNorm and in NumPy's and JAX's LayerNorm, then token 0 every step with finite logits):
    refused here, the same line for every port, before any of them runs."""
    limit = float(np.finfo(host_dtype(dtype)).max)
    for name in ("emb.weight", "pos.weight"):
        if name not in tensors:
            continue
        squares = np.square(tensors[name], dtype=np.float64).sum(axis=-1)  # [rows]
        row = int(np.argmax(squares))
        if squares[row] > limit:
            raise UserError(
                f"weights {echo_path(source)}: tensor {name!r} row {row} has a sum of squares of {squares[row]:.3g}, "
                f"past {host_dtype(dtype)}'s {limit:.3g}: the first norm would overflow; a wider dtype holds it"
            )


class WeightsFile(Closing):
    """Our weights file, open and checked from its header: `config`, and `read(dtype)` for
    the tensors. Between the two a caller checks whatever the config bounds (prompts, the
    bytes the run will allocate), so nothing is read for a run that will be refused."""

    def __init__(self, path: os.PathLike):
        self.source = str(path)
        self.file = SafetensorsFile(path)
        try:
            if "config" not in self.file.metadata:
                raise UserError(
                    f"weights file {echo_path(self.source)} has no 'config' metadata (expected the ModelConfig as JSON)"
                )
            self.config = ModelConfig.from_json(self.file.metadata["config"])
            self.dtype = check_entries(self.file.entries, self.config, self.source)
        except BaseException:
            self.file.close()
            raise

    def read(self, dtype: str | None = None, quant: str = "none") -> dict[str, np.ndarray]:
        """Every tensor, in state_dict order, finite, at `dtype` (None: the file's own); quant as
        GGUFWeights.read's (nothing here is stored in 4 bits)."""
        return read_checked(self.config, self.dtype if dtype is None else dtype, self.file.read, self.source)

    def has_q4(self) -> bool:
        return False

    def close(self) -> None:
        self.file.close()


class GGUFWeights(Closing):
    """A GGUF file as a weights file: `config` from its metadata, checked against its tensor table;
    `read(dtype)` dequantizes each tensor to float32 (what the gguf library's dequantizers compute
    in), then checks and casts it as WeightsFile does. As there, a caller checks the bytes a run
    will allocate between the two."""

    def __init__(self, path: os.PathLike, entry: Any = None):
        from kvports.formats.gguf.reader import GGUFFile

        self.source = str(path)
        self.file: GGUFFile = GGUFFile(path)
        self.config = self.file.config
        self.dtype = "float32"
        self.entry = entry  # a load cache Entry (formats.gguf.cache), written once the tensors are read

    def read(self, dtype: str | None = None, quant: str = "none") -> dict[str, np.ndarray]:
        """Every tensor, in state_dict order, finite, at `dtype` (None: float32); quant "q4": beside each
        matrix stored in Q4_0/Q4_1, its own 4-bit blocks (`shared.quantization.q4_names`)."""
        from kvports.progress import load_progress

        dtype = self.dtype if dtype is None else dtype
        self.config.validate_at(dtype)
        with load_progress(len(self.file.plan), "dequantizing") as advance:
            tensors = read_checked(self.config, "float32", advance(self.file.read), self.source)
        if self.entry is not None:
            self.entry.save_tensors(self.config, tensors, self.has_q4())
        tensors = {name: cast_checked(name, array, dtype, self.source) for name, array in tensors.items()}
        if quant == "q4":
            tensors.update(self.q4_tensors())
        return tensors

    def q4_tensors(self) -> dict[str, np.ndarray]:
        """Each matrix stored in Q4_0/Q4_1 as its own 4-bit blocks, by `shared.quantization.q4_names`."""
        tensors: dict[str, np.ndarray] = {}
        for name in self.file.plan:
            blocks = self.file.q4_blocks(name)
            if blocks is not None:
                tensors.update(zip(q4_names(name), blocks, strict=True))
        return tensors

    def has_q4(self) -> bool:
        """Whether any of the model's matrices is stored in 4-bit blocks."""
        return any(tensor.tensor_type.name in ("Q4_0", "Q4_1") for tensor in self.file.tensors.values())

    def close(self) -> None:
        self.file.close()


def open_weights(path: os.PathLike = DEFAULT_WEIGHTS) -> WeightsFile | GGUFWeights:
    """Our safetensors weights file, or a GGUF file (by its magic) through the same interface."""
    from kvports.formats.gguf.reader import is_gguf

    refuse_hf_checkpoint(Path(path))
    return GGUFWeights(path) if is_gguf(path) else WeightsFile(path)


def refuse_hf_checkpoint(path: Path) -> None:
    """A Hugging Face checkpoint (a folder with config.json, or a safetensors file in one) is not
    our weights file: say how to make one of it, not that the file lacks our metadata."""
    try:
        folder = path if path.is_dir() else path.parent if path.suffix == ".safetensors" else None
        if folder is None or not (folder / "config.json").is_file():
            return
        if path.is_file():
            from safetensors import safe_open

            with safe_open(str(path), "numpy") as file:
                if "config" in (file.metadata() or {}):
                    return  # ours, beside some config.json
    except Exception:  # unreadable here: the reader below names the fault
        return
    raise UserError(
        f"{echo_path(path)} is a Hugging Face checkpoint, not a kvports weights file: convert it once with "
        f"kvports convert --from-hf {echo_path(folder)} --out model.safetensors, then give --weights model.safetensors"
    )


def load_weights(
    path: os.PathLike = DEFAULT_WEIGHTS, dtype: str | None = None
) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read and check a weights file: (config, tensors at `dtype`, None: the file's own).
    Every error names the tensor or field at fault."""
    with open_weights(path) as weights:
        return weights.config, weights.read(dtype)


def save_weights(path: os.PathLike, tensors: dict[str, np.ndarray], config: ModelConfig) -> None:
    """Write atomically: a reader never sees a half-written file."""
    from safetensors.numpy import save

    config.validate()
    check_tensors(tensors, config, source=str(path))
    payload = save(
        {name: np.ascontiguousarray(tensors[name]) for name, _ in iter_expected(config)},
        metadata={"config": config.to_json()},
    )
    write_atomic(path, payload)


def gpt2_init_weights(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """GPT-2's initialisation in NumPy (N(0, 0.02) matrices, zero biases, unit norms), for any
    config: a model of the right size without torch (`init-weights --init numpy`, the bench's
    gpt2-small), drawn in seconds."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in iter_expected(config):
        if name.endswith(".bias"):
            tensors[name] = np.zeros(shape, dtype=np.float32)
        elif len(shape) == 1:
            tensors[name] = np.ones(shape, dtype=np.float32)
        else:
            tensors[name] = rng.standard_normal(shape, dtype=np.float32)
            tensors[name] *= 0.02
    return tensors
