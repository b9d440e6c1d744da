"""Weights files kvports refuses: what the one safetensors reader refuses from the header alone
(before a byte of tensor data is read) and from the values as it reads them, a file it cannot
open, and a Hugging Face checkpoint or an empty draft where a weights file belongs. Each is one
`error:` line, exit 2, the same in every framework, before any port loads; a file valid after all
(float64 past float32's range, at float64; a file replaced while open) is read as it is."""

from __future__ import annotations

import json
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from kvports.formats.weights import DEFAULT_WEIGHTS, load_weights, open_weights, save_weights
from kvports.registry import PORTS
from kvports.shared.config import MAX_SIZE, ModelConfig
from tests.helpers.commands import assert_one_error_line, refusals_in_every_framework, run_cli
from tests.helpers.weights_files import GIB, raw_file, seed_tensors

SEED_BYTES = DEFAULT_WEIGHTS.read_bytes()


# --- what the one safetensors reader refuses ------------------------------------------------------


def weights_file(path: Path, tensors=None, config_json=None, metadata=None) -> Path:
    """The seed's tensors (or these), with the seed's config (or this JSON, or this metadata)."""
    config = {"config": config_json if config_json is not None else ModelConfig().to_json()}
    save_file(
        seed_tensors() if tensors is None else tensors, str(path), metadata=config if metadata is None else metadata
    )
    return path


