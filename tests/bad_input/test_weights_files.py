"""Every bad input: one `error:` line on stderr naming the value and the limit, exit 2,
nothing on stdout, the same for every framework, caught in shared/ before any port runs
(and, where the header tells, before any tensor is read); or, where the input is valid
after all (a wide sliding window), the same correct tokens in every port.

One table per class of bad input: a file the weights reader must refuse, a
Hugging Face directory, prompts, sizes that would exhaust memory, output paths, the
command line itself. The next bad input is a line in its table.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from kvports.flags import non_negative_int, positive_int
from kvports.formats.weights import (
    DEFAULT_WEIGHTS,
    SafetensorsFile,
    gpt2_init_weights,
    load_weights,
    open_weights,
    save_weights,
)
from kvports.registry import PORTS
from kvports.shared.config import MAX_SIZE, ModelConfig
from kvports.shared.errors import UserError
from tests.helpers.commands import assert_one_error_line, run_cli
from tests.helpers.hf_files import llama_config, llama_tensors, write_hf_dir
from tests.helpers.ports import port_or_skip

SEED_BYTES = DEFAULT_WEIGHTS.read_bytes()
GIB = 2**30


@pytest.fixture
def no_tensor_may_be_read(monkeypatch):
    """A bad input the header shows must be refused before a byte of tensor data is read."""

    def refuse(self, name):
        raise AssertionError(f"tensor {name} was read before the header was checked")

    monkeypatch.setattr(SafetensorsFile, "read", refuse)


def refusals_in_every_framework(capsys, *argv) -> str:
    """`kvports generate --framework F ARGV...` for every port: one error line, the same for all."""
    messages = {
        assert_one_error_line(*run_cli(capsys, "generate", "--framework", framework, "--mode", "cached", *argv))
        for framework in PORTS
    }
    assert len(messages) == 1, messages
    return messages.pop()


# --- files: what the one safetensors reader refuses -----------------------------------


def seed_tensors() -> dict[str, np.ndarray]:
    return load_file(str(DEFAULT_WEIGHTS))


def weights_file(path: Path, tensors=None, config_json=None, metadata=None) -> Path:
    """The seed's tensors (or these), with the seed's config (or this JSON, or this metadata)."""
    config = {"config": config_json if config_json is not None else ModelConfig().to_json()}
    save_file(
        seed_tensors() if tensors is None else tensors, str(path), metadata=config if metadata is None else metadata
    )
    return path


def raw_file(path: Path, header: dict | bytes, data: bytes = b"", size: int | None = None) -> Path:
    """A safetensors file written byte by byte (`header` as JSON, or as given); `size`: the
    data's length, the rest left as a hole, so a file of gigabytes takes no disk."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(raw)) + raw + data)
        if size is not None:
            handle.truncate(8 + len(raw) + size)
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


# --- Hugging Face directories: the same reader, and the config's numbers ----------------


def llama_dir(tmp_path: Path, **config_changes) -> Path:
    config = llama_config(**config_changes)
    return write_hf_dir(tmp_path / "llama", config, llama_tensors(llama_config()))


