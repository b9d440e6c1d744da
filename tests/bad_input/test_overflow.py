"""Numbers that overflow: a temperature too small to divide by (on the command line and in a
request file), a config float past where the ports agree (at load and at convert), weights whose
activations overflow float32, a window wider than int32. Each is one `error:` line, the same in
every port; where the input is valid after all, the same tokens in every port."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from kvports.formats.weights import DEFAULT_WEIGHTS, gpt2_init_weights, save_weights
from kvports.shared.checks import MIN_TEMPERATURE
from kvports.shared.config import ModelConfig
from kvports.shared.generation import GenerationConfig
from tests.helpers.commands import (
    assert_one_error_line,
    batch,
    generate,
    refusals_in_every_framework,
    requests_file,
    run_cli,
)
from tests.helpers.hf_files import hf_dir
from tests.helpers.models import LONG
from tests.helpers.ports import port_or_skip
from tests.helpers.weights_files import seed_tensors

# --- temperatures ---------------------------------------------------------------------------------


TEMPERATURE_RULE = "must be a finite number >= 0 (0 means greedy; else in [1e-12, 1e+18]"


@pytest.mark.parametrize("temperature", ["1e-320", "1e-300", "1e-20", "9e-13"])
def test_a_temperature_too_small_for_exact_logits_is_refused(capsys, port, temperature):
    """Below 1.9e-270 logits / T is inf in float64 and every port drew token 0 forever; at 1e-20
    the seed's logits / T are past 2**53, and JAX alone drew token 0."""
    err = generate(capsys, port, "--temperature", temperature)
    assert err.startswith(f"error: temperature {float(temperature)!r} {TEMPERATURE_RULE}"), err


@pytest.mark.parametrize("temperature", ["-inf", "-1e-3", "-Infinity"])
def test_a_negative_temperature_is_named_not_taken_for_a_flag(capsys, port, temperature):
    err = generate(capsys, port, "--temperature", temperature)
    assert err.startswith(f"error: temperature {float(temperature)!r} {TEMPERATURE_RULE}"), err


def test_the_smallest_temperature_samples_the_greedy_tokens_in_every_port(port, seed_weights):
    """At the bound logits / T stay exact enough for JAX's softmax too: every port draws the argmax."""
    config, tensors = seed_weights
    model = port.load_model(config, tensors)
    prompts = np.array([[160, 248, 104, 209, 394]])
    greedy, _ = port.generate(model, prompts, 8, "cached")
    coldest = GenerationConfig(8, temperature=MIN_TEMPERATURE, seed=3).validate(config.vocab_size)
    sampled, _ = port.generate(model, prompts, coldest, "cached")
    np.testing.assert_array_equal(sampled, greedy)
    with pytest.raises(ValueError, match="must be a finite number >= 0"):
        GenerationConfig(8, temperature=float(np.nextafter(MIN_TEMPERATURE, 0))).validate(config.vocab_size)


@pytest.mark.parametrize("temperature", ["1e-320", "100000000000000000000", "-Infinity"])
def test_a_request_line_with_a_temperature_that_overflows_is_one_bad_line(tmp_path, capsys, port, temperature):
    """A whole-number temperature past int64 made torch and JAX raise where NumPy ran."""
    path = requests_file(tmp_path, f'{{"prompt": [1], "temperature": {temperature}}}')
    code, out, err = batch(capsys, port, "--requests", path)
    first, last = err.splitlines()
    assert first.startswith(f"error: line 1: temperature {json.loads(temperature)!r} {TEMPERATURE_RULE}"), first
    assert_one_error_line(code, out, last + "\n")


# --- a config's floats ----------------------------------------------------------------------------


def weights_with(tmp_path: Path, **changes) -> Path:
    """The seed's weights with these config fields, in its own file."""
    config = dataclasses.replace(ModelConfig(), **changes)
    path = tmp_path / "w.safetensors"
    save_file(load_file(str(DEFAULT_WEIGHTS)), str(path), metadata={"config": json.dumps(dataclasses.asdict(config))})
    return path


