"""`kvports init-weights`: seed 0 is the shipped seed model bit for bit, any config and dtype,
never over an existing file without --force, NumPy's initialisation without torch, an
impossible config refused. (Bad sizes and seeds: tests/bad_input/test_sizes.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from kvports.formats.weights import DEFAULT_WEIGHTS, load_weights
from tests.helpers.commands import assert_one_error_line, run_cli
from tests.helpers.ports import hide_port, port_or_skip


def test_init_weights_seed_0_reproduces_the_shipped_seed_model_bit_for_bit(tmp_path, capsys):
    port_or_skip("torch")
    out_file = tmp_path / "seed.safetensors"
    code, _, _ = run_cli(capsys, "init-weights", "--out", str(out_file), "--seed", "0")
    assert code == 0
    shipped_config, shipped = load_weights(DEFAULT_WEIGHTS)
    config, tensors = load_weights(out_file)
    assert config == shipped_config and list(tensors) == list(shipped)
    for name in shipped:
        assert tensors[name].tobytes() == shipped[name].tobytes(), name


def test_init_weights_writes_any_config_and_dtype(tmp_path, capsys):
    port_or_skip("torch")
    out_file = tmp_path / "small.safetensors"
    code, out, _ = run_cli(
        capsys,
        "init-weights",
        "--out",
        out_file,
        "--seed",
        "3",
        "--vocab-size",
        "50",
        "--d-model",
        "32",
        "--n-heads",
        "2",
        "--n-layers",
        "3",
        "--max-seq-len",
        "64",
        "--dtype",
        "float64",
    )
    config, tensors = load_weights(out_file)
    assert code == 0 and "wrote" in out
    assert (config.vocab_size, config.d_model, config.n_heads, config.n_layers, config.max_seq_len) == (
        50,
        32,
        2,
        3,
        64,
    )
    assert all(array.dtype == np.float64 for array in tensors.values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.safetensors"]  # no temp file left behind


def test_init_weights_refuses_to_overwrite_without_force(tmp_path, capsys):
    port_or_skip("torch")
    out_file = tmp_path / "taken.safetensors"
    out_file.write_bytes(b"precious")
    err = assert_one_error_line(*run_cli(capsys, "init-weights", "--out", out_file))
    assert "exists; pass --force" in err
    assert out_file.read_bytes() == b"precious"
    code, _, _ = run_cli(capsys, "init-weights", "--out", str(out_file), "--force")
    assert code == 0 and load_weights(out_file)[0].d_model == 128


@pytest.fixture
def no_torch(monkeypatch):
    hide_port(monkeypatch, "torch", "No module named 'torch'")


def test_init_weights_with_numpy_init_needs_no_torch(tmp_path, capsys, no_torch):
    out_file = tmp_path / "numpy.safetensors"
    code, out, _ = run_cli(capsys, "init-weights", "--out", out_file, "--init", "numpy", "--seed", "1")
    config, tensors = load_weights(out_file)
    assert code == 0 and "numpy initialisation" in out and config == load_weights()[0]
    assert 0.015 < float(tensors["blocks.0.qkv.weight"].std()) < 0.025  # GPT-2's N(0, 0.02)


def test_init_weights_without_torch_says_how_to_do_without_it(tmp_path, capsys, no_torch):
    err = assert_one_error_line(*run_cli(capsys, "init-weights", "--out", tmp_path / "x.safetensors"))
    assert "needs torch" in err and "--init numpy" in err
    assert list(tmp_path.iterdir()) == []


def test_init_weights_refuses_an_impossible_config(tmp_path, capsys):
    err = assert_one_error_line(
        *run_cli(capsys, "init-weights", "--out", tmp_path / "x.safetensors", "--d-model", "130", "--n-heads", "4")
    )
    assert "d_model=130 is not divisible by n_heads=4" in err
    assert list(tmp_path.iterdir()) == []
