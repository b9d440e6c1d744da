"""The command line's contracts: generate --json, compare, init-weights."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from kvports import registry
from kvports.formats.weights import DEFAULT_WEIGHTS, load_weights
from tests.helpers.commands import assert_one_error_line, run_cli
from tests.helpers.models import GOLDEN
from tests.helpers.ports import hide_port, port_or_skip


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("mode", ["naive", "cached"])
@pytest.mark.parametrize("framework", registry.PORTS)
def test_generate_json_is_one_object_with_the_contract_fields(capsys, framework, mode, dtype):
    port_or_skip(framework)
    code, out, _ = run_cli(
        capsys,
        "generate",
        "--framework",
        framework,
        "--mode",
        mode,
        "--dtype",
        dtype,
        "--json",
        "--prompt",
        "160,248,104,209,394",
        "--prompt",
        "1,2,3,4,5",
        "--new-tokens",
        "6",
    )
    assert code == 0
    result = json.loads(out)
    assert {"framework", "mode", "dtype", "tokens", "seconds"} <= set(result)
    assert (result["framework"], result["mode"], result["dtype"]) == (framework, mode, dtype)
    assert result["seconds"] > 0
    assert [len(row) for row in result["tokens"]] == [11, 11]
    assert result["tokens"][0] == [160, 248, 104, 209, 394] + GOLDEN[:6]
    assert result["tokens"][1][:5] == [1, 2, 3, 4, 5]


def test_generate_defaults_are_the_seed_prompt_and_100_tokens(capsys):
    port_or_skip("numpy")
    code, out, _ = run_cli(capsys, "generate", "--framework", "numpy", "--mode", "cached", "--json")
    assert code == 0 and json.loads(out)["tokens"] == [[160, 248, 104, 209, 394] + GOLDEN]


def test_generate_without_json_lists_prompt_and_tokens(capsys):
    port_or_skip("torch")
    code, out, _ = run_cli(capsys, "generate", "--framework", "torch", "--mode", "naive", "--new-tokens", "3")
    assert code == 0 and "160 248 104 209 394" in out and "315 391 221" in out


def test_generate_with_an_uninstalled_framework_is_an_error(capsys, monkeypatch):
    def unavailable(name):
        raise registry.PortUnavailable(name, "No module named 'jax'")

    monkeypatch.setattr(registry, "load_port", unavailable)
    err = assert_one_error_line(*run_cli(capsys, "generate", "--framework", "jax", "--mode", "cached"))
    assert err == "error: framework 'jax' is not available (No module named 'jax')\n"


def test_compare_skips_an_uninstalled_framework_and_still_agrees(capsys, monkeypatch):
    real = registry.available_port
    monkeypatch.setattr(registry, "available_port", lambda name: None if name == "jax" else real(name))
    code, out, _ = run_cli(capsys, "compare", "--json", "--new-tokens", "10")
    result = json.loads(out)
    assert code == 0 and result["ok"]
    assert [row["available"] for row in result["rows"] if row["framework"] == "jax"] == [False, False]


def test_compare_without_torch_takes_the_first_installed_port_as_reference(capsys, monkeypatch):
    real = registry.available_port
    monkeypatch.setattr(registry, "available_port", lambda name: real(name) if name == "numpy" else None)
    code, out, _ = run_cli(capsys, "compare", "--json", "--new-tokens", "5")
    result = json.loads(out)
    assert code == 0 and result["ok"] and result["reference"] == "numpy naive"
    assert [(row["framework"], row["available"]) for row in result["rows"]] == [
        ("numpy", True),
        ("numpy", True),
        ("torch", False),
        ("torch", False),
        ("jax", False),
        ("jax", False),
    ]


def test_compare_table_says_not_installed(capsys, monkeypatch):
    real = registry.available_port
    monkeypatch.setattr(registry, "available_port", lambda name: real(name) if name == "numpy" else None)
    code, out, _ = run_cli(capsys, "compare", "--new-tokens", "5")
    assert code == 0 and "reference: numpy naive" in " ".join(out.split())  # the title wraps
    assert re.findall(r"(\w+)\W+(naive|cached)\W+not installed", out) == [
        ("torch", "naive"),
        ("torch", "cached"),
        ("jax", "naive"),
        ("jax", "cached"),
    ]


def test_compare_reports_every_path_agreeing_on_the_golden_tokens(capsys):
    for name in registry.PORTS:
        port_or_skip(name)
    # 20 tokens, not the demo's 100: every port's 100 golden tokens are test_generation's.
    code, out, _ = run_cli(capsys, "compare", "--json", "--new-tokens", "20")
    result = json.loads(out)
    assert code == 0 and result["ok"]
    assert result["tokens"] == [[160, 248, 104, 209, 394] + GOLDEN[:20]]
    assert len(result["rows"]) == 6 and all(row["agree"] for row in result["rows"])
    assert all(row["cached_speedup"] > 0 for row in result["rows"] if row["mode"] == "cached")


def test_compare_exits_1_when_a_path_disagrees(capsys, monkeypatch):
    torch_port = port_or_skip("torch")

    class Broken:
        NAME = "numpy"

        def __getattr__(self, name):
            return getattr(torch_port, name)

        @staticmethod
        def generate(model, prompts, new_tokens, mode, return_logits=False, *, on_token=None):
            tokens, logits = torch_port.generate(model, prompts, new_tokens, mode, return_logits, on_token=on_token)
            tokens = tokens.copy()
            tokens[:, -1] = (tokens[:, -1] + 1) % 500  # a real bug: the last token is wrong
            return tokens, logits

    real = registry.available_port
    monkeypatch.setattr(
        registry,
        "available_port",
        lambda name: Broken() if name == "numpy" else (None if name == "jax" else real(name)),
    )
    code, out, _ = run_cli(capsys, "compare", "--json", "--new-tokens", "10")
    result = json.loads(out)
    assert code == 1 and not result["ok"]
    broken = [row for row in result["rows"] if row["framework"] == "numpy"]
    assert all(row["first_divergent_step"] == 9 and not row["explained"] for row in broken)


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


def test_version_prints_the_package_version(capsys):
    import kvports

    with pytest.raises(SystemExit) as exit_info:
        run_cli(capsys, "--version")
    assert exit_info.value.code == 0 and capsys.readouterr().out == f"kvports {kvports.__version__}\n"


def test_a_reader_that_closes_the_pipe_ends_the_command_quietly():
    # `kvports generate --stream ... | head -1`: the reader leaves after one line; the writer
    # must stop without a traceback.
    command = [sys.executable, "-m", "kvports.cli", "generate", "--framework", "numpy", "--mode", "cached"]
    process = subprocess.Popen(
        [*command, "--stream", "--new-tokens", "400"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert process.stdout.readline().startswith(b"  step")
    process.stdout.close()
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=120) == 141 and stderr == ""


def test_generate_checks_each_input_once(capsys, monkeypatch, tmp_path):
    from kvports import run, validation
    from kvports.formats.weights import save_weights
    from kvports.shared.config import ModelConfig
    from tests.helpers.models import random_weights

    draft = tmp_path / "draft.safetensors"
    config = ModelConfig(d_model=16, n_heads=2, n_layers=1)
    save_weights(draft, random_weights(config), config)
    names = ("check_prompts", "check_generation", "check_draft", "check_draft_model", "check_needed", "check_run")
    calls = dict.fromkeys(names, 0)
    for name in names:
        module = validation if name == "check_draft_model" else run  # the draft's vocabulary: a rule
        real = getattr(module, name)

        def counted(*args, real=real, name=name):
            calls[name] += 1
            return real(*args)

        monkeypatch.setattr(module, name, counted)
    argv = ["generate", "--framework", "numpy", "--mode", "speculative", "--draft", draft, "--new-tokens", "3"]
    code, _, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert calls == dict.fromkeys(names, 1)


@pytest.mark.parametrize("command", ["generate", "compare", "bench", "batch"])
def test_every_run_command_takes_tensor_parallel_and_refuses_zero_in_one_line(capsys, no_port_may_load, command):
    err = assert_one_error_line(*run_cli(capsys, command, "--tensor-parallel", "0"))
    assert err == "error: --tensor-parallel 0 is below 1\n"


def test_tensor_parallel_one_is_todays_generate(capsys):
    argv = ["generate", "--framework", "numpy", "--mode", "cached", "--new-tokens", "8", "--json"]
    code, out, _ = run_cli(capsys, *argv, "--tensor-parallel", "1")
    output = json.loads(out)
    assert (code, output["tensor_parallel"], output["tokens"][0][5:]) == (0, 1, GOLDEN[:8])
