"""The weights file: round trips, dtypes, atomic writes."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvports.formats.weights import load_weights, save_weights
from kvports.shared.config import ModelConfig
from kvports.shared.errors import UserError
from kvports.shared.shapes import expected_shapes


def test_expected_names_are_the_seed_state_dict_in_order():
    names = list(expected_shapes(ModelConfig()))
    assert names[:4] == ["emb.weight", "pos.weight", "blocks.0.ln1.weight", "blocks.0.ln1.bias"]
    assert names[-3:] == ["ln.weight", "ln.bias", "head.weight"]
    assert len(names) == 2 + 2 * 12 + 3


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_save_then_load_round_trips_exactly(tmp_path, seed_weights, dtype):
    config, tensors = seed_weights
    cast = {name: array.astype(dtype) for name, array in tensors.items()}
    save_weights(tmp_path / "w.safetensors", cast, config)
    loaded_config, loaded = load_weights(tmp_path / "w.safetensors")
    assert loaded_config == config
    for name in cast:
        assert loaded[name].dtype == np.dtype(dtype)
        np.testing.assert_array_equal(loaded[name], cast[name])


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path, seed_weights, monkeypatch):
    config, tensors = seed_weights
    target = tmp_path / "w.safetensors"
    target.write_bytes(b"old contents")

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(UserError, match=r"cannot write .*w\.safetensors' \(disk full\)"):
        save_weights(target, tensors, config)
    assert target.read_bytes() == b"old contents"
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]


def test_save_refuses_tensors_that_do_not_fit_the_config(tmp_path, seed_weights):
    config, tensors = seed_weights
    with pytest.raises(UserError, match="tensor 'emb.weight' has shape"):
        save_weights(tmp_path / "w.safetensors", tensors, ModelConfig(vocab_size=400))
    assert not (tmp_path / "w.safetensors").exists()


def test_absent_config_fields_take_the_seed_values():
    assert ModelConfig.from_json('{"d_model": 64}') == ModelConfig(d_model=64)
