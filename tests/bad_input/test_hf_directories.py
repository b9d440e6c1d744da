"""Hugging Face directories `kvports convert --from-hf` refuses: a checkpoint the safetensors
reader refuses, a config.json or index nested too deeply or too large to read, a config number
no port honours, a tensor past float32's range at --dtype float32. One `error:` line, no tensor
read past the header, nothing written."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from kvports.shared.config import MAX_SIZE
from tests.helpers.commands import assert_one_error_line, run_cli
from tests.helpers.hf_files import hf_dir
from tests.helpers.weights_files import GIB, MiB, raw_file, sparse


def with_raw_checkpoint(edit_header):
    """The small Llama, its model.safetensors rewritten by hand with edit_header(header)."""

    def build(tmp_path: Path) -> Path:
        directory = hf_dir(tmp_path)
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
        directory = hf_dir(tmp_path)
        for name, content in files.items():
            (directory / name.replace("__", ".")).write_bytes(content)
        return directory

    return build


def with_tensors(edit):
    def build(tmp_path: Path) -> Path:
        directory = hf_dir(tmp_path)
        tensors = load_file(str(directory / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return directory

    return build


def with_huge_tensor(name: str, shape: list[int]):
    """A checkpoint whose header names a 4 GiB tensor (a hole on disk)."""

    def build(tmp_path: Path) -> Path:
        directory = hf_dir(tmp_path)
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
    directory = hf_dir(tmp_path)
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
        lambda p: hf_dir(p, rms_norm_eps=float("inf")),
        "rms_norm_eps=Infinity: must be a finite",
    ),
    "infinite_rope_theta": (
        lambda p: hf_dir(p, rope_parameters={"rope_theta": float("inf"), "rope_type": "default"}),
        "rope_theta=Infinity: must be a finite number > 0",
    ),
    "huge_num_hidden_layers": (
        lambda p: hf_dir(p, num_hidden_layers=MAX_SIZE),
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


# --- every file read is bounded before it is read -------------------------------------------------


@pytest.mark.parametrize(
    "name, shown",
    [
        ("config.json", "config file 2.0 MiB, parsed config file 20.0 MiB"),
        ("model.safetensors.index.json", "safetensors index 2.0 MiB"),
    ],
)
def test_a_json_file_past_the_memory_limit_is_refused_unread(tmp_path, capsys, monkeypatch, name, shown):
    monkeypatch.setenv("KVPORTS_MAX_BYTES", "1M")
    directory = hf_dir(tmp_path)
    sparse(directory / name, 2 * MiB)
    err = assert_one_error_line(*run_cli(capsys, "convert", "--from-hf", directory, "--out", tmp_path / "w.st"))
    assert shown in err and "above the limit of 1.0 MiB" in err, err


def test_a_config_json_past_its_cap_is_refused_unread(tmp_path, capsys, monkeypatch):
    directory = hf_dir(tmp_path)
    sparse(directory / "config.json", 65 * MiB)

    def refuse(*args, **kwargs):
        raise AssertionError("config.json was read past its cap")

    monkeypatch.setattr(Path, "read_text", refuse)
    monkeypatch.setattr(Path, "read_bytes", refuse)
    err = assert_one_error_line(*run_cli(capsys, "convert", "--from-hf", directory, "--out", tmp_path / "w.st"))
    assert "config file" in err and "is 65.0 MiB, above the 64.0 MiB such a file may be" in err, err
