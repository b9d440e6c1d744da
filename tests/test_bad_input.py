"""Every bad input: one `error:` line on stderr naming the value and the limit, exit 2,
nothing on stdout, the same message for every framework, caught before any port runs."""

from __future__ import annotations

import json
import pickle
import struct
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

from kvports.shared import cli, ports
from kvports.shared.commands.arguments import non_negative_int, positive_int
from kvports.shared.config import ModelConfig
from kvports.shared.ports import PORTS
from kvports.shared.weights import DEFAULT_WEIGHTS, load_weights
from tests.helpers import assert_one_error_line, run_cli


@pytest.fixture
def no_port_may_load(monkeypatch):
    """A bad input must be refused before any framework is imported or run."""

    def refuse(name):
        raise AssertionError(f"port {name} was loaded before the input was checked")

    monkeypatch.setattr(ports, "load_port", refuse)
    monkeypatch.setattr(ports, "available_port", refuse)


def seed_tensors():
    return load_weights()[1]


def write_file(path, tensors, config_json=None, metadata=None):
    meta = (
        {"config": config_json if config_json is not None else ModelConfig().to_json()}
        if metadata is None
        else metadata
    )
    save_file(tensors, str(path), metadata=meta)
    return path


def bad_weights(tmp_path, case):
    """Build one broken weights file; returns its path."""
    tensors = seed_tensors()
    path = tmp_path / f"{case}.safetensors"
    if case == "missing":
        return tmp_path / "absent.safetensors"
    if case == "empty":
        path.write_bytes(b"")
    elif case == "truncated":
        path.write_bytes(DEFAULT_WEIGHTS.read_bytes()[:100_000])
    elif case == "pickle":
        path.write_bytes(pickle.dumps({"emb.weight": [1.0, 2.0]}))
    elif case == "text":
        path.write_text("not a weights file at all\n")
    elif case == "missing_tensor":
        del tensors["blocks.1.proj.bias"]
        write_file(path, tensors)
    elif case == "extra_tensor":
        tensors["blocks.2.qkv.weight"] = np.zeros((384, 128), np.float32)
        write_file(path, tensors)
    elif case == "wrong_shape":
        tensors["blocks.0.qkv.weight"] = np.zeros((384, 127), np.float32)
        write_file(path, tensors)
    elif case == "non_finite":
        tensors["ln.weight"] = tensors["ln.weight"].copy()
        tensors["ln.weight"][3] = np.nan
        write_file(path, tensors)
    elif case == "float16":
        write_file(path, {name: array.astype(np.float16) for name, array in tensors.items()})
    elif case == "int_tensor":
        tensors["ln.bias"] = tensors["ln.bias"].astype(np.int32)
        write_file(path, tensors)
    elif case == "no_config":
        write_file(path, tensors, metadata={"format": "pt"})
    elif case == "config_not_json":
        write_file(path, tensors, config_json="{vocab_size: 500")
    elif case == "config_unknown_field":
        write_file(path, tensors, config_json=json.dumps({"vocab_size": 500, "n_expert": 8}))
    elif case == "config_bad_value":
        write_file(path, tensors, config_json=json.dumps({"n_heads": 0}))
    elif case == "config_contradicts_tensors":
        write_file(path, tensors, config_json=json.dumps({"d_model": 64}))
    elif case == "header_too_long":
        path.write_bytes(struct.pack("<Q", 10**9) + b"{}")
    else:
        raise ValueError(case)
    return path


WEIGHT_CASES = {
    "missing": "does not exist",
    "empty": "is empty",
    "truncated": "truncated",
    "pickle": "not a safetensors file",
    "text": "not a safetensors file",
    "missing_tensor": "missing tensor 'blocks.1.proj.bias'",
    "extra_tensor": "unexpected tensor 'blocks.2.qkv.weight'",
    "wrong_shape": "tensor 'blocks.0.qkv.weight' has shape [384, 127], the config needs [384, 128]",
    "non_finite": "tensor 'ln.weight' has non-finite values",
    "float16": "has dtype F16; supported: float32, float64",
    "int_tensor": "tensor 'ln.bias' has dtype I32",
    "no_config": "has no 'config' metadata",
    "config_not_json": "config metadata is not valid JSON",
    "config_unknown_field": "unknown field 'n_expert'",
    "config_bad_value": "n_heads=0 must be an integer >= 1",
    "config_contradicts_tensors": "tensor 'emb.weight' has shape [500, 128], the config needs [500, 64]",
    "header_too_long": "not a safetensors file",
}


@pytest.mark.parametrize("case", sorted(WEIGHT_CASES))
@pytest.mark.parametrize("framework", PORTS)
def test_bad_weights_file_is_one_error_line(tmp_path, capsys, no_port_may_load, case, framework):
    path = bad_weights(tmp_path, case)
    err = assert_one_error_line(
        *run_cli(capsys, "generate", "--framework", framework, "--mode", "cached", "--weights", path)
    )
    assert WEIGHT_CASES[case] in err


PROMPT_CASES = {
    "id_too_large": (["--prompt", "1,500,3"], "token id 500 in prompt 0 is outside [0, 500)"),
    "negative_id": (["--prompt", "1,-1,3"], "token id -1 in prompt 0 is outside [0, 500)"),
    "non_integer": (["--prompt", "1,2.5,3"], "prompt token '2.5' is not an integer"),
    "word": (["--prompt", "hello"], "prompt token 'hello' is not an integer"),
    "empty": (["--prompt", ""], "empty prompt"),
    "stray_comma": (["--prompt", "1,,2"], "empty token id"),
    "zero_new_tokens": (["--new-tokens", "0"], "error: --new-tokens 0 is below 1"),
    "negative_new_tokens": (["--new-tokens", "-3"], "error: --new-tokens -3 is below 1"),
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
def test_malformed_flags_get_argparse_usage_and_exit_2(capsys, argv):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.startswith("usage: kvports") and err.strip().splitlines()[-1].startswith("kvports")
    assert "error: " in err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["init-weights", "--out", "x.safetensors", "--n-layers", "0"], "error: --n-layers 0 is below 1\n"),
        (["init-weights", "--out", "x.safetensors", "--seed", "-1"], "error: --seed -1 is below 0\n"),
        (["compare", "--new-tokens", "0"], "error: --new-tokens 0 is below 1\n"),
    ],
)
def test_an_integer_outside_its_types_range_is_one_error_line(capsys, no_port_may_load, argv, expected):
    assert assert_one_error_line(*run_cli(capsys, *argv)) == expected


def test_the_integer_types_accept_their_whole_range():
    assert (positive_int("1"), non_negative_int("0"), non_negative_int("7")) == (1, 0, 7)


def test_console_script_prints_no_traceback():
    argv = "generate --framework numpy --mode naive --prompt 1,2,999".split()
    command = [sys.executable, "-m", "kvports.shared.cli", *argv]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == "error: token id 999 in prompt 0 is outside [0, 500) (vocab_size 500)\n"
