"""Weights written as a GGUF file that llama.cpp loads: the `gguf` library's GGUFWriter, llama.cpp's
own tensor names, its q/k row order (the converter's `permute`, the inverse of what `reader`
undoes) and the metadata of the GGUF file the weights came from (the `llama.*` config, the
tokenizer, the chat template), in F32 or F16 (norms stay F32, as llama.cpp's converter keeps
them). What the bench's llama.cpp rows run beside the file's own quantization: the same weights
every port runs, at the precision of a float32 engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvports.formats.gguf.reader import gguf_plan, gguf_shapes, open_reader
from kvports.shared.config import ModelConfig
from kvports.shared.errors import UserError, echo_path
from kvports.shared.files import os_errors_as_user_errors, temp_beside

OUT_TYPES = ("f32", "f16")
# The writer's own keys, or ones that describe the source's tensors, not the written ones: never copied.
NOT_COPIED = ("general.architecture", "general.file_type", "general.quantization_version", "general.alignment")
WRITER_VERSION = 1  # part of a cached file's name: a change to what is written makes a new file


def permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order from ours: each head's two halves interleaved, since its RoPE
    rotates adjacent pairs of dims and ours the two halves. reader.unpermute undoes it."""
    rows = weight.shape[0]
    half = rows // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)  # [rows, in]


def gguf_tensors(
    config: ModelConfig, tensors: dict[str, np.ndarray], arch: str = "llama"
) -> Iterator[tuple[str, np.ndarray]]:
    """Each GGUF tensor (name, [out, in] or [D]) from ours: reader.gguf_plan read backwards, the stacked
    qkv and gate/up split by their GGUF shapes, q and k rows in llama.cpp's order (architecture llama's)."""
    shapes = gguf_shapes(config, arch)
    if config.rope_freq_factors:  # Llama 3's scaling, as the file it came from held it
        yield "rope_freqs.weight", np.asarray(config.rope_freq_factors, dtype=np.float32)
    for ours, names in gguf_plan(config, arch):
        start = 0
        for name in names:
            rows = shapes[name][0]
            array = tensors[ours][start : start + rows]  # [rows, in] or [D]
            start += rows
            if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
                array = permute(array, config.n_heads if ".attn_q." in name else config.kv_heads)
            yield name, array


def copy_metadata(writer: Any, reader: Any) -> None:
    """Every metadata field of the source but the header's counts and NOT_COPIED, with its own types."""
    from gguf import GGUFValueType

    from kvports.formats.gguf.reader import field_value

    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in NOT_COPIED:
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field_value(field), vtype, sub_type)


def write_gguf(
    path: Path, config: ModelConfig, tensors: dict[str, np.ndarray], source: Path, out_type: str = "f32"
) -> Path:
    """`tensors` (ours, any float dtype) as a GGUF file at `path`, with `source`'s metadata (a GGUF file:
    its tokenizer and template); written to a temp file beside `path`, then renamed over it."""
    from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType

    if out_type not in OUT_TYPES:
        raise UserError(f"GGUF out type {out_type!r} is not one of {', '.join(OUT_TYPES)}")
    reader = open_reader(Path(source))
    matrix_dtype = np.float16 if out_type == "f16" else np.float32
    with temp_beside(path) as tmp:
        arch = str(reader.fields["general.architecture"].contents())  # open_reader's file: one gguf_config read
        writer = GGUFWriter(tmp, arch)
        copy_metadata(writer, reader)
        writer.add_file_type(LlamaFileType.MOSTLY_F16 if out_type == "f16" else LlamaFileType.ALL_F32)
        for name, array in gguf_tensors(config, tensors, arch):
            dtype = np.float32 if array.ndim == 1 else matrix_dtype
            kind = GGMLQuantizationType.F32 if dtype == np.float32 else GGMLQuantizationType.F16
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=dtype), raw_dtype=kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return path


def cached_gguf(source: Path, config: ModelConfig, tensors: dict[str, np.ndarray], out_type: str) -> Path:
    """The GGUF file write_gguf makes from `tensors` (read from the GGUF file `source`), kept under
    $KVPORTS_HOME/gguf/ by the source's SHA-256: written once, then found."""
    from kvports.hub import home, sha256_of

    if not Path(source).is_file():
        raise UserError(f"{echo_path(source)} is not a regular file")
    folder = home() / "gguf"
    with os_errors_as_user_errors(folder):
        folder.mkdir(parents=True, exist_ok=True)
    digest = sha256_of(Path(source))
    path = folder / f"{Path(source).stem}.{digest[:16]}.v{WRITER_VERSION}.{out_type}.gguf"
    if not path.is_file():
        write_gguf(path, config, tensors, Path(source), out_type)
    return path
