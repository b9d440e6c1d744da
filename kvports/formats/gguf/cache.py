"""What the first load of a GGUF file derives, kept for the loads after it: the tokenizer (as
tokenizer.json), the chat template, the config and the dequantized float32 tensors (safetensors,
memory-mapped on later loads), under $KVPORTS_HOME/derived/<the file's SHA-256>-<kvports' version>/.

Parsing the file's metadata (tens of thousands of strings) and dequantizing every tensor takes
seconds each time; mapping the entry takes a fraction of one. The tensors are stored as the ports
use them, so a later load copies nothing: each matrix in the layout `shared.shapes.stored_transposed`
names (a transposed one stored as its [in, out] transpose), every tensor at a 64-byte aligned
offset, mapped copy-on-write (a model may own its weights; a write never reaches the file).

The file's SHA-256 is computed once per version of the file: a digest record keyed by its stamp
(path, size, mtime, ctime, inode: a file rewritten in place under its old mtime has a new ctime, which
no one can set back), with its own checksum; a stamp taken within RACY_NS of the file's last change
is hashed again next time, as git treats racy entries. Every entry is written atomically and checked
on use: the text by its SHA-256; the tensors by the safetensors library's header checks and their
names, shapes and layout against the config; their bytes by each tensor's CRC-32 (order-sensitive:
two rows swapped change it) and a finiteness check, on the first load after the entry was written or
changed. A stamp of the tensors file (size, mtime, ctime, inode) recorded after a full check spares
the loads after it that pass over every byte; a file whose mtime is not older than its stamp
(changed within the clock's tick) is checked in full again. Every record is read only if it is a
regular file (opened without following a link, without blocking on a FIFO) under a size bound,
parsed with bounded nesting. An entry or record that fails any check is removed and built again
from the GGUF file with one warning line, never trusted and never a traceback. A writer holds a
lock on its temp file; one whose writer died (kill -9) is removed on the next run.

The cache trusts its home ($KVPORTS_HOME, as the user's own files): it guards against accidents
(a file replaced, a disk's damage, a killed writer, a stray FIFO or link), not against someone who
may write there. KVPORTS_LOAD_CACHE=0 turns it off.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import mmap
import os
import shutil
import stat
import struct
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvports.formats.weights import Closing, cast_checked, check_entries, check_finite
from kvports.shared.config import ModelConfig
from kvports.shared.errors import UserError
from kvports.shared.files import terminated_as_exit, usual_mode, write_synced
from kvports.shared.shapes import ALIGNMENT, iter_expected, stored_transposed
from kvports.version import __version__

if TYPE_CHECKING:
    from kvports.formats.weights import GGUFWeights

SWITCH = "KVPORTS_LOAD_CACHE"  # "0": every load parses and dequantizes the GGUF file again
FOLDER = "derived"
TENSORS, TEXT, CHECKED = "tensors.safetensors", "text.json", "checked.json"
LAYOUT = "stored_transposed"  # how the matrices are stored: a file made by another rule is rebuilt
MAX_TEXT = 64 << 20  # bytes of a text entry (a tokenizer.json of 260,000 tokens is ~20 MB)
MAX_HEADER = 100 << 20  # the safetensors format's own bound
MAX_RECORD = 4096  # bytes of a digest record or checked.json (each ~250)
MAX_NESTING = 4  # arrays and objects within a record (text.json's "special" is 2 deep)
RACY_NS = 2 * 10**9  # a stamp taken this soon after the file's last change may miss a change in the same tick
CHECKSUM = "crc32"  # what a tensors file's checksums are: one made by another rule is rebuilt
TEXT_FIELDS = ("tokenizer", "template", "special", "context", "template_error")  # Text's, in order


class Corrupt(Exception):
    """A cache entry failed a check: it is removed and built again."""


def enabled() -> bool:
    return os.environ.get(SWITCH, "1") not in ("0", "false", "no", "off")


def cache_root() -> Path:
    from kvports.hub import home

    return home() / FOLDER


def warn(what: str, source: Path, why: str) -> None:
    """A record or entry that failed a check: said once on stderr, then built again by the caller."""
    print(f"warning: the load cache's {what} for {source.name} failed a check ({why}); rebuilding it", file=sys.stderr)


def remove(path: Path) -> None:
    """Whatever lies at `path` (a file, a link, a FIFO, a folder), removed: it is built again."""
    with contextlib.suppress(OSError):
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink()


BRACKETS = np.zeros(256, dtype=np.int64)  # a byte's step in nesting: +1 opens an array or object, -1 closes one
BRACKETS[[ord("["), ord("{")]], BRACKETS[[ord("]"), ord("}")]] = 1, -1


def nesting(raw: bytes) -> int:
    """How deeply a JSON text's arrays and objects nest, brackets inside strings left out (checked
    before json.loads, which recurses once per level). In NumPy, O(n) whatever the text (a 2 MB
    tokenizer holds 370,000 escapes: a Python loop over them takes 20-150 ms): a quote is a
    string's edge unless an odd run of backslashes precedes it."""
    codes = np.frombuffer(raw, dtype=np.uint8)  # [n]
    index = np.arange(codes.size, dtype=np.int64)  # [n]
    plain = np.maximum.accumulate(np.where(codes != ord("\\"), index, -1))  # [n] the last non-backslash so far
    quotes = np.flatnonzero(codes == ord('"'))  # [q]
    before = quotes - 1  # [q]
    run = np.where(before >= 0, before - plain[np.maximum(before, 0)], 0)  # [q] backslashes just before each
    edges = quotes[run % 2 == 0]  # [e] where strings open and close
    marks = np.flatnonzero(BRACKETS[codes])  # [m]
    inside = np.searchsorted(edges, marks) % 2 == 1  # [m] an odd number of edges before: within a string
    return int(np.cumsum(np.where(inside, 0, BRACKETS[codes[marks]])).max(initial=0))


