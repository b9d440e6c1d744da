"""The load cache (kvports.formats.gguf.cache): a GGUF file's first load keeps its tokenizer, chat
template, config and float32 tensors under $KVPORTS_HOME; later loads map them, equal to a fresh read;
an entry that fails a check is rebuilt, with a warning, never trusted and never a traceback."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from kvports.formats.gguf import cache, reader
from kvports.formats.gguf.tokenizer import gguf_text, gguf_tokenizer
from kvports.formats.weights import GGUFWeights
from kvports.loading import open_model
from kvports.shared.shapes import stored_transposed
from tests.helpers.gguf_files import write_gguf
from tests.helpers.ports import port_or_skip


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPORTS_HOME", str(tmp_path / "home"))
    cache.text_of.cache_clear()
    return tmp_path / "home"


@pytest.fixture
def gguf(tmp_path):
    return write_gguf(tmp_path / "model.gguf", "Q4_1")


def fresh(path) -> dict[str, np.ndarray]:
    with GGUFWeights(path) as file:
        return file.read("float32")


def load(path, dtype="float32") -> tuple[type, dict[str, np.ndarray]]:
    with open_model(path) as file:
        return type(file), file.read(dtype)


def no_gguf_parse(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the GGUF file was parsed again")

    monkeypatch.setattr(reader, "cached_reader", refuse)
    cache.text_of.cache_clear()


def test_a_second_load_maps_the_kept_tensors_equal_to_a_fresh_read(home, gguf, monkeypatch):
    first_kind, first = load(gguf)
    no_gguf_parse(monkeypatch)
    second_kind, second = load(gguf)
    assert (first_kind, second_kind) == (GGUFWeights, cache.CachedGGUFWeights)
    assert second.keys() == first.keys()
    assert all(np.array_equal(second[name], first[name]) for name in first)


def test_a_second_load_reads_the_kept_tokenizer_and_template(home, gguf, monkeypatch):
    built = gguf_tokenizer(gguf)
    template = gguf_text(gguf).template
    no_gguf_parse(monkeypatch)
    kept = gguf_tokenizer(gguf)
    assert kept.encode("naïve café 東京").ids == built.encode("naïve café 東京").ids
    assert gguf_text(gguf).template == template and "im_start" in template


def entry_folder(home):
    (folder,) = [path for path in (home / cache.FOLDER).iterdir() if path.name != "digests"]
    return folder


def checked_entry(home, gguf):
    """The file's entry, written and then checked in full once (its stamp recorded): the tensors
    file's mtime set back ten seconds, so the stamp cannot fall within the clock's tick of it."""
    load(gguf)
    path = entry_folder(home) / cache.TENSORS
    old = time.time_ns() - 10 * 10**9
    os.utime(path, ns=(old, old))
    load(gguf)  # the stamp no longer matches: every byte checked, then stamped again
    return path


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_a_model_loaded_from_the_entry_uses_the_mapped_tensors_as_they_lie(home, gguf, framework):
    """Nothing copied: each weight is the mapped file's memory, 64-byte aligned, in the layout the
    ports stream fastest (`stored_transposed`), and a write to it never reaches the file."""
    port = port_or_skip(framework)
    load(gguf)
    with open_model(gguf) as file:
        tensors = file.read("float32")
        mapped = file.cached.mapped
        model = port.load_model(file.config, tensors)
    for name in ("blocks.0.qkv.weight", "blocks.0.ffn.2.weight", "emb.weight"):
        weight = np.asarray(model.get_parameter(name).detach()) if framework == "torch" else owner_value(model, name)
        assert np.shares_memory(weight, mapped) and weight.ctypes.data % 64 == 0, name
        assert weight.flags.f_contiguous == stored_transposed(weight.shape), name
    before = (entry_folder(home) / cache.TENSORS).read_bytes()
    tensors["emb.weight"][0, 0] += 1.0
    assert (entry_folder(home) / cache.TENSORS).read_bytes() == before


def owner_value(model, name):
    """A NumPy model's parameter by its state_dict name."""
    return {key: getattr(owner, attr) for key, owner, attr in model.named_parameters()}[name]