def with_raw_checkpoint(edit_header):
    """The small Llama, its model.safetensors rewritten by hand with edit_header(header)."""

    def build(tmp_path: Path) -> Path:
        directory = llama_dir(tmp_path)
        tensors = load_file(str(directory / "model.safetensors"))
        header, offset, data = {}, 0, b""
        for name, array in tensors.items():
            header[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
            offset, data = offset + array.nbytes, data + array.tobytes()
        edit_header(header)
        raw_file(directory / "model.safetensors", header, data)
        return directory

    return build


def with_files(**files: bytes):
    def build(tmp_path: Path) -> Path:
        directory = llama_dir(tmp_path)
        for name, content in files.items():
            (directory / name.replace("__", ".")).write_bytes(content)
        return directory

    return build


def with_tensors(edit):
    def build(tmp_path: Path) -> Path:
        directory = llama_dir(tmp_path)
        tensors = load_file(str(directory / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return directory

    return build


def with_huge_tensor(name: str, shape: list[int]):
    """A checkpoint whose header names a 4 GiB tensor (a hole on disk)."""

    def build(tmp_path: Path) -> Path:
        directory = llama_dir(tmp_path)
        tensors = load_file(str(directory / "model.safetensors"))
        header, offset, data = {}, 0, b""
        for key, array in tensors.items():
            if key != name:
                header[key] = {
                    "dtype": "F32",
                    "shape": list(array.shape),
                    "data_offsets": [offset, offset + array.nbytes],
                }
                offset, data = offset + array.nbytes, data + array.tobytes()
        size = int(np.prod(shape)) * 4
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        raw_file(directory / "model.safetensors", header, data, size=offset + size)
        return directory

    return build


def negative_first_offset(header: dict) -> None:
    header[sorted(header)[0]]["data_offsets"][0] = -16


def overlapping_second_offset(header: dict) -> None:
    header[sorted(header)[1]]["data_offsets"][0] -= 4  # the first tensor's last float, read twice


def stray_bytes(tmp_path: Path) -> Path:
    directory = llama_dir(tmp_path)
    with open(directory / "model.safetensors", "ab") as handle:
        handle.write(b"\0" * 8)
    return directory


HF_REFUSALS = {
    "negative_offsets": (with_raw_checkpoint(negative_first_offset), "expected usize"),
    "overlapping_offsets": (with_raw_checkpoint(overlapping_second_offset), "overlapping"),
    "stray_bytes": (stray_bytes, "bytes past its last tensor"),
    "name_too_long": (lambda p: p / ("d" * 300), "(File name too long)"),
    "nested_config": (with_files(config__json=b"[" * 100_000), "nested too deeply"),
    "nested_index": (with_files(model__safetensors__index__json=b"[" * 100_000), "nested too deeply"),
    "index_not_object": (with_files(model__safetensors__index__json=b"[1]"), "is not a safetensors index"),
    "infinite_rms_norm_eps": (
        lambda p: llama_dir(p, rms_norm_eps=float("inf")),
        "rms_norm_eps=Infinity: must be a finite",
    ),
    "infinite_rope_theta": (
        lambda p: llama_dir(p, rope_parameters={"rope_theta": float("inf"), "rope_type": "default"}),
        "rope_theta=Infinity: must be a finite number > 0",
    ),
    "huge_num_hidden_layers": (
        lambda p: llama_dir(p, num_hidden_layers=MAX_SIZE),
        "missing tensor 'model.layers.2.input_layernorm.weight'",
    ),
    "huge_misshapen_tensor": (
        with_huge_tensor("model.layers.0.self_attn.q_proj.weight", [GIB // 1024, 1024]),
        "'model.layers.0.self_attn.q_proj.weight' has shape [1048576, 1024], the config needs [16, 16]",
    ),
    "huge_unexpected_tensor": (with_huge_tensor("model.extra", [GIB // 1024, 1024]), "unexpected tensor 'model.extra'"),
}


@pytest.mark.parametrize("case", sorted(HF_REFUSALS))
def test_a_bad_hugging_face_directory_is_refused_unread(tmp_path, capsys, no_tensor_may_be_read, case):
    build, expected = HF_REFUSALS[case]
    directory = build(tmp_path)
    err = assert_one_error_line(
        *run_cli(capsys, "convert", "--from-hf", directory, "--out", tmp_path / "m.safetensors")
    )
    assert expected in err
    assert not (tmp_path / "m.safetensors").exists()


def test_a_float64_checkpoint_past_float32_is_refused_at_dtype_float32(tmp_path, capsys):
    def past_float32(tensors):
        tensors.update({name: array.astype(np.float64) for name, array in tensors.items()})
        tensors["model.norm.weight"][0] = 1e39

    directory = with_tensors(past_float32)(tmp_path)
    argv = ("convert", "--from-hf", directory, "--out", tmp_path / "m.safetensors", "--dtype", "float32")
    assert "'model.norm.weight' holds 1e+39, beyond float32's range" in assert_one_error_line(*run_cli(capsys, *argv))


def test_to_hf_refuses_weights_past_the_dtype_it_writes(tmp_path, capsys):
    path = DATA_REFUSALS["float64_past_float32"][0](tmp_path / "w.safetensors")
    argv = ("convert", "--to-hf", path, "--out", tmp_path / "gpt2", "--dtype", "float32")
    assert "beyond float32's range" in assert_one_error_line(*run_cli(capsys, *argv))
    assert not (tmp_path / "gpt2").exists()


# --- prompts --------------------------------------------------------------------------

PROMPT_CASES = {
    "id_too_large": (["--prompt", "1,500,3"], "token id 500 in prompt 0 is outside [0, 500)"),
    "negative_id": (["--prompt", "1,-1,3"], "token id -1 in prompt 0 is outside [0, 500)"),
    "non_integer": (["--prompt", "1,2.5,3"], "prompt token '2.5' is not an integer"),
    "word": (["--prompt", "hello"], "prompt token 'hello' is not an integer"),
    "underscore": (["--prompt", "1_0"], "prompt token '1_0' is not an integer"),
    "arabic_indic_digits": (["--prompt", "\u0661\u0662"], "is not an integer"),
    "fullwidth_digits": (["--prompt", "\uff11\uff12"], "is not an integer"),
    "thousands_of_digits": (["--prompt", "9" * 5000], "has 5000 digits: no token id is that long"),
    "empty": (["--prompt", ""], "empty prompt"),
    "stray_comma": (["--prompt", "1,,2"], "empty token id"),
    "zero_new_tokens": (["--new-tokens", "0"], "error: --new-tokens 0 is below 1"),
    "negative_new_tokens": (["--new-tokens", "-3"], "error: --new-tokens -3 is below 1"),
    "new_tokens_with_underscore": (["--new-tokens", "1_0"], "invalid int value: '1_0'"),
    "fullwidth_temperature": (["--temperature", "\uff11"], "invalid number"),
    "infinite_temperature": (["--temperature", "inf"], "temperature inf must be a finite number >= 0"),
    "too_long": (
        ["--prompt", "1,2,3", "--new-tokens", "510"],
        "prompt length 3 + new tokens 510 = 513 exceeds max_seq_len 512",
    ),
}


@pytest.mark.parametrize("case", sorted(PROMPT_CASES))
def test_bad_prompt_is_the_same_error_for_every_framework(capsys, no_port_may_load, case):
    extra, expected = PROMPT_CASES[case]
    messages = set()
    for framework in PORTS:
        for mode in ("naive", "cached"):
            err = assert_one_error_line(*run_cli(capsys, "generate", "--framework", framework, "--mode", mode, *extra))
            assert expected in err, err
            messages.add(err)
    assert len(messages) == 1


@pytest.mark.parametrize("case", sorted(PROMPT_CASES))
def test_bad_prompt_is_refused_by_compare_too(capsys, no_port_may_load, case):
    extra, expected = PROMPT_CASES[case]
    assert expected in assert_one_error_line(*run_cli(capsys, "compare", *extra))


def test_a_refused_value_is_echoed_short(capsys, no_port_may_load):
    err = refusals_in_every_framework(capsys, "--prompt", "1," + "9" * 5000)
    assert len(err) < 200


# --- sizes: bounded before anything is allocated ----------------------------------------

# A Llama-shaped model whose config allows a million positions: nothing but the byte limit
# bounds a run's length.
LONG = ModelConfig(
    vocab_size=500,
    d_model=64,
    n_heads=4,
    n_layers=2,
    max_seq_len=2**20,
    positions="rope",
    norm="rmsnorm",
    activation="swiglu",
    attn_bias=False,
    ffn_bias=False,
)


@pytest.fixture
def long_model(tmp_path):
    path = tmp_path / "long.safetensors"
    save_weights(path, gpt2_init_weights(LONG), LONG)
    return path


SIZE_CASES = {
    "naive_million_tokens": (
        {},
        ["--mode", "naive", "--new-tokens", "1000000"],
        "would allocate at least 14.6 TiB",
    ),
    "cached_past_the_limit": (
        {"KVPORTS_MAX_BYTES": "1M"},
        ["--mode", "cached", "--new-tokens", "100000"],
        "above the limit of 1.0 MiB (KVPORTS_MAX_BYTES=1M)",
    ),
    "limit_not_a_number": (
        {"KVPORTS_MAX_BYTES": "lots"},
        ["--mode", "cached", "--new-tokens", "5"],
        "KVPORTS_MAX_BYTES='lots' is not a number of bytes",
    ),
    "past_max_seq_len": (
        {},
        ["--mode", "cached", "--new-tokens", str(2**20)],
        "exceeds max_seq_len 1048576",
    ),
}


@pytest.mark.parametrize("case", sorted(SIZE_CASES))
def test_a_run_too_large_is_refused_before_anything_is_read(
    long_model, capsys, monkeypatch, no_port_may_load, no_tensor_may_be_read, case
):
    environment, argv, expected = SIZE_CASES[case]
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    messages = set()
    for framework in PORTS:
        code, out, err = run_cli(capsys, "generate", "--framework", framework, "--weights", long_model, *argv)
        messages.add(assert_one_error_line(code, out, err))
    assert len(messages) == 1 and expected in messages.pop()


BENCH_CASES = {
    "prompt_len_past_max_seq_len": (["--prompt-len", "1000000000"], "prompt length 1000000000 + new tokens 100"),
    "batch_past_the_limit": (["--batch", "100000000"], "would allocate at least"),
    "batch_past_bound": (["--batch", str(2**31)], f"--batch 2147483648 is above {MAX_SIZE}"),
    "batch_with_underscore": (["--batch", "1_0"], "invalid int value: '1_0'"),
    "sweep_with_underscore": (["--sweep", "1_0"], "--sweep value '1_0' is not an integer"),
}


@pytest.mark.parametrize("case", sorted(BENCH_CASES))
def test_a_bench_too_large_is_refused_before_anything_is_read(capsys, no_port_may_load, no_tensor_may_be_read, case):
    argv, expected = BENCH_CASES[case]
    assert expected in assert_one_error_line(*run_cli(capsys, "bench", *argv))


INIT_CASES = {
    "seed_past_64_bits": (["--seed", str(2**64)], "error: --seed 18446744073709551616 is above 18446744073709551615\n"),
    "negative_seed": (["--seed", "-1"], "error: --seed -1 is below 0\n"),
    "zero_layers": (["--n-layers", "0"], "error: --n-layers 0 is below 1\n"),
    "layers_past_bound": (["--n-layers", str(2**31)], f"n_layers=2147483648 must be an integer in [1, {MAX_SIZE}]"),
    "sizes_past_the_limit": (["--vocab-size", str(MAX_SIZE), "--d-model", "65536"], "would allocate at least"),
}


@pytest.mark.parametrize("case", sorted(INIT_CASES))
def test_init_weights_refuses_a_bad_size_or_seed_before_initialising(tmp_path, capsys, no_port_may_load, case):
    argv, expected = INIT_CASES[case]
    err = assert_one_error_line(*run_cli(capsys, "init-weights", "--out", tmp_path / "w.safetensors", *argv))
    assert expected in err


def test_the_integer_types_accept_their_whole_range():
    assert (positive_int("1"), non_negative_int("0"), non_negative_int("7")) == (1, 0, 7)


# --- output paths -----------------------------------------------------------------------


def dangling_link(tmp_path: Path) -> Path:
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    return tmp_path / "link"


def existing_file(tmp_path: Path) -> Path:
    (tmp_path / "file").write_text("mine")
    return tmp_path / "file"


def folder_with_notes(tmp_path: Path) -> Path:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    return tmp_path / "out"


OUTPUT_CASES = {
    "dangling_symlink_without_force": (
        ["init-weights"],
        dangling_link,
        [],
        "exists; pass --force to overwrite it",
    ),
    "trailing_separator": (["init-weights"], lambda p: f"{p}/newfile/", [], "ends with '/', so it names a folder"),
    "folder_with_force": (["init-weights"], lambda p: p, ["--force"], "is a folder; --out names the file to write"),
    "name_too_long": (["init-weights"], lambda p: p / ("w" * 300), [], "(File name too long)"),
    "name_too_long_for_its_temp_file": (["init-weights"], lambda p: p / ("w" * 250), [], "is too long"),
    "missing_folder": (["init-weights"], lambda p: p / "no" / "w.safetensors", [], "does not exist"),
    "from_hf_over_a_file": (
        ["convert", "--from-hf", "."],
        existing_file,
        [],
        "exists; pass --force",
    ),
    "to_hf_into_a_folder_of_other_files": (
        ["convert", "--to-hf", str(DEFAULT_WEIGHTS)],
        folder_with_notes,
        ["--force"],
        "holds 'notes.txt', which kvports did not write",
    ),
    "to_hf_onto_a_file": (
        ["convert", "--to-hf", str(DEFAULT_WEIGHTS)],
        existing_file,
        [],
        "is a file",
    ),
}


@pytest.mark.parametrize("case", sorted(OUTPUT_CASES))
def test_a_bad_output_path_is_refused_before_any_work(tmp_path, capsys, no_port_may_load, no_tensor_may_be_read, case):
    command, out, extra, expected = OUTPUT_CASES[case]
    target = out(tmp_path)
    before = sorted(os.listdir(tmp_path))
    err = assert_one_error_line(*run_cli(capsys, *command, "--out", target, *extra))
    assert expected in err
    assert sorted(os.listdir(tmp_path)) == before  # nothing written, nothing replaced


# --- whole files and whole folders ----------------------------------------------------


@pytest.mark.parametrize("writer", ["write_atomic", "write_folder_atomic"])
def test_sigterm_during_a_write_leaves_no_temp_file(tmp_path, writer):
    """Killed with SIGTERM mid-write, as Ctrl-C would: exit 143, the old output intact, no temp."""
    target = tmp_path / "out"
    if writer == "write_atomic":
        target.write_bytes(b"old")
    else:
        target.mkdir()
        (target / "config.json").write_bytes(b"old")
    script = f"""
import os, signal
from kvports.shared import files
def killed(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
files.write_synced = killed
payload = {{"config.json": b"new"}} if {writer!r} == "write_folder_atomic" else b"new"
files.{writer}({str(target)!r}, payload)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert result.returncode == 143, result.stderr
    assert sorted(os.listdir(tmp_path)) == ["out"]
    assert (target if writer == "write_atomic" else target / "config.json").read_bytes() == b"old"


def test_to_hf_replaces_the_whole_folder_or_nothing(tmp_path, capsys, monkeypatch):
    """Killed between the two files, --to-hf --force leaves the old model whole: never new
    weights beside an old config."""
    from kvports.shared import files

    out = tmp_path / "gpt2"
    assert run_cli(capsys, "convert", "--to-hf", DEFAULT_WEIGHTS, "--out", out)[0] == 0
    old = {name: (out / name).read_bytes() for name in ("config.json", "model.safetensors")}
    other = tmp_path / "other.safetensors"
    save_weights(other, {k: v * 2 for k, v in seed_tensors().items()}, ModelConfig())
    written = []
    real = files.write_synced

    def interrupted_at_the_second_file(path, payload, fd=None):
        written.append(path)
        if len(written) == 2:
            raise KeyboardInterrupt
        real(path, payload, fd)

    monkeypatch.setattr(files, "write_synced", interrupted_at_the_second_file)
    code, _, err = run_cli(capsys, "convert", "--to-hf", other, "--out", out, "--force")
    assert (code, err) == (130, "error: interrupted\n")
    assert {name: (out / name).read_bytes() for name in old} == old
    assert sorted(os.listdir(tmp_path)) == ["gpt2", "other.safetensors"]


# --- the command line: one line, every time --------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--framework", "tensorflow", "--mode", "cached"],
        ["generate", "--framework", "torch", "--mode", "fast"],
        ["generate", "--framework", "torch", "--mode", "cached", "--new-tokens", "ten"],
        ["generate", "--framework", "torch", "--mode", "cached", "--dtype", "float16"],
        ["generate", "--mode", "cached"],
        ["frobnicate"],
    ],
)
def test_a_malformed_command_line_is_one_error_line_pointing_to_help(capsys, argv):
    err = assert_one_error_line(*run_cli(capsys, *argv))
    assert err.rstrip().endswith("--help)")


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["init-weights", "--out", "x.safetensors", "--n-layers", "0"], "error: --n-layers 0 is below 1\n"),
        (["compare", "--new-tokens", "0"], "error: --new-tokens 0 is below 1\n"),
    ],
)
def test_an_integer_outside_its_types_range_is_one_error_line(capsys, no_port_may_load, argv, expected):
    assert assert_one_error_line(*run_cli(capsys, *argv)) == expected


@pytest.fixture
def seed_tokenizer(tmp_path):
    """A word-level tokenizer.json: word w{i} is id i, for the first `size` ids."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    def make(size: int) -> Path:
        tokenizer = tokenizers.Tokenizer(WordLevel({f"w{i}": i for i in range(size)}, unk_token="w0"))
        tokenizer.pre_tokenizer = Whitespace()
        folder = tmp_path / f"tokenizer{size}"
        folder.mkdir()
        tokenizer.save(str(folder / "tokenizer.json"))
        return folder

    return make


def test_a_tokenizer_smaller_than_the_vocabulary_is_refused(capsys, no_port_may_load, seed_tokenizer):
    err = refusals_in_every_framework(capsys, "--tokenizer", seed_tokenizer(10), "--text", "w1 w2")
    assert "the tokenizer has no token for id 10 (it knows 10 of the model's vocab_size 500)" in err


def test_text_that_is_not_utf8_is_refused(capsys, no_port_may_load, seed_tokenizer):
    not_utf8 = b"w1 \xff".decode("utf-8", "surrogateescape")  # what Python makes of such bytes in argv
    err = refusals_in_every_framework(capsys, "--tokenizer", seed_tokenizer(500), "--text", not_utf8)
    assert "is not valid UTF-8" in err


def test_numpy_and_jax_warnings_never_reach_stderr(port, tmp_path, capsys):
    """Weights large enough to overflow float32 activations: NumPy and JAX would warn, torch is
    silent; the overflow itself is the one line every port prints."""
    path = tmp_path / "big.safetensors"
    save_weights(path, {k: v * np.float32(1e18) for k, v in seed_tensors().items()}, ModelConfig())
    code, out, err = run_cli(
        capsys,
        "generate",
        "--framework",
        port.NAME,
        "--mode",
        "naive",
        "--weights",
        path,
        "--new-tokens",
        "2",
        "--json",
    )
    assert err == (
        "error: step 0 produced a non-finite logit (row 0): the forward pass overflowed at float32; "
        "try --dtype float64\n"
    )  # no warning before it
    assert_one_error_line(code, out, err)


def test_console_script_prints_no_traceback():
    argv = "generate --framework numpy --mode naive --prompt 1,2,999".split()
    command = [sys.executable, "-m", "kvports.cli", *argv]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == "error: token id 999 in prompt 0 is outside [0, 500) (vocab_size 500)\n"


def test_a_user_error_is_one_line_however_it_was_made():
    assert str(UserError("a\nb\r\n  c")) == "a b c"


# --- valid after all: a wide sliding window ---------------------------------------------


@pytest.mark.parametrize("window", [2**31, 2**40, 2**63 - 1])
@pytest.mark.parametrize("mode", ["naive", "cached"])
def test_a_window_wider_than_int32_gives_the_tokens_of_no_window(port, mode, window):
    """JAX computes the mask in int32, where query - window wraps past 2**31: a window wider
    than max_seq_len hides nothing, so the tokens are those of the same model without one."""
    config = dataclasses.replace(LONG, max_seq_len=64)
    tensors = {name: array * (20 if array.ndim == 2 else 1) for name, array in gpt2_init_weights(config).items()}
    prompts = np.array([[3, 1, 4, 1, 5]], dtype=np.int64)
    reference = port_or_skip("torch")
    expected, _ = reference.generate(reference.load_model(config, tensors), prompts, 20, "cached")
    assert len(set(expected[0, 5:].tolist())) > 1  # tokens that would show a wrong mask
    windowed = dataclasses.replace(config, sliding_window=window).validate()
    tokens, _ = port.generate(port.load_model(windowed, tensors), prompts, 20, mode)
    np.testing.assert_array_equal(tokens, expected)