def read_record(path: Path, limit: int) -> dict[str, Any] | None:
    """A record's JSON object; None when there is none. Opened without following a link and without
    blocking (a FIFO), read only if it is a regular file of at most `limit` bytes, parsed only if it
    nests at most MAX_NESTING deep: anything else is Corrupt."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise Corrupt("a symbolic link" if os.path.islink(path) else exc.strerror or str(exc)) from None
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise Corrupt("a folder" if stat.S_ISDIR(status.st_mode) else "not a regular file")
        if status.st_size > limit:
            raise Corrupt(f"{status.st_size} bytes, above {limit}")
        with os.fdopen(os.dup(fd), "rb") as handle:
            raw = handle.read(limit + 1)  # what was checked, even of a file that has grown since
    finally:
        os.close(fd)
    if len(raw) > limit:
        raise Corrupt(f"above {limit} bytes")
    if nesting(raw) > MAX_NESTING:
        raise Corrupt(f"nested deeper than {MAX_NESTING}")
    value = json.loads(raw.decode("utf-8"))
    if not isinstance(value, dict):
        raise Corrupt("not a JSON object")
    return value


def checked_record(path: Path, limit: int, what: str, source: Path) -> dict[str, Any] | None:
    """`read_record`, a record failing it removed with one warning (None: built again)."""
    try:
        return read_record(path, limit)
    except (Corrupt, OSError, ValueError) as exc:  # ValueError: not UTF-8, not JSON
        warn(what, source, str(exc) or type(exc).__name__)
        remove(path)
        return None


def file_stamp(status: os.stat_result) -> dict[str, int]:
    """What tells one version of a file from another: a rewrite in place under a restored mtime still
    changes its ctime, which no one can set back."""
    return {
        "size": status.st_size,
        "mtime_ns": status.st_mtime_ns,
        "ctime_ns": status.st_ctime_ns,
        "inode": status.st_ino,
    }


def digest_record(path: Path, status: os.stat_result) -> Path:
    stamp = "\0".join(map(str, (path.resolve(), *file_stamp(status).values())))
    return cache_root() / "digests" / (hashlib.sha256(os.fsencode(stamp)).hexdigest()[:32] + ".json")


def sealed(fields: Mapping[str, Any]) -> str:
    """The SHA-256 of a record's fields, in one spelling: a record carries it to prove itself whole."""
    return hashlib.sha256(json.dumps(dict(fields), sort_keys=True).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    """The file's SHA-256, hashed once per version of the file (path, size, mtime, ctime, inode) and
    recorded; a record that does not match its stamp or its own checksum is hashed again, as is one
    whose stamp was taken within RACY_NS of the file's last change."""
    from kvports.hub import sha256_of

    taken = time.time_ns()
    status = os.stat(path)
    record = digest_record(path, status)
    stamp = {"path": str(path.resolve()), **file_stamp(status)}
    saved = checked_record(record, MAX_RECORD, "digest record", path)
    with contextlib.suppress(KeyError, TypeError):
        if saved is not None:
            fields = {key: saved[key] for key in (*stamp, "sha256", "taken_ns")}
            if saved["seal"] != sealed(fields):
                warn("digest record", path, "its checksum does not match")
            elif all(saved[key] == value for key, value in stamp.items()):
                if status.st_ctime_ns + RACY_NS < saved["taken_ns"]:
                    return str(saved["sha256"])
    digest = sha256_of(path)
    fields = {**stamp, "sha256": digest, "taken_ns": taken}
    with contextlib.suppress(OSError, UserError):  # a home that cannot be written: hashed again next time
        record.parent.mkdir(parents=True, exist_ok=True)
        write_locked(record, json.dumps({**fields, "seal": sealed(fields)}).encode())
    return digest


@contextlib.contextmanager
def locked_temp(path: Path) -> Iterator[str]:
    """A temp file's name beside `path`, for the block to write, renamed over `path` when it ends,
    removed when it raises or is interrupted; its writer holds an exclusive lock on it throughout,
    so a later run knows a temp file nobody holds for a dead writer's (`remove_dead_temps`)."""
    with terminated_as_exit():
        while True:
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            fcntl.flock(fd, fcntl.LOCK_EX)
            with contextlib.suppress(OSError):
                if os.path.samestat(os.fstat(fd), os.stat(tmp)):
                    break  # still ours: no sweep took it between its creation and the lock
            os.close(fd)
        try:
            yield tmp
            usual_mode(tmp, 0o666)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        finally:
            os.close(fd)


def write_locked(path: Path, payload: bytes) -> None:
    """`payload` written atomically at `path`, through a locked temp file."""
    with locked_temp(path) as tmp:
        write_synced(tmp, payload)


def remove_dead_temps(root: Path) -> None:
    """Every temp file under the cache's folders whose writer is gone (no lock held on it: killed
    halfway through a write), removed; a live writer's is left alone."""
    for folder in (root, *(path for path in root.iterdir() if path.is_dir() and not path.is_symlink())):
        for path in folder.glob(".*.tmp"):
            with contextlib.suppress(OSError):
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: a live writer's, kept
                    if os.path.samestat(os.fstat(fd), os.lstat(path)):
                        path.unlink()
                finally:
                    os.close(fd)


@functools.lru_cache(maxsize=4)
def swept(root: str) -> None:
    """`remove_dead_temps`, once per process and home."""
    with contextlib.suppress(OSError):
        remove_dead_temps(Path(root))


@dataclass(frozen=True)
class Text:
    """The text side of a GGUF file: its tokenizer as tokenizer.json (None: the file has none), its
    chat template (None: none) and the bos_token / eos_token strings a template may use."""

    tokenizer: str | None
    template: str | None
    special: dict[str, str]
    context: int | None = None  # the model's context length: a rendering's budget is sized by it
    template_error: str | None = None  # why the template is not text (said when a chat asks for it)

    def load_tokenizer(self) -> Any:
        from tokenizers import Tokenizer

        assert self.tokenizer is not None
        return Tokenizer.from_str(self.tokenizer)


class Entry:
    """One GGUF file's folder in the cache (None from `entry_for` when the cache is off or the
    file cannot be hashed)."""

    def __init__(self, source: Path, digest: str):
        self.source, self.digest = source, digest
        self.folder = cache_root() / f"{digest}-{__version__}"

    def discard(self, what: str, why: str) -> None:
        """A corrupt entry: said once on stderr, removed, then built again by the caller."""
        warn(what, self.source, why)
        remove(self.folder / what)

    def save(self, name: str, payload: bytes) -> None:
        with contextlib.suppress(OSError, UserError):  # a home that cannot be written: nothing kept
            self.folder.mkdir(parents=True, exist_ok=True)
            write_locked(self.folder / name, payload)

    def regular(self, what: str) -> bool:
        """Whether the entry holds `what` as a regular file; anything else in its place (a link, a
        FIFO, a folder) is removed with a warning, and False: built again."""
        try:
            mode = os.lstat(self.folder / what).st_mode
        except OSError:
            return False
        if not stat.S_ISREG(mode):
            self.discard(what, "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file")
        return stat.S_ISREG(mode)

    def text(self) -> Text | None:
        """The kept text, checked by its seal; None when absent or failing the check (removed)."""
        path = self.folder / TEXT
        try:
            saved = read_record(path, MAX_TEXT)
            if saved is None:
                return None
            fields = {key: saved[key] for key in ("source_sha256", "version", *TEXT_FIELDS)}
            if saved.get("seal") != sealed(fields):
                raise Corrupt("its checksum does not match")
            if fields["source_sha256"] != self.digest or fields["version"] != __version__:
                raise Corrupt("made from another file or version")
            return Text(*(fields[key] for key in TEXT_FIELDS))
        except (Corrupt, OSError, ValueError, KeyError, TypeError) as exc:
            self.discard(TEXT, str(exc) or type(exc).__name__)
            return None

    def save_text(self, text: Text) -> None:
        fields = {
            "source_sha256": self.digest,
            "version": __version__,
            **{key: getattr(text, key) for key in TEXT_FIELDS},
        }
        self.save(TEXT, json.dumps({**fields, "seal": sealed(fields)}).encode())

    def tensors(self) -> CachedTensors | None:
        """The kept tensors, their header checked; None when absent or failing a check (removed)."""
        path = self.folder / TENSORS
        if not self.regular(TENSORS):
            return None
        try:
            return CachedTensors(path, self)
        except (Corrupt, OSError, ValueError, KeyError, TypeError, UserError) as exc:
            self.discard(TENSORS, str(exc) or type(exc).__name__)
            return None

    def save_tensors(self, config: ModelConfig, tensors: Mapping[str, np.ndarray], has_q4: bool) -> None:
        """The float32 tensors, each as the ports lay it out and with the checksum `checksum` gives,
        in one safetensors file, and its stamp: its bytes are the ones just checked and summed."""
        ours = {name: np.asarray(tensors[name], dtype=np.float32) for name, _ in iter_expected(config)}
        transposed = [name for name, array in ours.items() if stored_transposed(array.shape)]
        metadata = {
            "config": config.to_json(),
            "source_sha256": self.digest,
            "version": __version__,
            "has_q4": "1" if has_q4 else "0",
            "layout": LAYOUT,
            "transposed": json.dumps(transposed),
            "checksum": CHECKSUM,  # each tensor's, of its bytes as stored: `write_aligned` adds them
        }
        with contextlib.suppress(OSError, UserError):
            self.folder.mkdir(parents=True, exist_ok=True)
            remove(self.folder / CHECKED)  # no stamp outlives the file it was made for
            with locked_temp(self.folder / TENSORS) as tmp:
                write_aligned(tmp, ours, set(transposed), metadata)
            self.save_checked()

    def stamp(self) -> dict[str, int]:
        return file_stamp(os.stat(self.folder / TENSORS))

    def save_checked(self) -> None:
        """The tensors file's stamp, recorded once its every byte is known sound."""
        with contextlib.suppress(OSError):
            fields = self.stamp()
            self.save(CHECKED, json.dumps({**fields, "seal": sealed(fields)}).encode())

    def checked(self) -> bool:
        """Whether the tensors file is the one a full check passed: its stamp matches the record's,
        and it was last written before the record was (not within one tick of the clock)."""
        record = self.folder / CHECKED
        saved = checked_record(record, MAX_RECORD, CHECKED, self.source)
        with contextlib.suppress(OSError, KeyError, TypeError):
            if saved is not None:
                stamp = self.stamp()
                fields = {key: saved[key] for key in stamp}
                if saved["seal"] != sealed(fields):
                    self.discard(CHECKED, "its checksum does not match")
                elif fields == stamp:
                    return stamp["mtime_ns"] < os.lstat(record).st_mtime_ns
        return False


def write_aligned(
    path: str, tensors: Mapping[str, np.ndarray], transposed: set[str], metadata: Mapping[str, str]
) -> None:
    """A safetensors file (an 8-byte header length, the JSON header, the tensors' bytes back to
    back, as the format's specification lays it out), each tensor in `transposed` stored as its
    transpose [in, out], the header padded by spaces, as the specification allows, so the data
    starts at a multiple of ALIGNMENT bytes: then every tensor whose size is a multiple of it (all
    of a real model's) is mapped aligned. Written here because the library's writer places the data
    wherever its header ends. One tensor's stored copy at a time, its CRC-32 taken as it is written:
    the header is written first with zeros in their place, then again with them (the same length);
    flushed to disk before the rename."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, array in tensors.items():
        shape = list(array.shape[::-1] if name in transposed else array.shape)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes

    def encoded(checksums: Mapping[str, str]) -> bytes:
        """The length and the header, padded by spaces so that the data starts aligned."""
        header["__metadata__"]["checksums"] = json.dumps(dict(checksums))
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-(8 + len(text)) % ALIGNMENT)
        return struct.pack("<Q", len(text)) + text

    checksums = dict.fromkeys(tensors, checksum(np.zeros(0, np.float32)))
    placeholder = encoded(checksums)
    with open(path, "wb") as handle:
        handle.write(placeholder)
        for name, array in tensors.items():
            stored = np.ascontiguousarray(array.T if name in transposed else array, dtype=np.float32)
            checksums[name] = checksum(stored)  # [in, out] or as it is, C-contiguous
            handle.write(stored.data)
        final = encoded(checksums)
        assert len(final) == len(placeholder)  # fixed-width checksums: the data stays where it is
        handle.seek(0)
        handle.write(final)
        handle.flush()
        os.fsync(handle.fileno())


def checksum(stored: np.ndarray) -> str:
    """The CRC-32 of a tensor's bytes as stored (C order), eight hex digits: order-sensitive (two
    rows swapped change it), and one pass over memory (0.13 s for SmolLM2's 540 MB)."""
    return f"{zlib.crc32(np.ascontiguousarray(stored).data.cast('B')):08x}"


class CachedTensors(Closing):
    """The kept safetensors file, mapped: the library checks its header (offsets in order, in bounds,
    covering the data), then each tensor is a view of the mapped file (copy-on-write), in the
    ports' layout, its checksum checked when read unless the file is the one a full check passed."""

    def __init__(self, path: Path, entry: Entry):
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="numpy") as handle:  # the library's checks of the header
                metadata = handle.metadata() or {}
        except SafetensorError as exc:
            raise Corrupt(str(exc)) from None
        if metadata.get("source_sha256") != entry.digest or metadata.get("version") != __version__:
            raise Corrupt("made from another file or version")
        if metadata.get("layout") != LAYOUT:
            raise Corrupt("its tensors are laid out by another rule")
        if metadata.get("checksum") != CHECKSUM:
            raise Corrupt("its checksums are made by another rule")
        self.config = ModelConfig.from_json(metadata["config"])
        self.has_q4 = metadata.get("has_q4") == "1"
        self.checksums: dict[str, str] = json.loads(metadata["checksums"])
        self.transposed = set(json.loads(metadata["transposed"]))
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > MAX_HEADER:
                raise Corrupt("header too large")
            header = json.loads(handle.read(length))
        header.pop("__metadata__", None)
        entries = {name: (value["dtype"], self.used_shape(name, value["shape"])) for name, value in header.items()}
        if check_entries(entries, self.config, str(path)) != "float32" or set(self.checksums) != set(entries):
            raise Corrupt("its tensors are not the config's float32 tensors")
        if any((name in self.transposed) != stored_transposed(shape) for name, (_, shape) in entries.items()):
            raise Corrupt("its tensors are laid out by another rule")
        self.checked = entry.checked()  # before mapping: a file replaced since is checked in full
        self.mapped = np.memmap(path, dtype=np.uint8, mode="c")  # [bytes], private: writes stay in memory
        # A read of one byte a page maps every page now (from the page cache, ~5 ms for SmolLM2's 540 MB),
        # as llama.cpp's MAP_POPULATE does: the model is resident when loaded, its first step faults nothing.
        int(self.mapped[:: mmap.PAGESIZE].sum(dtype=np.uint64))
        self.base, self.header = 8 + length, header

    def read(self, name: str) -> np.ndarray:
        """Tensor `name` in the model's shape ([out, in] for a matrix, laid out as `write_aligned` stored it)."""
        start, end = self.header[name]["data_offsets"]
        array = self.mapped[self.base + start : self.base + end].view(np.float32).reshape(self.header[name]["shape"])
        if not self.checked and checksum(array) != self.checksums[name]:  # of the bytes as stored
            raise Corrupt(f"tensor {name}'s checksum does not match")
        array = np.asarray(array)  # a view of the mapped file
        return array.T if name in self.transposed else array

    def used_shape(self, name: str, shape: list[int]) -> tuple[int, ...]:
        """A stored tensor's shape as the model has it: `write_aligned` stores a transposed matrix [in, out]."""
        return tuple(shape[::-1]) if name in self.transposed else tuple(shape)

    def close(self) -> None:
        self.mapped = None  # type: ignore[assignment]  # the map closes with its last view