def test_a_checked_entry_is_loaded_without_a_pass_over_its_bytes(home, gguf, monkeypatch):
    checked_entry(home, gguf)
    expected = fresh(gguf)

    def refuse(array):
        raise AssertionError("the checked entry was summed again")

    monkeypatch.setattr(cache, "checksum", refuse)
    kind, tensors = load(gguf)
    assert kind is cache.CachedGGUFWeights
    assert all(np.array_equal(tensors[name], expected[name]) for name in expected)


def test_a_byte_changed_under_a_restored_mtime_is_still_caught(home, gguf, capsys):
    """The stamp holds the inode's ctime, which no one can set back."""
    path = checked_entry(home, gguf)
    status = path.stat()
    time.sleep(0.05)  # past a coarse clock's tick: the change gets a ctime of its own
    with open(path, "r+b") as handle:
        handle.seek(-5, os.SEEK_END)
        byte = handle.read(1)
        handle.seek(-5, os.SEEK_END)
        handle.write(bytes([byte[0] ^ 0x01]))
    os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns))
    _, tensors = load(gguf)
    assert "checksum does not match" in capsys.readouterr().err
    expected = fresh(gguf)
    assert all(np.array_equal(tensors[name], expected[name]) for name in expected)


def flip_a_tensor_byte(folder):
    path = folder / cache.TENSORS
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01  # a bit of the last tensor's data
    path.write_bytes(bytes(data))


def truncate_the_tensors(folder):
    path = folder / cache.TENSORS
    path.write_bytes(path.read_bytes()[:-100])


def edit_the_text(folder):
    path = folder / cache.TEXT
    saved = json.loads(path.read_text())
    saved["template"] = "{{ 'something else' }}"
    path.write_text(json.dumps(saved))


