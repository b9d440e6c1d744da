"""A GGUF file (llama.cpp's format) as weights: read by the `gguf` library's own GGUFReader,
its `llama.*` metadata mapped to a ModelConfig, its tensors dequantized by the library's own
dequantizer, renamed to ours and put in our layouts. `kvports.formats.weights.GGUFWeights` serves it
to every command as a weights file; this module imports nothing of shared but the config.

Before the library walks the file, its whole header is walked here without building anything
(`scan_header`): every read inside the file, metadata nesting, array lengths and item counts
bounded, byte order little-endian, and the tensor table laid out as llama.cpp's reader requires
(`check_layout`). While the library walks, every read is still checked to lie inside the file, and
a metadata array of numbers is one slice of the file rather than one object per item.
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import re
import stat
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvports.shared.config import ModelConfig
from kvports.shared.errors import UserError, echo, echo_path

GGUF_MAGIC = b"GGUF"
MAX_TENSORS = 100_000  # a 400-layer model has ~4,000
MAX_FIELDS = 10_000  # metadata keys; a model has ~50
MAX_ARRAY = 1_000_000  # items of one metadata array: vocabularies and merges reach ~260,000
MAX_ITEMS = 3_000_000  # items of every metadata array together, nested ones included
MAX_DEPTH = 2  # arrays of arrays at most (llama.cpp reads no nested array at all)
MAX_DIMS = 4  # a tensor's dimensions (GGML_MAX_DIMS)
DEFAULT_ALIGNMENT = 32
# GGUF's value types (GGUFValueType) by number: the scalars' sizes in bytes, then string and array.
SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY, UINT32 = 8, 9, 4
# What kvports dequantizes, each with the library's own dequantizer; every other type is refused by name.
READABLE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
# The architectures kvports reads, as llama.cpp's convert_hf_to_gguf.py names them.
ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "phi3")
# The <architecture>.* keys read; any other one could change the model, and is refused by name.
LLAMA_KEYS = {
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.layer_norm_rms_epsilon",
    "attention.key_length",
    "attention.value_length",
    "rope.freq_base",
    "rope.dimension_count",
    "rope.scaling.type",
    "vocab_size",
}
ARCH_KEYS = {
    "gemma3": LLAMA_KEYS | {"rope.freq_base_swa", "attention.sliding_window"},
    # original_context_length matters only to the longrope factors (rope_factors_long/short), refused as tensors.
    "phi3": LLAMA_KEYS | {"attention.sliding_window", "rope.scaling.original_context_length"},
}
# llama.cpp's Gemma 3 (src/llama-model.cpp): every sixth layer global, the others windowed; the file
# does not say so.
GEMMA3_GLOBAL_EVERY = 6


def is_gguf(path: os.PathLike) -> bool:
    """The file starts with GGUF's magic (a path that cannot be read: no, and its reader will say why).
    Only a regular file is opened: opening a FIFO for reading waits for a writer, forever."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return False
        with open(path, "rb") as handle:
            return handle.read(4) == GGUF_MAGIC
    except OSError:
        return False


