"""The weights file every port loads: safetensors, the seed's state_dict names and
(out, in) Linear layouts, the ModelConfig as JSON under the metadata key `config`.

The header is parsed here by hand before safetensors touches the data, so every
problem is reported by tensor name; nothing is ever unpickled.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

from kvports.shared.config import DTYPES, ModelConfig
from kvports.shared.errors import UserError
from kvports.shared.files import write_atomic

SAFETENSORS_DTYPES = {"F32": "float32", "F64": "float64"}
DEFAULT_WEIGHTS = Path(__file__).parent / "data" / "seed_model.safetensors"
MAX_HEADER_BYTES = 100 * 1024 * 1024


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape, in the seed's state_dict order."""
    D, V = config.d_model, config.vocab_size
    gated = 2 if config.activation == "swiglu" else 1
    shapes: dict[str, tuple[int, ...]] = {"emb.weight": (V, D)}
    if config.positions == "learned":
        shapes["pos.weight"] = (config.max_seq_len, D)

    def norm(prefix: str) -> None:
        shapes[f"{prefix}.weight"] = (D,)
        if config.norm == "layernorm":
            shapes[f"{prefix}.bias"] = (D,)

    def linear(prefix: str, n_out: int, n_in: int, bias: bool) -> None:
        shapes[f"{prefix}.weight"] = (n_out, n_in)
        if bias:
            shapes[f"{prefix}.bias"] = (n_out,)

    for i in range(config.n_layers):
        norm(f"blocks.{i}.ln1")
        norm(f"blocks.{i}.ln2")
        linear(f"blocks.{i}.qkv", config.qkv_dim, D, config.attn_bias)
        linear(f"blocks.{i}.proj", D, D, config.attn_bias)
        linear(f"blocks.{i}.ffn.0", gated * config.ffn_dim, D, config.ffn_bias)
        linear(f"blocks.{i}.ffn.2", D, config.ffn_dim, config.ffn_bias)
    norm("ln")
    if not config.tie_embeddings:
        shapes["head.weight"] = (V, D)
    return shapes


def save_weights(path: os.PathLike, tensors: dict[str, np.ndarray], config: ModelConfig) -> None:
    """Write atomically: a reader never sees a half-written file."""
    from safetensors.numpy import save

    config.validate()
    check_tensors(tensors, config, source=str(path))
    payload = save(
        {name: np.ascontiguousarray(tensors[name]) for name in expected_shapes(config)},
        metadata={"config": config.to_json()},
    )
    write_atomic(path, payload)


def read_header(path: Path) -> tuple[dict, int]:
    """The safetensors JSON header and the file's data size, checked for truncation."""
    if not path.exists():
        raise UserError(f"weights file {str(path)!r} does not exist")
    if not path.is_file():
        raise UserError(f"weights file {str(path)!r} is not a regular file")
    size = path.stat().st_size
    if size == 0:
        raise UserError(f"weights file {str(path)!r} is empty")
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise UserError(
                f"weights file {str(path)!r} is not a safetensors file ({size} bytes, shorter than its 8-byte "
                "header length)"
            )
        (header_len,) = struct.unpack("<Q", head)
        if header_len == 0 or header_len > min(MAX_HEADER_BYTES, size - 8):
            raise UserError(
                f"weights file {str(path)!r} is not a safetensors file (header length {header_len} does not fit "
                f"its {size} bytes)"
            )
        raw = handle.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise UserError(f"weights file {str(path)!r} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise UserError(f"weights file {str(path)!r} is not a safetensors file (its header is not a JSON object)")
    data_size = size - 8 - header_len
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise UserError(f"weights file {str(path)!r}: tensor {name!r} has a malformed header entry")
        if offsets[1] > data_size or offsets[0] > offsets[1]:
            raise UserError(
                f"weights file {str(path)!r} is truncated: tensor {name!r} needs bytes up to {offsets[1]}, "
                f"the file holds {data_size}"
            )
    return header, data_size


def read_config(path: os.PathLike) -> ModelConfig:
    header, _ = read_header(Path(path))
    metadata = header.get("__metadata__") or {}
    if "config" not in metadata:
        raise UserError(f"weights file {str(path)!r} has no 'config' metadata (expected the ModelConfig as JSON)")
    return ModelConfig.from_json(metadata["config"])


def load_weights(path: os.PathLike = DEFAULT_WEIGHTS) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read and check a weights file; every error names the tensor or field at fault."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    path = Path(path)
    header, _ = read_header(path)
    config = read_config(path)
    names = [name for name in header if name != "__metadata__"]
    for name in names:
        dtype = header[name].get("dtype")
        if dtype not in SAFETENSORS_DTYPES:
            raise UserError(f"tensor {name!r} has dtype {dtype}; supported: {', '.join(DTYPES)}")
    try:
        tensors = load_file(str(path))
    except SafetensorError as exc:
        raise UserError(f"weights file {str(path)!r} could not be read as safetensors ({exc})") from None
    check_tensors(tensors, config, source=str(path))
    return config, tensors


def check_tensors(tensors: dict[str, np.ndarray], config: ModelConfig, source: str) -> None:
    expected = expected_shapes(config)
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise UserError(
            f"weights {source!r}: missing tensor {missing[0]!r} (expected shape {list(expected[missing[0]])})"
        )
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise UserError(f"weights {source!r}: unexpected tensor {extra[0]!r} (not in this config's model)")
    dtypes = set()
    for name, shape in expected.items():
        array = tensors[name]
        if str(array.dtype) not in DTYPES:
            raise UserError(f"tensor {name!r} has dtype {array.dtype}; supported: {', '.join(DTYPES)}")
        if tuple(array.shape) != shape:
            raise UserError(
                f"weights {source!r}: tensor {name!r} has shape {list(array.shape)}, the config needs {list(shape)}"
            )
        if not np.all(np.isfinite(array)):
            raise UserError(f"weights {source!r}: tensor {name!r} has non-finite values")
        dtypes.add(str(array.dtype))
    if len(dtypes) > 1:
        raise UserError(f"weights {source!r}: tensors mix dtypes {sorted(dtypes)}; use one")


def gpt2_init_weights(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """GPT-2's initialisation in NumPy (N(0, 0.02) matrices, zero biases, unit norms), for any
    config: a model of the right size without torch (`init-weights --init numpy`, the bench's
    gpt2-small), drawn in seconds."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith(".bias"):
            tensors[name] = np.zeros(shape, dtype=np.float32)
        elif len(shape) == 1:
            tensors[name] = np.ones(shape, dtype=np.float32)
        else:
            tensors[name] = rng.standard_normal(shape, dtype=np.float32)
            tensors[name] *= 0.02
    return tensors