def store_by_an_older_rule(folder):
    """The tensors as an entry written before the layout rule holds them: each as the model has it,
    at whatever offset the library's writer gives it, without the layout in its metadata."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    path = folder / cache.TENSORS
    with safe_open(str(path), framework="numpy") as handle:
        metadata = handle.metadata()
        transposed = set(json.loads(metadata.pop("transposed")))
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    del metadata["layout"]
    save_file(
        {name: np.ascontiguousarray(a.T if name in transposed else a) for name, a in tensors.items()}, path, metadata
    )


@pytest.mark.parametrize("damage", [flip_a_tensor_byte, truncate_the_tensors, edit_the_text, store_by_an_older_rule])
def test_a_damaged_entry_is_rebuilt_with_a_warning(home, gguf, capsys, damage):
    load(gguf)
    template = gguf_text(gguf).template
    folder = entry_folder(home)
    damage(folder)
    cache.text_of.cache_clear()
    _, tensors = load(gguf)
    assert gguf_text(gguf).template == template
    assert "failed a check" in capsys.readouterr().err
    expected = fresh(gguf)
    assert all(np.array_equal(tensors[name], expected[name]) for name in expected)
    kind, again = load(gguf)  # built again: sound
    assert kind is cache.CachedGGUFWeights and all(np.array_equal(again[name], expected[name]) for name in expected)


def test_a_changed_file_is_hashed_again_and_gets_its_own_entry(home, tmp_path):
    path = write_gguf(tmp_path / "model.gguf", "F32", seed=1)
    load(path)
    write_gguf(path, "F32", seed=2)  # the same name, other weights
    _, tensors = load(path)
    expected = fresh(path)
    assert all(np.array_equal(tensors[name], expected[name]) for name in expected)
    assert len([entry for entry in (home / cache.FOLDER).iterdir() if entry.name != "digests"]) == 2


def test_a_file_whose_name_is_not_utf8_is_kept_and_mapped(home, tmp_path, monkeypatch):
    folder = os.fsdecode(bytes(tmp_path) + b"/caf\xe9")  # a Latin-1 name on a UTF-8 system
    os.mkdir(folder)
    path = write_gguf(Path(folder) / "model.gguf", "F32")
    _, first = load(path)
    no_gguf_parse(monkeypatch)
    kind, tensors = load(path)
    assert kind is cache.CachedGGUFWeights and tensors.keys() == first.keys()


def test_a_forged_digest_record_is_not_trusted(home, gguf):
    load(gguf)
    (record,) = (home / cache.FOLDER / "digests").iterdir()
    saved = json.loads(record.read_text())
    saved["sha256"] = "0" * 64  # another file's entry, without the seal to match
    record.write_text(json.dumps(saved))
    assert cache.file_sha256(gguf) != "0" * 64


def test_float64_and_q4_loads_come_from_the_same_entry(home, gguf):
    load(gguf)
    with open_model(gguf) as file:
        assert isinstance(file, cache.CachedGGUFWeights)
        tensors = file.read("float64", "q4")
    with GGUFWeights(gguf) as file:
        expected = file.read("float64", "q4")
    assert tensors.keys() == expected.keys()
    assert all(np.array_equal(tensors[name], expected[name]) for name in expected)


def test_the_cache_is_off_with_its_variable(home, gguf, monkeypatch):
    monkeypatch.setenv(cache.SWITCH, "0")
    load(gguf)
    kind, _ = load(gguf)
    assert kind is GGUFWeights and not (home / cache.FOLDER).exists()


def test_jax_keeps_what_it_compiles_under_kvports_home_unless_told_not_to(home, monkeypatch):
    jax = pytest.importorskip("jax")
    from kvports import loading

    previous = jax.config.jax_compilation_cache_dir
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        monkeypatch.setenv(loading.JAX_CACHE_VARIABLE, "0")
        loading.use_jax_cache()
        assert jax.config.jax_compilation_cache_dir is None
        monkeypatch.delenv(loading.JAX_CACHE_VARIABLE)
        loading.use_jax_cache()
        assert jax.config.jax_compilation_cache_dir == str(home / "jax")
    finally:
        jax.config.update("jax_compilation_cache_dir", previous)


@pytest.mark.parametrize("elapsed, drawn", [(0.5, False), (1.5, True)])
def test_a_load_draws_its_bar_on_a_terminal_once_it_has_taken_a_second(monkeypatch, elapsed, drawn):
    from kvports import progress

    started = []

    class Bar:
        def start(self):
            started.append(True)

        def add_task(self, what, total):
            return 0

        def update(self, task, completed):
            pass

        def stop(self):
            pass

    clock = iter([0.0, elapsed, elapsed])
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(progress.sys.stderr, "isatty", lambda: True)
    monkeypatch.setattr(progress, "make_progress", lambda quiet: Bar())
    with progress.load_progress(2, "dequantizing") as advance:
        read = advance(lambda name: name.upper())
        assert read("a") == "A"
    assert bool(started) is drawn


# ---------------------------------------------------------------- what the cache must never be fooled by


def equal_to_a_fresh_read(tensors, path) -> bool:
    expected = fresh(path)
    return tensors.keys() == expected.keys() and all(np.array_equal(tensors[name], expected[name]) for name in expected)


def test_a_gguf_file_rewritten_in_place_under_its_old_mtime_is_hashed_again(home, tmp_path, monkeypatch):
    """Same path, inode, size and mtime, other weights: the stamp's ctime tells them apart."""
    path = write_gguf(tmp_path / "model.gguf", "F32", seed=1)
    other = write_gguf(tmp_path / "other.gguf", "F32", seed=2)
    monkeypatch.setattr(cache, "RACY_NS", 0)  # the stamp trusted at once: only its ctime can tell
    load(path)
    before = path.stat()
    time.sleep(0.05)  # past a coarse clock's tick: the rewrite gets a ctime of its own
    with open(path, "r+b") as handle:
        handle.write(other.read_bytes())
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    _, tensors = load(path)
    assert equal_to_a_fresh_read(tensors, path)


def stored_rows(folder, name):
    """Where tensor `name`'s stored rows lie in the entry's tensors file: (start, row bytes)."""
    path = folder / cache.TENSORS
    with open(path, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(length))
    start, end = header[name]["data_offsets"]
    return 8 + length + start, (end - start) // header[name]["shape"][0]


