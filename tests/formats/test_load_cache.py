"""The load cache (kvports.formats.gguf.cache): a GGUF file's first load keeps its tokenizer, chat
template, config and float32 tensors under $KVPORTS_HOME; later loads map them, equal to a fresh read;
an entry that fails a check is rebuilt, with a warning, never trusted and never a traceback."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvports.formats.gguf import cache, reader
from kvports.formats.gguf.tokenizer import gguf_text, gguf_tokenizer
from kvports.formats.weights import GGUFWeights
from kvports.run import open_model
from tests.helpers.gguf_files import write_gguf


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


@pytest.mark.parametrize("damage", [flip_a_tensor_byte, truncate_the_tensors, edit_the_text])
def test_a_damaged_entry_is_rebuilt_with_a_warning(home, gguf, capsys, damage):
    load(gguf)
    template = gguf_text(gguf).template
    (folder,) = [path for path in (home / cache.FOLDER).iterdir() if path.name != "digests"]
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
    from kvports import run

    previous = jax.config.jax_compilation_cache_dir
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        monkeypatch.setenv(run.JAX_CACHE_VARIABLE, "0")
        run.use_jax_cache()
        assert jax.config.jax_compilation_cache_dir is None
        monkeypatch.delenv(run.JAX_CACHE_VARIABLE)
        run.use_jax_cache()
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