class HeaderScan:
    """The header walked as raw bytes before the library parses it: each count and length bounded
    before anything is read by it, nothing built but the tensor table's numbers."""

    def __init__(self, path: Path, data: Any, size: int):
        self.name, self.data, self.size = f"GGUF file {echo_path(path)}", data, size
        self.items = 0
        self.alignment = DEFAULT_ALIGNMENT

    def need(self, offset: int, count: int) -> None:
        if offset + count > self.size:
            raise UserError(
                f"{self.name} is truncated or lies: a read of bytes [{offset}, {offset + count}) runs past its end "
                f"({self.size} bytes)"
            )

    def unpack(self, fmt: str, offset: int) -> int:
        self.need(offset, struct.calcsize(fmt))
        return int(struct.unpack_from(fmt, self.data, offset)[0])

    def string(self, offset: int) -> tuple[bytes, int]:
        length = self.unpack("<Q", offset)
        self.need(offset + 8, length)
        return bytes(self.data[offset + 8 : offset + 8 + length]), offset + 8 + length

    def value(self, offset: int, kind: int, depth: int) -> int:
        """The offset after one value of type `kind`."""
        if kind in SCALAR_BYTES:
            self.need(offset, SCALAR_BYTES[kind])
            return offset + SCALAR_BYTES[kind]
        if kind == STRING:
            return self.string(offset)[1]
        if kind != ARRAY:
            raise UserError(f"{self.name} has a value of unknown type {kind}")
        if depth >= MAX_DEPTH:
            raise UserError(f"{self.name} nests metadata arrays more than {MAX_DEPTH} deep")
        item, length = self.unpack("<I", offset), self.unpack("<Q", offset + 4)
        if length > MAX_ARRAY:
            raise UserError(f"{self.name} has a metadata array of {length} items, above {MAX_ARRAY}")
        self.items += length
        if self.items > MAX_ITEMS:
            raise UserError(f"{self.name} has more than {MAX_ITEMS} metadata array items in all")
        offset += 12
        if item in SCALAR_BYTES:
            self.need(offset, length * SCALAR_BYTES[item])
            return offset + length * SCALAR_BYTES[item]
        for _ in range(length):
            offset = self.value(offset, item, depth + 1)
        return offset

    def tensor_table(self, offset: int, fields: int, tensors: int) -> tuple[list[tuple[str, int, int]], int]:
        """[(name, data offset, bytes)] in the file's order, and where the data section starts."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        for _ in range(fields):
            key, offset = self.string(offset)
            kind = self.unpack("<I", offset)
            if key == b"general.alignment" and kind == UINT32:
                self.alignment = self.unpack("<I", offset + 4)
            offset = self.value(offset + 4, kind, 0)
        table = []
        for _ in range(tensors):
            raw, offset = self.string(offset)
            name = echo(raw.decode("utf-8", "replace"))
            dims = self.unpack("<I", offset)
            if dims > MAX_DIMS:
                raise UserError(f"{self.name}: tensor {name} has {dims} dimensions, above {MAX_DIMS}")
            shape = [self.unpack("<Q", offset + 4 + 8 * i) for i in range(dims)]
            offset += 4 + 8 * dims
            kind, start = self.unpack("<I", offset), self.unpack("<Q", offset + 4)
            offset += 12
            try:
                block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            except (ValueError, KeyError):
                raise UserError(f"{self.name} has a tensor of unknown quantization type {kind}") from None
            if shape and shape[0] % block:
                raise UserError(
                    f"{self.name}: tensor {name} has rows of {shape[0]} values, not a multiple of its type's "
                    f"block of {block}"
                )
            table.append((name, start, math.prod(shape) // block * block_bytes))
        if self.alignment == 0 or self.alignment & (self.alignment - 1):
            raise UserError(f"{self.name} has metadata general.alignment={self.alignment}, not a power of two")
        return table, -(-offset // self.alignment) * self.alignment


def check_layout(scan: HeaderScan, table: list[tuple[str, int, int]], start: int) -> None:
    """llama.cpp's rule (gguf.cpp): each tensor's data sits at the running sum of the aligned sizes
    of the tensors before it, so no two overlap and none is misaligned; the data section is that
    sum (the last tensor's padding may be left out); every tensor lies inside the file."""
    expected = 0
    for name, offset, nbytes in table:
        if start + offset + nbytes > scan.size:
            raise UserError(
                f"{scan.name} is truncated or lies: tensor {name} (bytes [{start + offset}, "
                f"{start + offset + nbytes})) runs past its end ({scan.size} bytes)"
            )
        if offset != expected:
            raise UserError(
                f"{scan.name}: tensor {name} is at data offset {offset}, not {expected}: each tensor must sit at "
                f"the running sum of the {scan.alignment}-byte aligned sizes of those before it (llama.cpp's rule; "
                "overlapping, misaligned or out-of-order tensors are refused)"
            )
        last = nbytes
        expected += -(-nbytes // scan.alignment) * scan.alignment
    data = scan.size - start
    if table and not expected - (-(-last // scan.alignment) * scan.alignment - last) <= data <= expected:
        raise UserError(
            f"{scan.name} has a data section of {data} bytes; its tensors' aligned sizes sum to {expected} "
            "(llama.cpp's rule: nothing before, between or after them)"
        )


def scan_header(path: Path, size: int) -> None:
    """The header's raw bytes walked and bounded (see HeaderScan), and the tensors' layout checked."""
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        scan = HeaderScan(path, data, size)
        tensors, fields = scan.unpack("<Q", 8), scan.unpack("<Q", 16)
        table, start = scan.tensor_table(24, fields, tensors)
        check_layout(scan, table, start)


def bounded_reader(path: Path, size: int) -> Any:
    """The library's GGUFReader, with every read checked against the file's end and every
    metadata array's length bounded."""
    from gguf import GGUFReader, GGUFValueType

    def past_end(offset: int, end: int) -> UserError:
        return UserError(
            f"GGUF file {echo_path(path)} is truncated or lies: a read of bytes [{offset}, {end}) "
            f"runs past its end ({size} bytes)"
        )

    class BoundedReader(GGUFReader):
        # Two private methods wrapped, not rewritten: the library does the parsing (but of string arrays).
        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
            end = int(offset) + np.dtype(dtype).itemsize * int(count)
            if end > size:
                raise past_end(int(offset), end)
            return super()._get(offset, dtype, count, override_order)

        def _strings(self, orig_offs: int, item: Any, length: Any) -> Any:
            """An array of strings as the library parts it ([item, length, then each string's length and
            bytes], the bytes' indices, the types), in one loop: the library's recursion through _get
            per string took seconds for a tokenizer's 100,000 in every process that opened the file."""
            data = self.data.view(np.ndarray)  # a memmap's slices cost more than a plain array's
            lengths = np.dtype(np.uint64).newbyteorder(self.byte_order)
            parts, indices, offset = [item, length], [], orig_offs + 12
            for _ in range(int(length[0])):
                if offset + 8 > size:
                    raise past_end(offset, offset + 8)
                count = data[offset : offset + 8].view(lengths)  # [1]
                end = offset + 8 + int(count[0])
                if end > size:
                    raise past_end(offset + 8, end)
                parts += (count, data[offset + 8 : end])
                indices.append(len(parts) - 1)
                offset = end
            types = [GGUFValueType.ARRAY, *([GGUFValueType.STRING] if indices else [])]
            return offset - orig_offs, parts, indices, types

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
            if raw_type == GGUFValueType.ARRAY:
                # An array of numbers as one slice (the library makes an object per item: a minute and
                # a gigabyte for 4 million bytes); contents() reads it the same.
                item, length = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
                if int(length[0]) > MAX_ARRAY:
                    raise UserError(
                        f"GGUF file {echo_path(path)} has a metadata array of {int(length[0])} items, above {MAX_ARRAY}"
                    )
                kind = GGUFValueType(int(item[0]))
                numbers = self.gguf_scalar_to_np.get(kind)
                if numbers is not None:
                    values = self._get(orig_offs + 12, numbers, int(length[0]))
                    return 12 + int(values.nbytes), [item, length, values], [2], [GGUFValueType.ARRAY, kind]
                if kind == GGUFValueType.STRING:
                    return self._strings(orig_offs, item, length)
            return super()._get_field_parts(orig_offs, raw_type)

    return BoundedReader(path)


@functools.lru_cache(maxsize=2)
def cached_reader(path: str, size: int, mtime_ns: int, inode: int) -> Any:
    """One parse per file and version of it: a run reads the weights, the tokenizer and the chat
    template from the same metadata, and parsing 100,000 strings takes seconds."""
    scan_header(Path(path), size)
    return bounded_reader(Path(path), size)


def open_reader(path: Path) -> Any:
    """The file, checked and parsed: one `error:` line for anything the reader refuses."""
    name = f"GGUF file {echo_path(path)}"
    try:
        status = os.stat(path)
        if not stat.S_ISREG(status.st_mode):
            raise UserError(f"{name} is not a regular file")
        with open(path, "rb") as handle:
            header = handle.read(24)
    except FileNotFoundError:
        raise UserError(f"{name} does not exist") from None
    except OSError as exc:
        raise UserError(f"cannot read {name} ({exc.strerror or exc})") from None
    if header[:4] != GGUF_MAGIC:
        raise UserError(f"{name} is not a GGUF file (it does not start with the magic 'GGUF')")
    if len(header) < 24:
        raise UserError(f"{name} is truncated: shorter than a GGUF header (24 bytes)")
    version, tensors, fields = struct.unpack("<IQQ", header[4:])
    if version & 0xFFFF == 0:  # the gguf library's test: a small version number, byte-swapped
        raise UserError(
            f"{name} is big-endian (its version reads {version:#x} little-endian); kvports reads little-endian "
            "GGUF files, as llama.cpp writes them"
        )
    if tensors > MAX_TENSORS:
        raise UserError(f"{name} declares {tensors} tensors, above {MAX_TENSORS}")
    if fields > MAX_FIELDS:
        raise UserError(f"{name} declares {fields} metadata keys, above {MAX_FIELDS}")
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise UserError("reading a GGUF file needs the gguf package (pip install gguf)") from None
    try:
        return cached_reader(str(path), status.st_size, status.st_mtime_ns, status.st_ino)
    except UserError:
        raise
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, UnicodeDecodeError) as exc:
        # An unknown value or quantization type, a duplicate key, a bad alignment, ...
        unknown = re.search(r"(\d+)\)? is not a valid (GGMLQuantizationType|GGUFValueType)", str(exc))
        if unknown is not None:
            what = (
                "a tensor of unknown quantization type"
                if unknown[2] == "GGMLQuantizationType"
                else "a value of unknown type"
            )
            raise UserError(f"{name} has {what} {unknown[1]}") from None
        raise UserError(f"{name} is not a GGUF file kvports can read ({exc})") from None


def field_value(field: Any) -> Any:
    """A metadata field as Python values: a str, a number, a bool, or a list of them."""
    from gguf import GGUFValueType

    value = field.contents()
    if field.types and field.types[0] == GGUFValueType.ARRAY and not isinstance(value, list):
        value = list(value)
    return value


class Metadata:
    """The file's metadata by key, each read once and checked for its type."""

    def __init__(self, reader: Any, source: str):
        self.reader, self.source = reader, source

    def __contains__(self, key: str) -> bool:
        return key in self.reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field_value(field)

    def refuse(self, key: str, value: Any, why: str) -> UserError:
        return UserError(f"GGUF file {echo_path(self.source)}: metadata {key}={echo(value)}: {why}")

    def integer(self, key: str, default: Any = None, low: int = 1) -> int:
        value = self.get(key, default)
        if value is None:
            raise UserError(f"GGUF file {echo_path(self.source)} has no metadata {key}")
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
            raise self.refuse(key, value, f"must be an integer >= {low}")
        return int(value)

    def number(self, key: str, default: float) -> float:
        value = self.get(key, default)
        if not isinstance(value, (int, float, np.number)) or isinstance(value, bool) or not math.isfinite(value):
            raise self.refuse(key, value, "must be a finite number")
        if value <= 0:
            raise self.refuse(key, value, "must be > 0")
        return float(value)

    def token_id(self, key: str) -> int | None:
        return None if key not in self else self.integer(key, low=0)

    def strings(self, key: str) -> list[str]:
        try:
            value = self.get(key, [])
        except UnicodeDecodeError as exc:
            raise self.refuse(key, "<strings>", f"holds a string that is not UTF-8 ({exc.reason})") from None
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise self.refuse(key, f"<{type(value).__name__}>", "must be a list of strings")
        return value

    def string_at(self, key: str, index: int) -> str | None:
        """One string of a string array, decoded alone; None past its end."""
        if not 0 <= index < self.count(key):
            return None
        try:
            return str(self.reader.fields[key].contents(index))
        except UnicodeDecodeError as exc:
            raise self.refuse(key, f"<item {index}>", f"is not UTF-8 ({exc.reason})") from None

    def count(self, key: str) -> int:
        """The items of a string array, none decoded (a run given token ids never needs the strings)."""
        from gguf import GGUFValueType

        field = self.reader.fields.get(key)
        if field is None:
            return 0
        if field.types[:1] != [GGUFValueType.ARRAY] or field.types[-1:] != [GGUFValueType.STRING]:
            raise self.refuse(key, "<not strings>", "must be a list of strings")
        return len(field.data)


def gguf_config(reader: Any, source: str) -> ModelConfig:
    """The `<architecture>.*` metadata as a ModelConfig, or one `error:` line naming the key.
    Each architecture is a family's switches on the one model, as llama.cpp runs it."""
    meta = Metadata(reader, source)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        known = ", ".join(ARCHITECTURES)
        raise meta.refuse("general.architecture", arch, f"kvports reads GGUF files of architecture {known}")
    p = f"{arch}."
    for key in reader.fields:
        if key.startswith(p) and key[len(p) :] not in ARCH_KEYS.get(arch, LLAMA_KEYS):
            raise meta.refuse(
                key, meta.get(key), f"kvports does not model this {arch} field; refusing rather than ignoring it"
            )
    scaling = meta.get(p + "rope.scaling.type", "none")
    if scaling != "none":
        raise meta.refuse(p + "rope.scaling.type", scaling, "kvports implements plain RoPE only (no scaling)")
    d_model = meta.integer(p + "embedding_length")
    heads = meta.integer(p + "attention.head_count")
    kv_heads = meta.integer(p + "attention.head_count_kv", heads)
    head_dim = meta.integer(p + "attention.key_length", d_model // heads if d_model % heads == 0 else None)
    if d_model % heads and p + "attention.key_length" not in meta:
        raise meta.refuse(p + "embedding_length", d_model, f"is not divisible by attention.head_count={heads}")
    for key in (p + "rope.dimension_count", p + "attention.value_length"):
        if key in meta and meta.integer(key) != head_dim:
            raise meta.refuse(key, meta.get(key), f"kvports needs the head size, attention.key_length = {head_dim}")
    tokens = meta.count("tokenizer.ggml.tokens")
    vocab = meta.integer(p + "vocab_size", tokens or None)
    if tokens and tokens != vocab:
        raise meta.refuse(
            "tokenizer.ggml.tokens",
            f"<{tokens} tokens>",
            f"the tokenizer's size differs from the vocabulary's {vocab}",
        )
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    # Checked against the tensors present before anything loops over the layers.
    layers = {int(match[1]) for match in map(re.compile(r"blk\.(\d+)\.").match, tensors) if match}
    blocks = meta.integer(p + "block_count")
    if blocks > len(layers):
        raise meta.refuse(p + "block_count", blocks, f"the file holds tensors of {len(layers)} layers (blk.N.*)")
    eos = [meta.token_id(key) for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    # 0 is no window, as llama.cpp reads it: its converter writes 0 for a Phi-3 whose config has none.
    window = meta.integer(p + "attention.sliding_window", 0, low=0) or None
    family: dict[str, Any] = {}
    if arch == "gemma3":
        if window is None:
            raise UserError(
                f"GGUF file {echo_path(source)}: metadata gemma3.attention.sliding_window is missing or 0 "
                "(Gemma 3's local layers need a window)"
            )
        family = dict(
            qk_norm=True,
            post_norms=True,
            # llama.cpp scales the embeddings by sqrtf(n_embd), and the scores by 1/sqrt(key_length).
            embed_scale=float(np.float32(math.sqrt(d_model))),
            global_layers=tuple(i for i in range(blocks) if (i + 1) % GEMMA3_GLOBAL_EVERY == 0),
            rope_local_theta=meta.number(p + "rope.freq_base_swa", 10000.0),
        )
    elif arch == "qwen3":
        family = dict(qk_norm=True)
    elif arch == "qwen2":
        family = dict(qkv_bias=True)
    elif "rope_freqs.weight" in tensors:  # llama.cpp's form of Llama 3's RoPE scaling: a divisor per frequency
        family = dict(rope_freq_factors=tuple(float(x) for x in np.asarray(tensors["rope_freqs.weight"].data)))
    return ModelConfig(
        vocab_size=vocab,
        d_model=d_model,
        n_heads=heads,
        n_layers=blocks,
        max_seq_len=meta.integer(p + "context_length"),
        n_kv_heads=kv_heads,
        activation="geglu_tanh" if arch == "gemma3" else "swiglu",
        ffn_hidden=meta.integer(p + "feed_forward_length"),
        norm="rmsnorm",
        norm_eps=meta.number(p + "attention.layer_norm_rms_epsilon", 1e-5),
        positions="rope",
        rope_theta=meta.number(p + "rope.freq_base", 10000.0),
        tie_embeddings="output.weight" not in tensors,
        attn_bias=False,
        ffn_bias=False,
        head_size=head_dim if head_dim * heads != d_model else None,
        sliding_window=window,
        eos_token_ids=tuple(dict.fromkeys(token for token in eos if token is not None)),
        bos_token_id=meta.token_id("tokenizer.ggml.bos_token_id"),
        **family,
    ).validate()


def unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's converter's row order for q and k: its RoPE rotates adjacent pairs of
    each head's dims, ours (and transformers') rotates the two halves, so the converter
    interleaved each head's halves. The inverse of its `permute`, as transformers' GGUF loader undoes it."""
    rows = weight.shape[0]
    half = rows // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)  # [rows, in]


# Ours <- GGUF's: each of our tensors, the GGUF tensors stacked along dim 0 in order; in our
# state_dict order (shared.shapes.iter_expected's). Phi-3's files keep q, k, v fused (attn_qkv) and
# gate and up fused (ffn_up, gate first), as ours; Gemma 3's ffn_norm comes before the MLP, its
# post_attention_norm and post_ffw_norm after attention and the MLP.
def gguf_plan(config: ModelConfig, arch: str = "llama") -> Iterator[tuple[str, tuple[str, ...]]]:
    yield "emb.weight", ("token_embd.weight",)
    fused = arch == "phi3"
    for i in range(config.n_layers):
        g, b = f"blk.{i}.", f"blocks.{i}."
        yield b + "ln1.weight", (g + "attn_norm.weight",)
        yield b + "ln2.weight", (g + "ffn_norm.weight",)
        yield b + "qkv.weight", (g + "attn_qkv.weight",) if fused else tuple(g + f"attn_{n}.weight" for n in "qkv")
        if config.qkv_bias:
            yield b + "qkv.bias", tuple(g + f"attn_{n}.bias" for n in "qkv")
        yield b + "proj.weight", (g + "attn_output.weight",)
        yield b + "ffn.0.weight", (g + "ffn_up.weight",) if fused else (g + "ffn_gate.weight", g + "ffn_up.weight")
        yield b + "ffn.2.weight", (g + "ffn_down.weight",)
        if config.qk_norm:
            yield b + "q_norm.weight", (g + "attn_q_norm.weight",)
            yield b + "k_norm.weight", (g + "attn_k_norm.weight",)
        if config.post_norms:
            yield b + "ln1_post.weight", (g + "post_attention_norm.weight",)
            yield b + "ln2_post.weight", (g + "post_ffw_norm.weight",)
    yield "ln.weight", ("output_norm.weight",)
    if not config.tie_embeddings:
        yield "head.weight", ("output.weight",)


def gguf_shapes(config: ModelConfig, arch: str = "llama") -> dict[str, tuple[int, ...]]:
    """Each GGUF tensor's (out, in) shape (the file lists dims innermost first: reversed)."""
    D, F, V, Dh = config.d_model, config.ffn_dim, config.vocab_size, config.head_dim
    H, Hkv = config.n_heads * Dh, config.kv_heads * Dh  # q's rows, and k's and v's each
    per_layer = {
        "attn_norm.weight": (D,),
        "ffn_norm.weight": (D,),
        "attn_output.weight": (D, H),
        "ffn_down.weight": (D, F),
    }
    if arch == "phi3":
        per_layer |= {"attn_qkv.weight": (H + 2 * Hkv, D), "ffn_up.weight": (2 * F, D)}
    else:
        per_layer |= {"attn_q.weight": (H, D), "attn_k.weight": (Hkv, D), "attn_v.weight": (Hkv, D)}
        per_layer |= {"ffn_gate.weight": (F, D), "ffn_up.weight": (F, D)}
    if config.qkv_bias:
        per_layer |= {"attn_q.bias": (H,), "attn_k.bias": (Hkv,), "attn_v.bias": (Hkv,)}
    if config.qk_norm:
        per_layer |= {"attn_q_norm.weight": (Dh,), "attn_k_norm.weight": (Dh,)}
    if config.post_norms:
        per_layer |= {"post_attention_norm.weight": (D,), "post_ffw_norm.weight": (D,)}
    shapes = {"token_embd.weight": (V, D), "output_norm.weight": (D,)}
    if not config.tie_embeddings:
        shapes["output.weight"] = (V, D)
    if config.rope_freq_factors:
        shapes["rope_freqs.weight"] = (Dh // 2,)  # read into the config, not a weight
    for i in range(config.n_layers):
        shapes.update({f"blk.{i}.{name}": shape for name, shape in per_layer.items()})
    return shapes


class GGUFFile:
    """A GGUF file, open: its config, its tensor table checked (names, types, shapes) before any
    tensor is dequantized, and each of our tensors dequantized on request, at float32."""

    def __init__(self, path: os.PathLike):
        self.source = str(path)
        self.reader = open_reader(Path(path))
        self.config = gguf_config(self.reader, self.source)
        self.arch = str(self.reader.fields["general.architecture"].contents())
        self.tensors = {tensor.name: tensor for tensor in self.reader.tensors}
        self.plan = dict(gguf_plan(self.config, self.arch))
        self.check_table()

    def check_table(self) -> None:
        source = echo_path(self.source)
        expected = gguf_shapes(self.config, self.arch)
        for name, tensor in self.tensors.items():
            if name not in expected:
                raise UserError(f"GGUF file {source}: unexpected tensor {echo(name)} (not in this config's model)")
            kind = tensor.tensor_type.name
            if kind not in READABLE_TYPES:
                readable = ", ".join(READABLE_TYPES)
                raise UserError(f"GGUF file {source}: tensor {echo(name)} has type {kind}; kvports reads {readable}")
            shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
            if shape != expected[name]:
                raise UserError(
                    f"GGUF file {source}: tensor {echo(name)} has shape {list(shape)}, the config needs "
                    f"{list(expected[name])}"
                )
        for name, shape in expected.items():
            if name not in self.tensors:
                raise UserError(f"GGUF file {source}: missing tensor {name!r} (expected shape {list(shape)})")

    def permuted(self, name: str) -> bool:
        """Whether llama.cpp's converter reordered this tensor's rows: q and k of architecture llama
        alone (the others' RoPE rotates halves in llama.cpp too, NEOX style)."""
        return self.arch == "llama" and (".attn_q." in name or ".attn_k." in name)

    def dequantized(self, name: str) -> np.ndarray:
        """One GGUF tensor at float32, (out, in), q and k rows back in halves order."""
        from gguf import GGMLQuantizationType, dequantize

        tensor = self.tensors[name]
        if tensor.tensor_type == GGMLQuantizationType.F32:
            array = np.array(tensor.data, dtype=np.float32)  # a copy: the reader's view is of the mapped file
        else:
            array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        array = array.reshape(tuple(int(n) for n in reversed(tensor.shape.tolist())))  # [out, in]
        if self.permuted(name):
            array = unpermute(array, self.config.n_heads if ".attn_q." in name else self.config.kv_heads)
        return array

    def q4_blocks(self, ours: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Our matrix `ours` as the file's own 4-bit blocks, where every GGUF tensor it stacks is Q4_0 or
        Q4_1: codes [out, in] uint8 in [0, 15], scales and mins [out, in / 32] float32, the weight being
        scale * code + min in each block of 32 (Q4_0: min = -8 scale, exact in float32). None otherwise."""
        from gguf import GGMLQuantizationType

        kinds = {GGMLQuantizationType.Q4_0: 2, GGMLQuantizationType.Q4_1: 4}  # header bytes before the nibbles
        if any(self.tensors[name].tensor_type not in kinds for name in self.plan[ours]):
            return None
        parts = []
        for name in self.plan[ours]:
            tensor = self.tensors[name]
            rows, width = (int(n) for n in reversed(tensor.shape.tolist()))
            header = kinds[tensor.tensor_type]
            blocks = np.asarray(tensor.data).reshape(rows, width // 32, header + 16)  # [out, in / 32, bytes]
            scales = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)  # [out, in / 32]
            if header == 4:
                mins = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)  # [out, in / 32]
            else:
                mins = -8 * scales  # [out, in / 32]
            nibbles = blocks[..., header:]  # [out, in / 32, 16]: weight j in the low nibble, j + 16 in the high
            codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, width)  # [out, in]
            if self.permuted(name):
                heads = self.config.n_heads if ".attn_q." in name else self.config.kv_heads
                codes, scales, mins = (unpermute(array, heads) for array in (codes, scales, mins))
            parts.append((codes, scales, mins))
        codes, scales, mins = (np.ascontiguousarray(np.concatenate(arrays)) for arrays in zip(*parts, strict=True))
        return codes, scales, mins

    def read(self, ours: str) -> np.ndarray:
        """Our tensor `ours` (a name of shared.shapes.iter_expected's) at float32."""
        parts = [self.dequantized(name) for name in self.plan[ours]]
        return np.ascontiguousarray(parts[0] if len(parts) == 1 else np.concatenate(parts))

    def close(self) -> None:
        # The reader's memory map closes when the last reference goes (the parse cache may keep one).
        self.tensors = {}
        self.reader = None