def test_two_rows_of_a_kept_tensor_swapped_fail_its_checksum(home, gguf, capsys):
    load(gguf)
    path = entry_folder(home) / cache.TENSORS
    start, row = stored_rows(entry_folder(home), "emb.weight")
    data = bytearray(path.read_bytes())
    first, second = data[start : start + row], data[start + row : start + 2 * row]
    assert first != second
    data[start : start + 2 * row] = second + first
    path.write_bytes(bytes(data))
    _, tensors = load(gguf)
    assert "checksum does not match" in capsys.readouterr().err
    assert equal_to_a_fresh_read(tensors, gguf)


def digest_record(home):
    (record,) = (home / cache.FOLDER / "digests").iterdir()
    return record


def checked_record(home):
    return entry_folder(home) / cache.CHECKED


def tensors_file(home):
    return entry_folder(home) / cache.TENSORS


def make_fifo(path):
    os.mkfifo(path)


def link_to_dev_zero(path):
    os.symlink("/dev/zero", path)


def make_folder(path):
    path.mkdir()


def nest_deeply(path):
    path.write_text("[" * 4000 + "]" * 4000)


def fill_past_the_bound(path):
    path.write_text(json.dumps({"padding": "x" * 10_000}))


def load_within(gguf, seconds: float, fifo=None):
    """A load in a thread, given `seconds` to end (a reader blocked on a FIFO released after)."""
    import threading

    done: list = []
    worker = threading.Thread(target=lambda: done.append(load(gguf)), daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive() and fifo is not None and fifo.exists():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # the reader sees the end of the pipe
        worker.join(seconds)
    return done


@pytest.mark.parametrize("record", [digest_record, checked_record, tensors_file])
@pytest.mark.parametrize("odd", [make_fifo, link_to_dev_zero, make_folder, nest_deeply, fill_past_the_bound])
def test_a_record_that_is_not_a_small_regular_json_file_is_rebuilt_with_one_warning(home, gguf, capsys, record, odd):
    checked_entry(home, gguf)
    path = record(home)
    path.unlink()
    odd(path)
    capsys.readouterr()
    done = load_within(gguf, 30, fifo=path if odd is make_fifo else None)
    assert done, "the load hung"
    assert equal_to_a_fresh_read(done[0][1], gguf)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "failed a check" in warnings[0], warnings
    assert path.is_file() and not path.is_symlink()  # rebuilt in its place
    capsys.readouterr()
    load(gguf)
    assert "warning" not in capsys.readouterr().err


DIE_WRITING = """
import os, signal, sys
from kvports.formats.gguf import cache
from kvports.loading import open_model

def dying(path, *args):
    with open(path, "wb") as handle:
        handle.write(bytes(4096))
        handle.flush()
    os.kill(os.getpid(), signal.SIGKILL)  # kill -9 halfway through the first write

cache.write_aligned = dying
with open_model(sys.argv[1]) as file:
    file.read("float32")
"""


def test_a_killed_writers_temp_file_is_removed_on_the_next_run(home, gguf):
    import subprocess
    import sys

    env = {**os.environ, "KVPORTS_HOME": str(home)}
    result = subprocess.run([sys.executable, "-c", DIE_WRITING, str(gguf)], env=env, capture_output=True)
    assert result.returncode == -9, result.stderr
    assert list(home.rglob("*.tmp")), "the killed writer left no temp file: the test proves nothing"
    kind, tensors = load(gguf)
    assert not list(home.rglob("*.tmp"))
    assert kind is GGUFWeights and equal_to_a_fresh_read(tensors, gguf)


def test_a_live_writers_temp_file_is_kept(home, gguf):
    load(gguf)
    folder = entry_folder(home)
    with cache.locked_temp(folder / "kept.json") as tmp:
        cache.remove_dead_temps(home / cache.FOLDER)
        assert os.path.exists(tmp)
    assert (folder / "kept.json").is_file()
