"""The command line's contracts: generate --json, compare, init-weights."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvports.shared import cli, ports
from kvports.shared.weights import DEFAULT_WEIGHTS, load_weights
from tests.conftest import GOLDEN, port_or_skip


def run_cli(argv, capsys):
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("mode", ["naive", "cached"])
@pytest.mark.parametrize("framework", ports.PORTS)
def test_generate_json_is_one_object_with_the_contract_fields(capsys, framework, mode, dtype):
    port_or_skip(framework)
    code, out, _ = run_cli(["generate", "--framework", framework, "--mode", mode, "--dtype", dtype, "--json",
                            "--prompt", "160,248,104,209,394", "--prompt", "1,2,3,4,5", "--new-tokens", "6"], capsys)
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
    code, out, _ = run_cli(["generate", "--framework", "numpy", "--mode", "cached", "--json"], capsys)
    assert code == 0 and json.loads(out)["tokens"] == [[160, 248, 104, 209, 394] + GOLDEN]


def test_generate_without_json_lists_prompt_and_tokens(capsys):
    port_or_skip("torch")
    code, out, _ = run_cli(["generate", "--framework", "torch", "--mode", "naive", "--new-tokens", "3"], capsys)
    assert code == 0 and "160 248 104 209 394" in out and "315 391 221" in out


def test_generate_with_an_uninstalled_framework_is_an_error(capsys, monkeypatch):
    def unavailable(name):
        raise ports.PortUnavailable(name, "No module named 'jax'")
    monkeypatch.setattr(cli, "load_port", unavailable)
    code, out, err = run_cli(["generate", "--framework", "jax", "--mode", "cached"], capsys)
    assert (code, out) == (2, "")
    assert err == "error: framework 'jax' is not available (No module named 'jax')\n"


def test_compare_skips_an_uninstalled_framework_and_still_agrees(capsys, monkeypatch):
    real = ports.available_port
    monkeypatch.setattr(cli, "available_port", lambda name: None if name == "jax" else real(name))
    code, out, _ = run_cli(["compare", "--json", "--new-tokens", "10"], capsys)
    result = json.loads(out)
    assert code == 0 and result["ok"]
    assert [row["available"] for row in result["rows"] if row["framework"] == "jax"] == [False, False]


def test_compare_reports_every_path_agreeing_on_the_golden_tokens(capsys):
    for name in ports.PORTS:
        port_or_skip(name)
    code, out, _ = run_cli(["compare", "--json", "--new-tokens", "100"], capsys)
    result = json.loads(out)
    assert code == 0 and result["ok"]
    assert result["tokens"] == [[160, 248, 104, 209, 394] + GOLDEN]
    assert len(result["rows"]) == 6 and all(row["agree"] for row in result["rows"])
    assert all(row["cached_speedup"] > 0 for row in result["rows"] if row["mode"] == "cached")


def test_compare_exits_1_when_a_path_disagrees(capsys, monkeypatch):
    torch_port = port_or_skip("torch")

    class Broken:
        NAME = "numpy"

        def __getattr__(self, name):
            return getattr(torch_port, name)

        @staticmethod
        def generate(model, prompts, new_tokens, mode, return_logits=False):
            tokens, logits = torch_port.generate(model, prompts, new_tokens, mode, return_logits)
            tokens = tokens.copy()
            tokens[:, -1] = (tokens[:, -1] + 1) % 500  # a real bug: the last token is wrong
            return tokens, logits

    real = ports.available_port
    monkeypatch.setattr(cli, "available_port", lambda name: Broken() if name == "numpy" else (None if name == "jax" else real(name)))
    code, out, _ = run_cli(["compare", "--json", "--new-tokens", "10"], capsys)
    result = json.loads(out)
    assert code == 1 and not result["ok"]
    broken = [row for row in result["rows"] if row["framework"] == "numpy"]
    assert all(row["first_divergent_step"] == 9 and not row["explained"] for row in broken)


def test_init_weights_seed_0_reproduces_the_shipped_seed_model_bit_for_bit(tmp_path, capsys):
    port_or_skip("torch")
    out_file = tmp_path / "seed.safetensors"
    code, _, _ = run_cli(["init-weights", "--out", str(out_file), "--seed", "0"], capsys)
    assert code == 0
    shipped_config, shipped = load_weights(DEFAULT_WEIGHTS)
    config, tensors = load_weights(out_file)
    assert config == shipped_config and list(tensors) == list(shipped)
    for name in shipped:
        assert tensors[name].tobytes() == shipped[name].tobytes(), name


def test_init_weights_writes_any_config_and_dtype(tmp_path, capsys):
    port_or_skip("torch")
    out_file = tmp_path / "small.safetensors"
    code, out, _ = run_cli(["init-weights", "--out", str(out_file), "--seed", "3", "--vocab-size", "50", "--d-model", "32",
                            "--n-heads", "2", "--n-layers", "3", "--max-seq-len", "64", "--dtype", "float64"], capsys)
    config, tensors = load_weights(out_file)
    assert code == 0 and "wrote" in out
    assert (config.vocab_size, config.d_model, config.n_heads, config.n_layers, config.max_seq_len) == (50, 32, 2, 3, 64)
    assert all(array.dtype == np.float64 for array in tensors.values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.safetensors"]  # no temp file left behind


def test_init_weights_refuses_to_overwrite_without_force(tmp_path, capsys):
    port_or_skip("torch")
    out_file = tmp_path / "taken.safetensors"
    out_file.write_bytes(b"precious")
    code, out, err = run_cli(["init-weights", "--out", str(out_file)], capsys)
    assert (code, out) == (2, "") and "exists; pass --force" in err
    assert out_file.read_bytes() == b"precious"
    code, _, _ = run_cli(["init-weights", "--out", str(out_file), "--force"], capsys)
    assert code == 0 and load_weights(out_file)[0].d_model == 128


@pytest.mark.parametrize("argv, expected", [
    (["--d-model", "130", "--n-heads", "4"], "d_model=130 is not divisible by n_heads=4"),
    (["--n-layers", "0"], "n_layers=0 must be an integer >= 1"),
])
def test_init_weights_refuses_an_impossible_config(tmp_path, capsys, argv, expected):
    code, out, err = run_cli(["init-weights", "--out", str(tmp_path / "x.safetensors"), *argv], capsys)
    assert (code, out) == (2, "") and expected in err