def seed_header(**changes: tuple[str, list[int]]) -> tuple[dict, int]:
    """The seed's header, with these tensors' (dtype, shape) changed and offsets redone; the data's size."""
    header, offset = {"__metadata__": {"config": ModelConfig().to_json()}}, 0
    for name, array in seed_tensors().items():
        dtype, shape = changes.pop(name, ("F32", list(array.shape)))
        size = int(np.prod(shape)) * {"F32": 4, "F64": 8}[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    for name, (dtype, shape) in changes.items():  # tensors the seed does not have, after the others
        size = int(np.prod(shape)) * 4
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    return header, offset


def file_of(content: bytes):
    def build(path: Path) -> Path:
        path.write_bytes(content)
        return path

    return build


def with_tensor(name: str, array: np.ndarray) -> dict[str, np.ndarray]:
    return {**seed_tensors(), name: array}


def edited(name: str, edit, dtype=np.float32) -> dict[str, np.ndarray]:
    tensors = {key: array.astype(dtype) for key, array in seed_tensors().items()}
    tensors[name] = edit(tensors[name])
    return tensors


def set_at(index: int, value: float):
    def edit(array):
        array.reshape(-1)[index] = value
        return array

    return edit


def negative_offsets(path: Path) -> Path:
    header, size = seed_header()
    header["emb.weight"]["data_offsets"] = [-16, header["emb.weight"]["data_offsets"][1]]
    return raw_file(path, header, size=size)


def overlapping_offsets(path: Path) -> Path:
    header, size = seed_header()
    header["pos.weight"]["data_offsets"][0] -= 16  # the last 16 bytes of emb.weight, read twice
    return raw_file(path, header, size=size)


def without_dtype(path: Path) -> Path:
    header, size = seed_header()
    del header["ln.bias"]["dtype"]
    return raw_file(path, header, size=size)


def huge_tensor(name: str, shape: list[int]):
    def build(path: Path) -> Path:
        header, size = seed_header(**{name: ("F32", shape)})
        return raw_file(path, header, size=size)

    return build


# Refused from the header (or the file's metadata) alone: no tensor is read.
HEADER_REFUSALS = {
    "missing": (lambda p: p / "absent.safetensors", "does not exist"),
    "empty": (file_of(b""), "is empty"),
    "folder": (lambda p: p.parent, "is not a regular file"),
    "name_too_long": (lambda p: p.parent / ("w" * 300 + ".safetensors"), "(File name too long)"),
    "truncated": (file_of(SEED_BYTES[:100_000]), "truncated"),
    "stray_bytes": (file_of(SEED_BYTES + b"\0" * 8), "bytes past its last tensor"),
    "negative_offsets": (negative_offsets, "expected usize"),
    "overlapping_offsets": (overlapping_offsets, "overlapping"),
    "tensor_without_dtype": (without_dtype, "missing field `dtype`"),
    "metadata_not_object": (lambda p: raw_file(p, {"__metadata__": [1]}), "not the JSON the format allows"),
    "nested_header": (lambda p: raw_file(p, b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"), "recursion limit"),
    "pickle": (file_of(pickle.dumps({"emb.weight": [1.0]})), "not a valid safetensors file"),
    "text": (file_of(b"not a weights file at all\n"), "not a valid safetensors file"),
    "header_too_long": (file_of(struct.pack("<Q", 10**9) + b"{}"), "100 MB"),
    "missing_tensor": (
        lambda p: weights_file(p, {k: v for k, v in seed_tensors().items() if k != "blocks.1.proj.bias"}),
        "missing tensor 'blocks.1.proj.bias'",
    ),
    "extra_tensor": (
        lambda p: weights_file(p, with_tensor("blocks.2.qkv.weight", np.zeros((384, 128), np.float32))),
        "unexpected tensor 'blocks.2.qkv.weight'",
    ),
    "wrong_shape": (
        lambda p: weights_file(p, with_tensor("blocks.0.qkv.weight", np.zeros((384, 127), np.float32))),
        "tensor 'blocks.0.qkv.weight' has shape [384, 127], the config needs [384, 128]",
    ),
    "huge_misshapen_tensor": (
        huge_tensor("emb.weight", [GIB // 1024, 1024]),
        "tensor 'emb.weight' has shape [1048576, 1024], the config needs [500, 128]",
    ),
    "huge_unexpected_tensor": (huge_tensor("extra", [GIB // 1024, 1024]), "unexpected tensor 'extra'"),
    "float16": (
        lambda p: weights_file(p, {k: v.astype(np.float16) for k, v in seed_tensors().items()}),
        "has dtype F16; supported: float32, float64",
    ),
    "int_tensor": (
        lambda p: weights_file(p, edited("ln.bias", lambda a: a.astype(np.int32))),
        "'ln.bias' has dtype I32",
    ),
    "mixed_dtypes": (
        lambda p: weights_file(p, edited("ln.bias", lambda a: a.astype(np.float64))),
        "tensors mix dtypes ['float32', 'float64']",
    ),
    "no_config": (lambda p: weights_file(p, metadata={"format": "pt"}), "has no 'config' metadata"),
    "config_not_json": (lambda p: weights_file(p, config_json="{vocab_size: 500"), "config metadata is not valid JSON"),
    "config_nested": (lambda p: weights_file(p, config_json="[" * 100_000), "nested too deeply"),
    "config_unknown_field": (
        lambda p: weights_file(p, config_json=json.dumps({"vocab_size": 500, "n_expert": 8})),
        "unknown field 'n_expert'",
    ),
    "config_bad_value": (
        lambda p: weights_file(p, config_json=json.dumps({"n_heads": 0})),
        f"n_heads=0 must be an integer in [1, {MAX_SIZE}]",
    ),
    "config_contradicts_tensors": (
        lambda p: weights_file(p, config_json=json.dumps({"d_model": 64})),
        "tensor 'emb.weight' has shape [500, 128], the config needs [500, 64]",
    ),
    # n_layers names 2**30 blocks; the file has two. The names are walked, never listed.
    "config_huge_n_layers": (
        lambda p: weights_file(p, config_json=json.dumps({"n_layers": MAX_SIZE})),
        "missing tensor 'blocks.2.ln1.weight'",
    ),
    "config_n_layers_past_bound": (
        lambda p: weights_file(p, config_json=json.dumps({"n_layers": MAX_SIZE + 1})),
        f"n_layers={MAX_SIZE + 1} must be an integer in [1, {MAX_SIZE}]",
    ),
    "config_max_seq_len_past_bound": (
        lambda p: weights_file(p, config_json=json.dumps({"max_seq_len": 2**31})),
        f"max_seq_len=2147483648 must be an integer in [1, {MAX_SIZE}]",
    ),
    "config_window_past_int64": (
        lambda p: weights_file(p, config_json=json.dumps({"sliding_window": 2**64})),
        "sliding_window=18446744073709551616 must be an integer in [1, 9223372036854775807]",
    ),
    "config_infinite_norm_eps": (  # 1e999 is standard JSON for inf
        lambda p: weights_file(p, config_json='{"norm_eps": 1e999}'),
        "norm_eps=inf must be a finite number > 0",
    ),
    "config_nan_norm_eps": (lambda p: weights_file(p, config_json='{"norm_eps": NaN}'), "norm_eps=nan must be"),
    "config_infinite_rope_theta": (
        lambda p: weights_file(p, config_json='{"rope_theta": 1e999}'),
        "rope_theta=inf must be a finite number > 0",
    ),
    # Finite in float64, inf in float32 (the default --dtype): every token would be 0.
    "norm_eps_past_float32": (
        lambda p: weights_file(
            p, {k: v.astype(np.float64) for k, v in seed_tensors().items()}, config_json='{"norm_eps": 1e300}'
        ),
        "norm_eps=1e+300 is not a finite number > 0 in float32, the compute dtype",
    ),
}


# Refused as the tensors are read: only their values tell.
DATA_REFUSALS = {
    "non_finite": (lambda p: weights_file(p, edited("ln.weight", set_at(3, np.nan))), "'ln.weight' has non-finite"),
    # Finite float64 values past float32's range: inf after the cast, NaN logits, garbage tokens.
    "float64_past_float32": (
        lambda p: weights_file(p, edited("ln.weight", set_at(0, 1e39), np.float64)),
        "tensor 'ln.weight' holds 1e+39, beyond float32's range: it would be inf at dtype float32",
    ),
}


@pytest.mark.parametrize("case", sorted(HEADER_REFUSALS))
def test_a_weights_file_the_header_condemns_is_refused_unread(
    tmp_path, capsys, no_port_may_load, no_tensor_may_be_read, case
):
    build, expected = HEADER_REFUSALS[case]
    path = build(tmp_path / "w.safetensors")
    assert expected in refusals_in_every_framework(capsys, "--weights", path)


@pytest.mark.parametrize("case", sorted(DATA_REFUSALS))
def test_a_weights_file_with_bad_values_is_refused_as_it_is_read(tmp_path, capsys, no_port_may_load, case):
    build, expected = DATA_REFUSALS[case]
    path = build(tmp_path / "w.safetensors")
    assert expected in refusals_in_every_framework(capsys, "--weights", path)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_weights_file_is_one_error_line(tmp_path, capsys, no_port_may_load):
    path = weights_file(tmp_path / "w.safetensors")
    path.chmod(0)
    assert "(Permission denied)" in refusals_in_every_framework(capsys, "--weights", path)


def test_a_float64_file_past_float32_is_read_at_float64(tmp_path):
    path = DATA_REFUSALS["float64_past_float32"][0](tmp_path / "w.safetensors")
    assert load_weights(path, "float64")[1]["ln.weight"][0] == 1e39


def test_a_file_replaced_while_open_is_read_whole_from_the_old_one(tmp_path):
    path = weights_file(tmp_path / "w.safetensors")
    other = dict(seed_tensors(), **{"ln.bias": np.full(128, 7.0, np.float32)})
    with open_weights(path) as weights:
        save_weights(path, other, ModelConfig())  # an atomic replacement: a new file under the same name
        tensors = weights.read()
    np.testing.assert_array_equal(tensors["ln.bias"], seed_tensors()["ln.bias"])
    assert load_weights(path)[1]["ln.bias"][0] == 7.0


def test_to_hf_refuses_weights_past_the_dtype_it_writes(tmp_path, capsys):
    path = DATA_REFUSALS["float64_past_float32"][0](tmp_path / "w.safetensors")
    argv = ("convert", "--to-hf", path, "--out", tmp_path / "gpt2", "--dtype", "float32")
    assert "beyond float32's range" in assert_one_error_line(*run_cli(capsys, *argv))
    assert not (tmp_path / "gpt2").exists()


# --- where a weights file belongs: not a Hugging Face checkpoint, not an empty draft --------------


@pytest.mark.parametrize("given", ["folder", "its model.safetensors"])
def test_a_hugging_face_checkpoint_as_weights_says_to_convert_it(capsys, no_port_may_load, tmp_path, given):
    from tests.helpers.hf_files import llama_config, llama_tensors, write_hf_dir

    config = llama_config()
    folder = write_hf_dir(tmp_path / "hf", config, llama_tensors(config))
    path = folder if given == "folder" else folder / "model.safetensors"
    argv = ["generate", "--framework", "numpy", "--mode", "cached", "--weights", path]
    err = assert_one_error_line(*run_cli(capsys, *argv))
    assert f"convert it once with kvports convert --from-hf '{folder}' --out model.safetensors" in err


@pytest.mark.parametrize("framework", PORTS)
def test_an_empty_draft_is_called_empty_not_a_folder(capsys, no_port_may_load, framework):
    err = assert_one_error_line(
        *run_cli(capsys, "generate", "--framework", framework, "--mode", "speculative", "--draft", "")
    )
    assert err == "error: --draft '' is empty: give a smaller model's weights file or 'ngram'\n"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
@pytest.mark.parametrize("flag", ["--weights", "--draft"])
def test_a_fifo_as_weights_is_refused_unopened_in_every_port(tmp_path, capsys, monkeypatch, no_port_may_load, flag):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    real_open = open

    def never_the_fifo(file, *args, **kwargs):  # opening it for reading would wait for a writer, forever
        assert not (isinstance(file, (str, os.PathLike)) and Path(file) == fifo), "the FIFO was opened"
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", never_the_fifo)
    mode = ("--mode", "speculative") if flag == "--draft" else ()
    err = refusals_in_every_framework(capsys, flag, fifo, *mode)
    assert f"{str(fifo)!r} is not a regular file" in err