def entry_for(path: os.PathLike) -> Entry | None:
    """The file's entry in the cache (maybe empty yet), or None when the cache is off."""
    if not enabled():
        return None
    swept(str(cache_root()))  # a writer killed on an earlier run: its temp files go
    try:
        return Entry(Path(path), file_sha256(Path(path)))
    except OSError:
        return None


def clear() -> None:
    """Every entry removed (`kvports fetch --clear-cache` style housekeeping; tests)."""
    shutil.rmtree(cache_root(), ignore_errors=True)


class CachedGGUFWeights(Closing):
    """A GGUF file served from its cache entry, through the interface of `weights.GGUFWeights`:
    `config`, `read(dtype, quant)` (a tensor whose checksum fails: the whole entry is dropped and
    the file read again), `has_q4()`."""

    def __init__(self, path: os.PathLike, entry: Entry, cached: CachedTensors):
        self.source, self.entry, self.cached = str(path), entry, cached
        self.config, self.dtype = cached.config, "float32"

    def read(self, dtype: str | None = None, quant: str = "none") -> dict[str, np.ndarray]:
        from kvports.formats.weights import GGUFWeights

        dtype = self.dtype if dtype is None else dtype
        self.config.validate_at(dtype)
        try:
            tensors = {}
            for name, _ in iter_expected(self.config):
                array = self.cached.read(name)  # [out, in] or [D]: a view of the mapped entry
                if not self.cached.checked:
                    check_finite(name, array, self.source)
                tensors[name] = cast_checked(name, array, dtype, self.source)
        except Corrupt as exc:
            self.entry.discard(TENSORS, str(exc))
            with GGUFWeights(Path(self.source), self.entry) as file:  # read again, and kept again
                return file.read(dtype, quant)
        if not self.cached.checked:
            self.entry.save_checked()  # every byte summed and finite: the next load may skip it
        if quant == "q4":  # the file's own 4-bit blocks: from the GGUF file, which only they need
            with GGUFWeights(Path(self.source)) as file:
                tensors.update(file.q4_tensors())
        return tensors

    def has_q4(self) -> bool:
        return self.cached.has_q4

    def close(self) -> None:
        self.cached.close()


