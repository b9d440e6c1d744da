"""`kvports generate`: its JSON's contract fields, its defaults (the seed's prompt, 100 tokens),
its text output ending with time to first token and tokens per second, an uninstalled framework
as one error line, each input checked once, a compiling port left its compiled loop."""

from __future__ import annotations

import json

import pytest

from kvports import registry
from kvports.registry import COMPILES
from tests.helpers.commands import assert_one_error_line, run_cli
from tests.helpers.models import GOLDEN
from tests.helpers.ports import port_or_skip


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


def test_generate_checks_each_input_once(capsys, monkeypatch, tmp_path):
    from kvports import run, validation
    from kvports.formats.weights import save_weights
    from kvports.shared.config import ModelConfig
    from tests.helpers.models import random_weights

    draft = tmp_path / "draft.safetensors"
    config = ModelConfig(d_model=16, n_heads=2, n_layers=1)
    save_weights(draft, random_weights(config), config)
    names = ("check_prompts", "check_seeds", "check_draft", "check_draft_model", "check_needed", "check_run")
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


# --- how fast a run was ---------------------------------------------------------------------------


def test_generate_ends_with_time_to_first_token_and_tokens_per_second(port, capsys):
    code, out, err = run_cli(capsys, "generate", "--framework", port.NAME, "--mode", "cached", "--new-tokens", "3")
    assert code == 0 and err.count("\n") == 1
    assert err.startswith("time to first token ") and err.rstrip().endswith(" tokens/s")
    code, out, err = run_cli(
        capsys, "generate", "--framework", port.NAME, "--mode", "cached", "--new-tokens", "3", "--json"
    )
    figures = json.loads(out)
    assert (code, err) == (0, "") and figures["tokens_per_second"] == pytest.approx(3 / figures["seconds"])
    if port.NAME in COMPILES:  # its one compiled loop hands every token over at once: nothing to time
        assert figures["first_token_seconds"] is None
    else:
        assert 0 < figures["first_token_seconds"] <= figures["seconds"]


def test_generate_with_a_compiling_port_keeps_its_compiled_loop(monkeypatch, capsys):
    """Listening for the first token would send JAX to its stepwise loop: without --stream it is not asked to."""
    port = port_or_skip("jax")
    calls = []
    real = port.generate
    monkeypatch.setattr(port, "generate", lambda *a, **k: calls.append(k.get("on_token")) or real(*a, **k))
    code, _, _ = run_cli(capsys, "generate", "--framework", "jax", "--mode", "cached", "--new-tokens", "3")
    assert code == 0 and calls == [None]