CONFIG_FLOATS = {
    # a float32 subnormal: XLA flushes it to zero, and an all-zero row normalises to NaN in JAX alone
    "subnormal_norm_eps": (dict(norm_eps=1e-40), "config field norm_eps=1e-40 is below 1e-12"),
    "tiny_norm_eps": (dict(norm_eps=1e-13), "config field norm_eps=1e-13 is below 1e-12"),
    # angles past the positions: JAX's sin and cos parted from torch's at 1e-30
    "rope_theta_below_one": (dict(rope_theta=1e-30), "config field rope_theta=1e-30 must be in [1, 1e+12]"),
    "rope_theta_past_the_top": (
        dict(rope_theta=1e13),
        "config field rope_theta=10000000000000.0 must be in [1, 1e+12]",
    ),
    # an integer no float holds raised OverflowError
    "integer_norm_eps_past_any_float": (dict(norm_eps=10**400), "config field norm_eps=inf must be a finite number"),
    "integer_rope_theta_past_any_float": (dict(rope_theta=10**400), "config field rope_theta=inf must be a finite"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_FLOATS))
def test_a_config_float_past_where_the_ports_agree_is_refused_at_load(tmp_path, capsys, port, case):
    changes, expected = CONFIG_FLOATS[case]
    err = generate(capsys, port, "--weights", weights_with(tmp_path, **changes))
    assert err.startswith(f"error: {expected}"), err


HF_FLOATS = {
    "subnormal_rms_norm_eps": (dict(rms_norm_eps=1e-40), "config field norm_eps=1e-40 is below 1e-12"),
    "rope_theta_below_one": (
        dict(rope_parameters={"rope_theta": 0.5, "rope_type": "default"}),
        "config field rope_theta=0.5 must be in [1, 1e+12]",
    ),
    "integer_rms_norm_eps_past_any_float": (dict(rms_norm_eps=10**400), "rms_norm_eps=100000000000000000"),
}


@pytest.mark.parametrize("case", sorted(HF_FLOATS))
def test_a_config_float_past_where_the_ports_agree_is_refused_at_convert(tmp_path, capsys, case):
    changes, expected = HF_FLOATS[case]
    out = tmp_path / "w.safetensors"
    err = assert_one_error_line(*run_cli(capsys, "convert", "--from-hf", hf_dir(tmp_path, **changes), "--out", out))
    assert expected in err and not out.exists(), err


@pytest.mark.parametrize(
    "changes",
    [
        dict(rms_norm_eps=1e-12),
        dict(rope_parameters={"rope_theta": 500000.0, "rope_type": "default"}),  # Llama 3
        dict(rope_parameters={"rope_theta": 3.6e9, "rope_type": "default"}),  # a long-context Llama 3
    ],
)
def test_published_config_floats_still_convert(tmp_path, capsys, changes):
    code, _, err = run_cli(capsys, "convert", "--from-hf", hf_dir(tmp_path, **changes), "--out", tmp_path / "w.st")
    assert (code, err) == (0, "")


# --- activations past float32, a window past int32 ------------------------------------------------


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


def test_an_embedding_whose_first_norm_overflows_is_the_same_line_in_every_port(capsys, tmp_path):
    """An embedding of 1e30: torch's LayerNorm made a NaN and stopped, NumPy's and JAX's made zeros
    and generated token 0 eight times with exit 0. The rule is the weights', before any port runs."""
    path = tmp_path / "big.safetensors"
    tensors = seed_tensors()
    save_weights(path, {**tensors, "emb.weight": tensors["emb.weight"] * np.float32(1e30)}, ModelConfig())
    err = refusals_in_every_framework(capsys, "--weights", path, "--new-tokens", "8")
    assert "tensor 'emb.weight' row" in err and "past float32's 3.4e+38: the first norm would overflow" in err