def open_gguf(path: os.PathLike) -> CachedGGUFWeights | GGUFWeights:
    """A GGUF file as a weights file: from its cache entry when there is a sound one, else read
    (and its entry written when its tensors are)."""
    from kvports.formats.weights import GGUFWeights

    entry = entry_for(path)
    cached = None if entry is None else entry.tensors()
    if entry is not None and cached is not None:
        return CachedGGUFWeights(path, entry, cached)
    return GGUFWeights(path, entry)


def kept_text(path: os.PathLike, read: Callable[[Path], Text]) -> Text:
    """The file's tokenizer, chat template and special strings: from its cache entry, else `read`
    from its metadata (`tokenizer.read_text`; one `error:` line for a tokenizer that cannot be built,
    and nothing kept then). Once per version of the file in a process: a run asks for the
    tokenizer and the template apart."""
    stamp = tuple(file_stamp(os.stat(path)).values())
    where = str(cache_root()) if enabled() else None
    return text_of(str(Path(path).resolve()), stamp, where, read)


@functools.lru_cache(maxsize=2)
def text_of(path: str, stamp: tuple[int, ...], cache: str | None, read: Callable[[Path], Text]) -> Text:
    entry = entry_for(Path(path))
    text = None if entry is None else entry.text()
    if text is None:
        text = read(Path(path))
        if entry is not None:
            entry.save_text(text)
    return text
